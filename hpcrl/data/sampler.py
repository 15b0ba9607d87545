"""An epoch-shuffled, resumable prompt sampler: its whole state is (epoch, position)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class SamplerState:
    epoch: int = 0
    position: int = 0


class ResumableSampler(Generic[T]):
    """Yields batches from a list, reshuffled each epoch with a seed derived from (seed, epoch).

    Because the order is a pure function of (seed, epoch), saving `state` is enough to resume
    exactly where a preempted run stopped.
    """

    def __init__(self, items: list[T], seed: int, state: SamplerState | None = None):
        if not items:
            raise ValueError("the prompt set is empty")
        self.items = items
        self.seed = seed
        self.state = state or SamplerState()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[T]:
        batch: list[T] = []
        while len(batch) < size:
            order = self._order(self.state.epoch)
            take = order[self.state.position:self.state.position + size - len(batch)]
            batch.extend(self.items[i] for i in take)
            self.state.position += len(take)
            if self.state.position >= len(order):
                self.state = SamplerState(self.state.epoch + 1, 0)
        return batch
