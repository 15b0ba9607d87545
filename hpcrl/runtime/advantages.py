"""From rewards to per-token advantages, as the job's `algorithm` asks (runs on the controller)."""
from __future__ import annotations

import torch

from hpcrl.algos import (
    broadcast_sequence_advantages,
    grpo_advantages,
    kl_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from hpcrl.config.job import AlgorithmConfig
from hpcrl.engines.batch import length_mask, right_pad


def token_advantages(algo: AlgorithmConfig, rewards: list[float], group_index: list[int],
                     response_lengths: list[int], old_logprobs: list[list[float]],
                     ref_logprobs: list[list[float]] | None) -> list[list[float]]:
    """Advantages on every response token. GRPO and RLOO are sequence-level and broadcast to tokens;
    REINFORCE++ puts the reward on the last token, the KL penalty on every token, and whitens."""
    reward_t = torch.tensor(rewards, dtype=torch.float32)
    groups_t = torch.tensor(group_index, dtype=torch.long)
    mask = length_mask(response_lengths)
    if algo.name == "grpo":
        adv = broadcast_sequence_advantages(grpo_advantages(reward_t, groups_t, normalize_std=algo.normalize_std), mask)
    elif algo.name == "rloo":
        adv = broadcast_sequence_advantages(rloo_advantages(reward_t, groups_t), mask)
    else:
        token_rewards = torch.zeros_like(mask)
        last = (torch.tensor(response_lengths) - 1).clamp(min=0)
        token_rewards[torch.arange(len(rewards)), last] = reward_t
        if ref_logprobs is not None and algo.kl_coef > 0:
            old = right_pad(old_logprobs, 0.0, torch.float32)
            ref = right_pad(ref_logprobs, 0.0, torch.float32)
            token_rewards -= algo.kl_coef * kl_penalty(old, ref, algo.kl_estimator) * mask
        adv = reinforce_pp_advantages(token_rewards, mask)
    return [row[:n] for row, n in zip(adv.tolist(), response_lengths)]


def mean_kl(old_logprobs: list[list[float]], ref_logprobs: list[list[float]], estimator: str) -> float:
    """The token-mean KL of the policy that generated the batch from the reference (for the logs)."""
    old = right_pad(old_logprobs, 0.0, torch.float32)
    ref = right_pad(ref_logprobs, 0.0, torch.float32)
    mask = length_mask([len(r) for r in old_logprobs])
    return float((kl_penalty(old, ref, estimator) * mask).sum() / mask.sum().clamp(min=1))
