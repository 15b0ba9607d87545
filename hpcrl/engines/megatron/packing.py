"""Prompt + response rows for a Megatron GPTModel: each sequence starts at column 0.

megatron-core's rotary embedding numbers positions 0..L-1 and ignores position ids, so the
left-padded layout of hpcrl.engines.batch (positions counting real tokens only) is re-laid out
here: row i is prompt_i + response_i followed by padding. A plain causal mask is then exact (a
token never sees the padding after it), every real token has the position the HF model and the
rollout gave it, and the log-probabilities agree token for token with the other engines.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hpcrl.engines.batch import length_mask, right_pad


def pack(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
         columns: dict[str, Sequence[Sequence[float]]] | None = None) -> dict[str, torch.Tensor]:
    """tokens/targets [N, L], the positions predicting each response token `index` [N, R], the
    response mask [N, R], and the per-token `columns` right-padded to [N, R] (0 on padding)."""
    rows = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(row) for row in rows)
    resp_width = max(1, max(len(r) for r in responses))
    tokens = torch.full((len(rows), width + 1), pad_id, dtype=torch.long)
    index = torch.zeros((len(rows), resp_width), dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        # logits at position t predict token t + 1: response token j is predicted at len(prompt) - 1 + j
        index[i] = (len(prompt) - 1 + torch.arange(resp_width)).clamp(max=width - 1)
    packed = {"tokens": tokens[:, :width], "targets": tokens[:, 1:], "index": index,
              "response_mask": _fit(length_mask([len(r) for r in responses]), resp_width)}
    for name, values in (columns or {}).items():
        packed[name] = _fit(right_pad(values, 0.0, torch.float32), resp_width)
    return packed


def _fit(values: torch.Tensor, width: int) -> torch.Tensor:
    return values[:, :width] if values.shape[1] >= width else F.pad(values, (0, width - values.shape[1]))


def causal_mask(length: int, device: torch.device | str) -> torch.Tensor:
    """Megatron's boolean attention mask [1, 1, L, L]: True where a query may NOT attend."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def micro_batches(batch: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """`count` equal slices of every tensor along the sample dimension (shapes must match for PP)."""
    size = next(iter(batch.values())).shape[0]
    if size % count:
        raise ValueError(f"{size} samples do not split into {count} equal micro-batches")
    return [{k: v[i * size // count:(i + 1) * size // count] for k, v in batch.items()} for i in range(count)]


def micro_batch_count(samples: int, pp: int) -> int:
    """The smallest divisor of `samples` that is at least `pp` (enough micro-batches to fill the
    pipeline), or `samples` itself."""
    return next(m for m in range(min(pp, samples), samples + 1) if samples % m == 0)
