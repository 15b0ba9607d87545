"""Cutting a minibatch into micro-batches: by sample count and padded-token budget, grouped by length.

Every engine accumulates gradients over the micro-batches of one optimizer step (the loss
shares of hpcrl.engines.objective make that exact), so the cut only changes memory and speed.
Samples are sorted by length first, longest first, so that a micro-batch pads its rows to a
length close to each of theirs: the padded fraction of the work stays small.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MicroBatching:
    """How to cut: at most `samples` rows and at most `tokens` padded tokens (rows x width) per
    micro-batch (None: no bound). `joined`: rows are laid out prompt+response from column 0, so
    a micro-batch's width is its longest sequence (Megatron); otherwise prompts are left-padded
    and responses right-padded, width = longest prompt + longest response (HF engines)."""

    samples: int | None = None
    tokens: int | None = None
    joined: bool = False

    def width(self, prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> int:
        if not len(prompt_lengths):
            return 0
        if self.joined:
            return int((prompt_lengths + response_lengths).max())
        return int(prompt_lengths.max() + max(1, response_lengths.max()))

    def split(self, prompt_lengths: np.ndarray, response_lengths: np.ndarray) -> list[np.ndarray]:
        """Row indices of each micro-batch, longest rows first; every row in exactly one."""
        prompt_lengths = np.asarray(prompt_lengths, np.int64)
        response_lengths = np.asarray(response_lengths, np.int64)
        order = np.argsort(-(prompt_lengths + response_lengths), kind="stable")
        groups: list[list[int]] = []
        current: list[int] = []
        for row in order:
            candidate = current + [int(row)]
            too_many = self.samples is not None and len(candidate) > self.samples
            too_wide = (self.tokens is not None and
                        len(candidate) * self.width(prompt_lengths[candidate], response_lengths[candidate]) > self.tokens)
            if current and (too_many or too_wide):
                groups.append(current)
                candidate = [int(row)]
            current = candidate
        if current:
            groups.append(current)
        return [np.asarray(g, np.int64) for g in groups]

    def padding_fraction(self, prompt_lengths: np.ndarray, response_lengths: np.ndarray,
                         groups: list[np.ndarray]) -> float:
        """The share of the micro-batches' tokens (rows x width) that is padding."""
        real = float(np.sum(prompt_lengths) + np.sum(response_lengths))
        padded = float(sum(len(g) * self.width(prompt_lengths[g], response_lengths[g]) for g in groups))
        return 1.0 - real / padded if padded else 0.0


def micro_batching(train, joined: bool = False) -> MicroBatching:
    """From the job's `train` settings."""
    return MicroBatching(train.micro_batch_size, train.max_tokens_per_micro_batch, joined)
