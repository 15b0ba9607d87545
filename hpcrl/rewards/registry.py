"""Reward functions by the name a job gives them (`datasets[].reward`), or a user's by dotted path."""
from __future__ import annotations

from hpcrl.plugins import import_function
from hpcrl.rewards.base import RewardFunction
from hpcrl.rewards.code import code_reward
from hpcrl.rewards.judge import judge_reward
from hpcrl.rewards.math import math_reward, number_reward
from hpcrl.rewards.text_rules import choice_reward, format_reward, ifeval_reward

REWARDS: dict[str, RewardFunction] = {
    "number": number_reward,
    "math": math_reward,
    "code": code_reward,
    "choice": choice_reward,
    "format": format_reward,
    "ifeval": ifeval_reward,
    "judge": judge_reward,
}


def reward_function(name: str) -> RewardFunction:
    """A registered reward, or `package.module:function` (a function `(response, reference, **reward_args)
    -> float | Scored`, importable on every rank that scores)."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}: use one of {', '.join(REWARDS)}, or package.module:function "
                         "for your own")
    return import_function(name, f"reward {name!r}", "every rank that scores")
