"""Environments by the name a job gives them, or a user's factory by `package.module:function`.

An `EnvSpec` is what travels to an env's host process: a name and keyword arguments, so that
the env is built where it runs (nothing unpicklable crosses a process boundary)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcrl.envs.base import TextEnv
from hpcrl.plugins import import_function


def _frozenlake(**kwargs) -> TextEnv:
    from hpcrl.envs.frozenlake import FrozenLake
    return FrozenLake(**kwargs)


def _sokoban(**kwargs) -> TextEnv:
    from hpcrl.envs.sokoban import Sokoban
    return Sokoban(**kwargs)


def _guess_number(**kwargs) -> TextEnv:
    from hpcrl.envs.guess_number import GuessNumber
    return GuessNumber(**kwargs)


def _tools(**kwargs) -> TextEnv:
    from hpcrl.envs.tools import ToolEnv
    return ToolEnv(**kwargs)


ENVS: dict[str, Callable[..., TextEnv]] = {
    "frozenlake": _frozenlake, "sokoban": _sokoban, "guess_number": _guess_number, "tools": _tools,
}


@dataclass(frozen=True)
class EnvSpec:
    """`name`: a built-in env, or `package.module:function` returning a TextEnv (for instance a
    GymTextEnv around a gymnasium env); `options`: its keyword arguments."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    def factory(self) -> Callable[..., TextEnv]:
        if self.name in ENVS:
            return ENVS[self.name]
        if ":" not in self.name:
            raise ValueError(f"unknown env {self.name!r}: use one of {', '.join(ENVS)}, or package.module:function "
                             "returning a hpcrl.envs.TextEnv")
        return import_function(self.name, f"env {self.name!r}", "every env rank")

    def build(self) -> TextEnv:
        env = self.factory()(**self.options)
        if not isinstance(env, TextEnv):
            raise TypeError(f"env {self.name!r} built a {type(env).__name__}, not a hpcrl.envs.TextEnv")
        return env
