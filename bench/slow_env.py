"""bench/agentic.py's env: FrozenLake whose every step also takes a long-tailed time. A module of its
own, light to import: each env process imports it (and not the bench's torch)."""
from __future__ import annotations

import time

import numpy as np

from hpcrl.envs import StepResult
from hpcrl.envs.frozenlake import FrozenLake

PARETO_SHAPE = 1.2


class SlowFrozenLake(FrozenLake):
    """The step's delay: Pareto(1.2) with median `median_ms`, capped at `cap_s`, drawn from the
    episode's seed and step (the same episode waits the same)."""

    def __init__(self, median_ms: float = 20.0, cap_s: float = 1.0):
        super().__init__()
        self.scale_s = median_ms / 1000 / (2 ** (1 / PARETO_SHAPE) - 1)   # the median is scale * (2^(1/a) - 1)
        self.cap_s, self.rng = cap_s, np.random.default_rng(0)

    def reset(self, seed: int) -> str:
        self.rng = np.random.default_rng(seed)
        return super().reset(seed)

    def step(self, action: str) -> StepResult:
        time.sleep(min(self.cap_s, self.scale_s * self.rng.pareto(PARETO_SHAPE)))
        return super().step(action)


def slow_frozenlake(**options) -> SlowFrozenLake:
    return SlowFrozenLake(**options)
