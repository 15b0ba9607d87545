"""Reward functions: plain functions of (response text, reference answer) -> float."""
from hpcrl.rewards.math import answer_reward, score_responses

__all__ = ["answer_reward", "score_responses"]
