"""Prompt + response rows for a Megatron GPTModel: each sequence starts at column 0.

megatron-core's rotary embedding numbers positions 0..L-1 and ignores position ids, so the
left-padded layout of hpcrl.engines.batch (positions counting real tokens only) is re-laid out
here: row i is prompt_i + response_i followed by padding. A plain causal mask is then exact (a
token never sees the padding after it), every real token has the position the HF model and the
rollout gave it, and the log-probabilities agree token for token with the other engines.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcrl.engines.batch import length_mask, right_pad
from hpcrl.engines.micro_batches import MicroBatching
from hpcrl.ragged import Ragged
from hpcrl.placement.memory import pipeline_micro_batches


def pack(prompts: Ragged, responses: Ragged, pad_id: int, columns: dict[str, Ragged] | None = None,
         width: int | None = None, resp_width: int | None = None, multiple: int = 1) -> dict[str, torch.Tensor]:
    """tokens/targets [N, L], the real tokens' mask `token_mask` [N, L], the positions predicting each
    response token `index` [N, R], the response mask [N, R], and the per-token `columns`
    right-padded to [N, R] (0 on padding).
    L and R default to the longest row's; pipeline stages exchange fixed shapes, so with pp > 1
    every micro-batch of a step is packed to the same `width` and `resp_width`. L is rounded up to
    a `multiple` (tp: sequence parallelism splits the positions evenly over the TP ranks)."""
    prompt_lengths = prompts.lengths
    rows = Ragged.concat_rows(prompts, responses)
    width = -(-(width or max(1, rows.max_length())) // multiple) * multiple
    resp_width = resp_width or max(1, responses.max_length())
    tokens = torch.from_numpy(rows.padded(width + 1, pad_id).astype(np.int64))
    # logits at position t predict token t + 1: response token j is predicted at len(prompt) - 1 + j
    index = torch.from_numpy(np.minimum(prompt_lengths[:, None] - 1 + np.arange(resp_width)[None], width - 1))
    packed = {"tokens": tokens[:, :width], "targets": tokens[:, 1:], "index": index,
              "token_mask": length_mask(rows.lengths, torch.bool, width),
              "response_mask": length_mask(responses.lengths, width=resp_width)}
    for name, values in (columns or {}).items():
        packed[name] = right_pad(values, 0.0, torch.float32, resp_width)
    return packed


def causal_mask(length: int, device: torch.device | str) -> torch.Tensor:
    """Megatron's boolean attention mask [1, 1, L, L]: True where a query may NOT attend."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def equal_micro_batches(cut: MicroBatching, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
                        pp: int, at_least: int = 1) -> list[np.ndarray]:
    """Micro-batches of one size for a pipeline (pp > 1): the fewest, at least `pp` to fill it (or
    one per sample) and at least `at_least`, with no more than `cut.samples` rows and `cut.tokens`
    padded tokens each at the step's common width; rows grouped by length."""
    samples = len(prompt_lengths)
    order = np.argsort(-(np.asarray(prompt_lengths) + np.asarray(response_lengths)), kind="stable")
    width = cut.width(prompt_lengths, response_lengths)

    def fits(count: int) -> bool:
        size = samples // count
        return (cut.samples is None or size <= cut.samples) and (cut.tokens is None or size * width <= cut.tokens)

    return list(order.reshape(pipeline_micro_batches(samples, pp, fits, at_least), -1))
