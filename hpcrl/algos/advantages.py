"""Advantage estimators: sequence-level (GRPO, RLOO), turn-level (GiGPO) and token-level (REINFORCE++, GAE).

All run without autograd: advantages are constants to the policy loss. Token-level tensors are
[N, T] with a response mask; a masked position inside a response (e.g. an environment
observation in a multi-turn rollout) is skipped: it is not an action, its reward and value are
ignored, and returns and TD errors flow across it to the previous valid token. Rewards must
therefore sit on valid tokens (typically the last one of each response).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hpcrl.algos.groups import group_stats
from hpcrl.algos.masked import masked_whiten
from hpcrl.algos.registry import lookup


@torch.no_grad()
def grpo_advantages(
    rewards: Tensor, group_index: Tensor, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO: ``(r - group mean) / (group std + eps)`` per sample, [N] -> [N].

    The std is unbiased (``torch.std``'s default), as in verl. ``normalize_std=False`` keeps
    only the mean baseline (Dr. GRPO), which avoids up-weighting nearly-solved or
    nearly-hopeless prompts. A group of one has no baseline to compare with: advantage 0.
    """
    stats = group_stats(rewards, group_index)
    return stats.deviation / (stats.std + eps) if normalize_std else stats.deviation


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: ``r_i`` minus the mean reward of the *other* samples of its group, [N] -> [N].

    Leaving the sample out keeps the baseline independent of it, so the estimate is unbiased.
    ``r_i - (S - r_i)/(n - 1)`` equals ``n/(n - 1) * (r_i - mean)``; a group of one gets 0.
    """
    stats = group_stats(rewards, group_index)
    return stats.deviation * stats.count / (stats.count - 1).clamp(min=1)


def _reverse_discounted_sum(x: Tensor, response_mask: Tensor, factor: float) -> Tensor:
    """``y_t = x_t + factor * y_next`` over valid tokens, right to left; padding gets 0."""
    valid = response_mask.bool()
    out = torch.zeros_like(x)
    running = x.new_zeros(x.shape[0])
    for t in reversed(range(x.shape[1])):
        running = torch.where(valid[:, t], x[:, t] + factor * running, running)
        out[:, t] = running
    return torch.where(valid, out, torch.zeros_like(out))


def _next_valid_values(values: Tensor, response_mask: Tensor) -> Tensor:
    """For each token, the value of the next valid token of its row (0 after the last)."""
    valid = response_mask.bool()
    out = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        out[:, t] = running
        running = torch.where(valid[:, t], values[:, t], running)
    return out


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over the valid tokens of each row, [N, T]."""
    return _reverse_discounted_sum(token_rewards, response_mask, gamma)


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> Tensor:
    """REINFORCE++: discounted return-to-go, whitened over all valid tokens of the batch.

    Whitening across the batch (not per prompt group) is the global baseline that makes
    REINFORCE++ stable without a critic. Padding gets 0.
    """
    return masked_whiten(discounted_returns(token_rewards, response_mask, gamma), response_mask)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) -> (advantages, returns), [N, T].

    ``A_t = sum_k (gamma * lam)^k delta_{t+k}`` with ``delta_t = r_t + gamma V_{t+1} - V_t``
    and ``V`` after the last token = 0. The returns ``A + V`` are the critic's targets and stay
    unwhitened; the advantages are whitened over valid tokens for the policy loss.
    """
    deltas = token_rewards + gamma * _next_valid_values(values, response_mask) - values
    advantages = _reverse_discounted_sum(deltas, response_mask, gamma * lam)
    returns = torch.where(response_mask.bool(), advantages + values, torch.zeros_like(values))
    return masked_whiten(advantages, response_mask), returns


@torch.no_grad()
def gigpo_advantages(
    turn_rewards: Tensor, turn_mask: Tensor, turn_states: Tensor, group_index: Tensor, gamma: float = 0.95,
    step_weight: float = 1.0, normalize_std: bool = True,
) -> Tensor:
    """GiGPO (Feng et al. 2025): a trajectory-level plus a step-level relative advantage per turn, [N, K].

    The episode part is GRPO's over each trajectory's summed reward (``group_index``, trajectories
    from one initial state). The step part groups the turns of a group that acted from the same
    state (``turn_states``: equal ids mean the same state of the same group; the caller makes them
    so) and compares their discounted returns ``G_k = r_k + gamma G_{k+1}`` the GRPO way, so an
    action is credited against the other actions taken from that very state. A state visited
    once gets no step advantage. ``A = A_episode + step_weight * A_step`` on valid turns, 0 elsewhere.
    """
    valid = turn_mask.bool()
    episode = grpo_advantages((turn_rewards * turn_mask).sum(-1), group_index, normalize_std=normalize_std)
    returns = discounted_returns(turn_rewards, turn_mask, gamma)
    step = torch.zeros_like(turn_rewards)
    step[valid] = grpo_advantages(returns[valid], turn_states[valid], normalize_std=normalize_std)
    return torch.where(valid, episode[:, None] + step_weight * step, torch.zeros_like(step))


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "gae": gae_advantages,
    "gigpo": gigpo_advantages,
}


def advantage_estimator(name: str) -> Callable[..., Tensor | tuple[Tensor, Tensor]]:
    """The estimator called ``name``. Their inputs differ (GRPO/RLOO take sequence rewards and
    groups, REINFORCE++/GAE take token rewards), so this only resolves the config name."""
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")
