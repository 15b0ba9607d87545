"""Envs that misbehave on purpose, importable by the env host's processes (`tests.envs_for_tests:...`)."""
from __future__ import annotations

import os
import time

from hpcrl.envs.base import StepResult, TextEnv


class Misbehaving(TextEnv):
    """Sleeps forever on the action "hang", raises on "raise", exits its process on "die"; otherwise
    counts its steps. Its resets are counted over its life, so a replaced env is visible (it starts at 1)."""

    def __init__(self) -> None:
        self.steps = self.resets = 0

    def reset(self, seed: int) -> str:
        self.steps = 0
        self.resets += 1
        return f"seed {seed} reset {self.resets}"

    def step(self, action: str) -> StepResult:
        if action == "hang":
            time.sleep(3600)
        if action == "raise":
            raise ValueError("the env broke")
        if action == "die":
            os._exit(3)
        self.steps += 1
        return StepResult(f"step {self.steps}", 0.0, False, {})


def misbehaving() -> TextEnv:
    return Misbehaving()


def gym_frozenlake() -> TextEnv:
    """gymnasium's FrozenLake-v1 (4x4, non-slippery) through the adapter: the state index shown as its
    row and column, actions as gymnasium numbers them (0 left, 1 down, 2 right, 3 up)."""
    import gymnasium

    from hpcrl.envs.gym_adapter import GymTextEnv

    actions = {"L": 0, "D": 1, "R": 2, "U": 3}
    return GymTextEnv(gymnasium.make("FrozenLake-v1", is_slippery=False), render=lambda s: f"{s // 4} {s % 4}",
                      parse=lambda text: actions.get(text.strip().upper()[:1]), action_format="L, D, R or U")


class Paced(TextEnv):
    """An episode of `length` steps whose every step takes `seed % 10 * delay_s` seconds; seed
    `raise_seed` raises at its first step, `hang_seed` hangs. Reward 1 at the end; observations
    count the steps. With `pid_dir`, each env process leaves a file there named by the pid of the
    rank that started it (which rank hosts the envs)."""

    system_prompt = "go"
    alphabet = "0123456789 step"

    def __init__(self, length: int = 3, delay_s: float = 0.05, raise_seed: int = 98, hang_seed: int = 99,
                 pid_dir: str | None = None) -> None:
        self.length, self.delay_s, self.seed, self.steps = length, delay_s, 0, 0
        self.raise_seed, self.hang_seed = raise_seed, hang_seed
        if pid_dir is not None:
            open(os.path.join(pid_dir, str(os.getppid())), "w").close()

    def reset(self, seed: int) -> str:
        self.seed, self.steps = seed, 0
        return "0"

    def step(self, action: str) -> StepResult:
        if self.seed == self.raise_seed:
            raise RuntimeError("broken on purpose")
        time.sleep(3600 if self.seed == self.hang_seed else self.seed % 10 * self.delay_s)
        self.steps += 1
        done = self.steps >= self.length
        return StepResult(f"step {self.steps}", float(done), done, {"success": done})


def paced(**options) -> TextEnv:
    return Paced(**options)
