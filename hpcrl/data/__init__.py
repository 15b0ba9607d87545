"""Prompt datasets, built-in synthetic tasks, the task tokenizer and a resumable sampler."""
from hpcrl.data.sampler import DomainSampler, ResumableSampler, SamplerState
from hpcrl.data.tasks import Prompt, addition_prompts, fit_context, load_prompts
from hpcrl.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = ["DomainSampler", "ResumableSampler", "SamplerState", "Prompt", "addition_prompts", "fit_context", "load_prompts", "CharTokenizer", "HFTokenizer", "load_tokenizer"]
