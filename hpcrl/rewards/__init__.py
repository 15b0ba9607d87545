"""Reward functions: plain functions of (response, reference) in a registry, scored per domain."""
from hpcrl.rewards.base import Response, RewardTimeout, Scored
from hpcrl.rewards.math import answer_reward
from hpcrl.rewards.registry import REWARDS, reward_function
from hpcrl.rewards.scoring import RewardSpec, code_counts, reward_specs, score_batch

__all__ = ["REWARDS", "Response", "RewardSpec", "RewardTimeout", "Scored", "answer_reward", "code_counts",
           "reward_function", "reward_specs", "score_batch"]
