"""Any gymnasium environment as a text env, given how to show its observations and read actions."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpcrl.envs.base import StepResult, TextEnv


class GymTextEnv(TextEnv):
    """`render(observation) -> str` shows an observation to the policy; `parse(text)` turns an
    action text into the env's action, or None when it is not one (an invalid turn: no step)."""

    def __init__(self, env: Any, render: Callable[[Any], str], parse: Callable[[str], Any | None],
                 system_prompt: str = "", action_format: str = "", alphabet: str = ""):
        self.env, self.render, self.parse = env, render, parse
        self.system_prompt, self.action_format, self.alphabet = system_prompt, action_format, alphabet
        self.observation: Any = None

    def reset(self, seed: int) -> str:
        self.observation, _ = self.env.reset(seed=seed)
        return self.render(self.observation)

    def step(self, action: str) -> StepResult:
        parsed = self.parse(action)
        if parsed is None or not self.env.action_space.contains(parsed):
            return self.invalid(action, self.render(self.observation))
        self.observation, reward, terminated, truncated, info = self.env.step(parsed)
        return StepResult(self.render(self.observation), float(reward), bool(terminated or truncated),
                          {**info, "truncated": bool(truncated)} if truncated else dict(info))
