"""The policy model: a Hugging Face causal LM, dense (Qwen2, LLaMA) or mixture-of-experts (Qwen2-MoE,
Qwen3-MoE, Mixtral), with seeded random weights, from the job's sizes.

Using the HF classes (not a toy model of our own) means random and real checkpoints take one
path: the random model is saved as a HF directory once (engines/model_files.py) and every engine
loads it from there, as it would `model.path`.
"""
from __future__ import annotations

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedModel,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

from hpcrl.config.job import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ARCH = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
         "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
         "mixtral": (MixtralConfig, MixtralForCausalLM)}
ARCHS = tuple(_ARCH)


def _expert_kwargs(model: ModelConfig) -> dict:
    """The MoE fields of each arch's HF config (every layer sparse, no router jitter)."""
    experts, per_token, width, shared = model.expert_sizes()
    if not experts:
        return {}
    if model.arch == "mixtral":   # Mixtral's experts take intermediate_size; it has no dense MLP
        return {"num_local_experts": experts, "num_experts_per_tok": per_token, "intermediate_size": width}
    kwargs = {"num_experts": experts, "num_experts_per_tok": per_token, "moe_intermediate_size": width,
              "decoder_sparse_step": 1, "mlp_only_layers": []}
    if model.arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = shared
    else:   # Qwen3-MoE's released models renormalise the top-k routing weights (transformers' default does not)
        kwargs["norm_topk_prob"] = True
    return kwargs


def hf_config(model: ModelConfig, vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int):
    config_cls, _ = _ARCH[model.arch]
    return config_cls(**{
        "vocab_size": model.vocab_size or vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_width,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "pad_token_id": pad_id,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        **_expert_kwargs(model),
    })


def random_model(model: ModelConfig, tokenizer, seed: int) -> PreTrainedModel:
    """The whole model with weights drawn from `seed` (the same seed gives bit-identical weights),
    built in the job's dtype (a 16-bit model never exists in fp32). For the controller to write
    once (engines/model_files.py); a job too large for one host's memory starts from model.path."""
    config = hf_config(model, tokenizer.vocab_size, tokenizer.pad_token_id, tokenizer.bos_token_id,
                       tokenizer.eos_token_id)
    _, model_cls = _ARCH[model.arch]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls._from_config(config, dtype=DTYPES[model.dtype])
