"""The environment interface of agentic RL: text in, text out.

The policy reads a system prompt once, then an observation per turn, and answers each with an
action written as `action_format` says. An env never sees tokens: the rollout applies the chat
template and tokenizes, so one env serves any model. `alphabet` lists every character an env's
observations and valid actions use, from which a character tokenizer for a tiny model is built.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StepResult:
    """One turn's answer. `info` may carry `success` (the episode reached its goal) and `invalid`
    (the action could not be parsed; the state did not change)."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(ABC):
    """An episode per `reset(seed)`: the same seed gives the same episode on any rank, so a
    trajectory lost to a preemption or a replaced env restarts from its seed alone."""

    system_prompt: str = ""
    action_format: str = ""
    alphabet: str = ""
    invalid_reward: float = 0.0   # what an unparsable action earns (a format penalty when negative)
    # whether an observation alone is the env's state (a grid game). False when it leaves out what came
    # before (guess-number's "higher"): GiGPO then takes a turn's whole history as the state it acted from
    observation_is_state: bool = True

    @abstractmethod
    def reset(self, seed: int) -> str:
        """Start an episode; returns the first observation."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply the policy's action text."""

    def invalid(self, action: str, observation: str) -> StepResult:
        """An action the env cannot parse: `invalid_reward`, the state unchanged, the episode goes on."""
        return StepResult(observation, self.invalid_reward, False, {"invalid": True, "action": action[:80]})


MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}


MOVE_WORDS = {"up": "U", "down": "D", "left": "L", "right": "R"}


def parse_move(action: str) -> tuple[int, int] | None:
    """A grid move: its letter U, D, L or R as the action format asks ('R', ' R ', 'R!'), or its word
    in any case ('right', 'Up'). A lone lowercase letter is no move: an env's character vocabulary
    holds 'd' and 'r' (from its instructions) but not 'u' or 'l', and accepting them gave a random
    policy down and right twice as often as up and left."""
    words = action.split()
    if not words:
        return None
    letter = MOVE_WORDS.get(words[0].lower().strip(".,!"), words[0][0])
    return MOVES.get(letter)
