"""From rewards to per-token advantages, as the job's `algorithm` asks (runs on the controller).

Token columns are packed (`hpcrl.ragged`): sequence-level advantages are repeated onto their
tokens, token-level ones computed on one padded [N, T] tensor; no Python loop over tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from hpcrl.algos import grpo_advantages, kl_penalty, reinforce_pp_advantages, rloo_advantages
from hpcrl.config.job import AlgorithmConfig
from hpcrl.engines.batch import length_mask, right_pad
from hpcrl.ragged import Ragged


def token_advantages(algo: AlgorithmConfig, rewards: np.ndarray, group_index: np.ndarray, old_logprobs: Ragged,
                     ref_logprobs: Ragged | None) -> Ragged:
    """Advantages on every response token (on `old_logprobs`' rows). GRPO and RLOO are
    sequence-level and repeated onto the tokens; REINFORCE++ puts the reward on the last token,
    the KL penalty on every token, and whitens."""
    reward_t = torch.as_tensor(rewards, dtype=torch.float32)
    groups_t = torch.as_tensor(group_index, dtype=torch.long)
    lengths = old_logprobs.lengths
    if algo.name in ("grpo", "rloo"):
        per_sequence = (grpo_advantages(reward_t, groups_t, normalize_std=algo.normalize_std) if algo.name == "grpo"
                        else rloo_advantages(reward_t, groups_t))
        return old_logprobs.with_values(np.repeat(per_sequence.numpy(), lengths))
    mask = length_mask(lengths)
    token_rewards = torch.zeros_like(mask)
    last = torch.as_tensor(lengths - 1).clamp(min=0)
    token_rewards[torch.arange(len(rewards)), last] = reward_t
    if ref_logprobs is not None and algo.kl_coef > 0:
        old, ref = right_pad(old_logprobs, 0.0, torch.float32), right_pad(ref_logprobs, 0.0, torch.float32)
        token_rewards -= algo.kl_coef * kl_penalty(old, ref, algo.kl_estimator) * mask
    return Ragged.from_padded(reinforce_pp_advantages(token_rewards, mask).numpy(), lengths)


def mean_kl(old_logprobs: Ragged, ref_logprobs: Ragged, estimator: str) -> float:
    """The token-mean KL of the policy that generated the batch from the reference (for the logs)."""
    values = kl_penalty(torch.from_numpy(old_logprobs.values), torch.from_numpy(ref_logprobs.values), estimator)
    return float(values.sum() / max(1, len(values)))
