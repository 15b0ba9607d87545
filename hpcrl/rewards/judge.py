"""Model-as-judge reward: a generation model reads the question, the response (and the reference) and
writes a score, as ROLL's and OpenRLHF's LLM judges do.

The judge is a Hugging Face causal LM from a local directory (`reward_args.model`), loaded once per
scoring process (a reward worker, or the controller) on its CPU and run by the native sampler,
greedily, on the whole batch of a domain at once (a vLLM judge on the reward role's GPUs is not
wired yet). Its prompt is `reward_args.template`, formatted with
{prompt}, {response} and {reference}; the reward is the first number the judge writes (matched by
`pattern`) divided by `scale`, clipped to [0, 1]; a judge that writes no number scores 0 with the
code "judge_unparsed".
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from hpcrl.rewards.base import Response, Scored

DEFAULT_TEMPLATE = ("Rate the answer to the question from 0 to 10.\nQuestion: {prompt}\nReference: {reference}\n"
                    "Answer: {response}\nScore:")


@lru_cache(maxsize=2)
def _judge(model: str):
    """(tokenizer, sampler) of the judge model at `model`, built once per process."""
    from hpcrl.data.tokenizer import HFTokenizer
    from hpcrl.engines.model_files import ModelFiles, load_full
    from hpcrl.engines.native_sampler import NativeSampler

    tokenizer = HFTokenizer(model)
    network = load_full(ModelFiles(model), torch.float32).requires_grad_(False)
    return tokenizer, NativeSampler(network, tokenizer.stop_token_ids, tokenizer.pad_token_id)


def judge_reward(responses: Sequence[Response], references: Sequence[str], model: str,
                 template: str = DEFAULT_TEMPLATE, pattern: str = r"\d+(?:\.\d+)?", scale: float = 10.0,
                 max_new_tokens: int = 4) -> list[Scored]:
    """Scores of a batch of responses by the judge model (see the module doc)."""
    from hpcrl.engines.native_sampler import SamplingParams
    from hpcrl.ragged import Ragged

    tokenizer, sampler = _judge(model)
    prompts = Ragged.from_rows([tokenizer.encode(template.format(prompt=r.prompt, response=r.text, reference=ref))
                                for r, ref in zip(responses, references)], np.int32)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens, greedy=True), torch.Generator().manual_seed(0))
    scores = []
    for ids in out.response_ids:
        found = re.search(pattern, tokenizer.decode(ids.tolist()))
        scores.append(Scored(min(1.0, max(0.0, float(found.group()) / scale)), "ok") if found
                      else Scored(0.0, "judge_unparsed"))
    return scores


judge_reward.batched = True   # score_batch hands it a domain's whole batch
