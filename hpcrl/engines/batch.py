"""Padding prompts and responses into tensors, and the log-probabilities of response tokens.

Layout: prompts are left-padded to P, responses right-padded to R, so that every response starts
at column P; positions count only real tokens. Rollout and training share this one layout, which
keeps their log-probabilities comparable token for token.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[float]], pad: float, dtype: torch.dtype) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def length_mask(lengths: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, max length] with 1 on each row's first `lengths[i]` columns: which response tokens are real."""
    return right_pad([[1] * n for n in lengths], 0, dtype)


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + response ids with masks; `response_mask` marks the tokens that were generated."""
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids = right_pad(responses, pad_id, torch.long)
    response_mask = length_mask([len(r) for r in responses], torch.long)
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": positions(attention_mask),
        "response_ids": response_ids,
        "response_mask": response_mask.float(),
    }


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(token) under softmax(logits / temperature), the distribution rollout samples from."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def response_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probabilities [N, R] of the response tokens (and their entropy if asked)."""
    response_len = batch["response_ids"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"], use_cache=False).logits
    logits = logits[:, -response_len - 1:-1]
    logp = token_logprobs(logits, batch["response_ids"], temperature)
    entropy = None
    if with_entropy:
        probs = F.softmax(logits.float() / temperature, dim=-1)
        entropy = -(probs * F.log_softmax(logits.float() / temperature, dim=-1)).sum(-1)
    return logp, entropy
