"""Epoch-shuffled, resumable prompt samplers: one list (state: epoch, position), or a mixture of domains."""
from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import asdict, dataclass
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
        self._shuffled: tuple[int, list[int]] = (-1, [])   # (epoch, its order): drawn once per epoch

    def _order(self, epoch: int) -> list[int]:
        """The epoch's order, shuffled once (a draw per prompt would shuffle the whole set each time:
        32 shuffles of a 100k-prompt set per step is a second of the controller's time)."""
        if self._shuffled[0] != epoch:
            order = list(range(len(self.items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._shuffled = (epoch, order)
        return self._shuffled[1]

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


class DomainSampler(Generic[T]):
    """Prompts of several domains mixed by fixed shares (ROLL's domain_interleave_probs).

    Draw n's domain is a pure function of (seed, n) and each domain has its own ResumableSampler, so
    the state (draws so far, each domain's (epoch, position)) resumes the mixture exactly. One
    domain is one ResumableSampler with the job's seed.
    """

    def __init__(self, prompts: dict[str, list[T]], seed: int, shares: dict[str, float] | None = None):
        self.domains = list(prompts)
        self.samplers = {d: ResumableSampler(prompts[d], seed + 1_000_003 * i) for i, d in enumerate(self.domains)}
        weights = [float((shares or {}).get(d, len(prompts[d]))) for d in self.domains]
        total = sum(weights)
        self.cumulative = list(itertools.accumulate(w / total for w in weights))
        self.seed = seed
        self.draws = 0

    def _domain(self, draw: int) -> str:
        if len(self.domains) == 1:
            return self.domains[0]
        u = random.Random(self.seed * 7_919 + draw).random()
        return self.domains[min(bisect.bisect_right(self.cumulative, u), len(self.domains) - 1)]

    def next_batch(self, size: int) -> list[T]:
        batch = []
        for _ in range(size):
            batch += self.samplers[self._domain(self.draws)].next_batch(1)
            self.draws += 1
        return batch

    def state_dict(self) -> dict:
        return {"draws": self.draws, "domains": {d: asdict(s.state) for d, s in self.samplers.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.draws = int(state["draws"])
        for domain, saved in state["domains"].items():
            if domain not in self.samplers:
                raise ValueError(f"the checkpoint's sampler has a domain {domain!r} this job does not "
                                 f"({', '.join(self.domains)})")
            self.samplers[domain].state = SamplerState(**saved)
