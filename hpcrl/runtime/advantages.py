"""From rewards to per-token advantages, as the job's `algorithm` asks (runs on the controller).

Token columns are packed (`hpcrl.ragged`): sequence-level advantages are repeated onto their
tokens, token-level ones computed on one padded [N, T] tensor; no Python loop over tokens.

The reward of a response sits on its last token (an env trajectory's: each turn's reward on the
last token of its action); `algorithm.kl_in_reward` subtracts its per-token
KL penalty from every token's reward. Sequence-level estimators (GRPO, RLOO) take the sum of a
response's token rewards as its reward, as verl does, so the KL in the reward means the same for
every estimator. The KL loss (`algorithm.kl_loss`) is the trainer's (engines/objective.py): each
algorithm's KL is counted once, where its preset puts it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpcrl.algos import (gae_advantages, gigpo_advantages, grpo_advantages, kl_penalty, reinforce_pp_advantages,
                         rloo_advantages)
from hpcrl.config.job import AlgorithmConfig
from hpcrl.engines.batch import length_mask, right_pad
from hpcrl.ragged import Ragged
from hpcrl.runtime.turns import Turns


@dataclass
class Advantages:
    columns: dict[str, Ragged]   # "advantages", and "returns" for the critic (gae)
    sequence_kl: float           # mean over responses of the summed KL to the reference (0 without one)


def token_advantages(algo: AlgorithmConfig, rewards: np.ndarray, group_index: np.ndarray, old_logprobs: Ragged,
                     ref_logprobs: Ragged | None, values: Ragged | None, kl_in_reward_coef: float,
                     loss_mask: Ragged | None = None, turn_rewards: Ragged | None = None,
                     prompt_ids: Ragged | None = None, response_ids: Ragged | None = None,
                     history_states: bool = False) -> Advantages:
    """Advantages on every response token (on `old_logprobs`' rows); with gae also the returns.
    With a `loss_mask` (an env's trajectories) only the policy's tokens count: the KL in the reward,
    the discounted returns and the reward's place (the last generated token) skip the observations;
    `turn_rewards` place each turn's reward on its action (the rest of `rewards`, e.g. a shaping
    term, on the last generated token). gigpo also needs the tokens, to find the states acted from
    (with `history_states`, a turn's whole history: an env whose observation is not its state)."""
    lengths = old_logprobs.lengths
    count = len(rewards)
    kl, kl_rows, sequence_kl = None, None, 0.0   # per trained token (flat), per response, their mean
    if ref_logprobs is not None:
        kl = kl_penalty(torch.from_numpy(old_logprobs.values), torch.from_numpy(ref_logprobs.values),
                        algo.kl_in_reward.estimator)
        if loss_mask is not None:
            kl = kl * torch.from_numpy(loss_mask.values)
        rows = torch.from_numpy(np.repeat(np.arange(count), lengths))
        kl_rows = torch.zeros(count, dtype=kl.dtype).index_add_(0, rows, kl)
        sequence_kl = float(kl_rows.mean()) if count else 0.0
    if algo.advantage in ("grpo", "rloo"):
        # a response's reward is the sum of its token rewards: no padded tensors (the critical path
        # between the reference's log-probs and the train call: 0.41 -> 0.26 ms for the tiny job)
        reward_t = torch.as_tensor(rewards, dtype=torch.float32)
        if kl_rows is not None and kl_in_reward_coef > 0:
            reward_t = reward_t - kl_in_reward_coef * kl_rows
        groups_t = torch.as_tensor(group_index, dtype=torch.long)
        per_sequence = (grpo_advantages(reward_t, groups_t, normalize_std=algo.normalize_std)
                        if algo.advantage == "grpo" else rloo_advantages(reward_t, groups_t))
        return Advantages({"advantages": old_logprobs.with_values(np.repeat(per_sequence.numpy(), lengths))},
                          sequence_kl)
    mask = length_mask(lengths)
    if loss_mask is not None:
        mask = mask * right_pad(loss_mask, 0.0, torch.float32, mask.shape[1])
    token_rewards = (torch.zeros_like(mask) if turn_rewards is None
                     else right_pad(turn_rewards, 0.0, torch.float32, mask.shape[1]) * mask)
    positions = torch.arange(mask.shape[1]).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values   # a row without a trained token: its end
    last = torch.where(last >= 0, last, torch.as_tensor(lengths - 1).clamp(min=0))
    token_rewards[torch.arange(count), last] += torch.as_tensor(rewards, dtype=torch.float32) - token_rewards.sum(-1)
    if kl is not None and kl_in_reward_coef > 0:
        token_rewards -= kl_in_reward_coef * right_pad(old_logprobs.with_values(kl.numpy()), 0.0, torch.float32,
                                                       mask.shape[1])
    if algo.advantage == "gigpo":
        if loss_mask is None or prompt_ids is None or response_ids is None:
            raise ValueError("advantage gigpo needs an env's trajectories (their turns and states)")
        turns = Turns.of(prompt_ids, response_ids, loss_mask, torch.as_tensor(group_index), history_states)
        per_turn = gigpo_advantages(turns.gather(token_rewards), turns.mask, turns.states,
                                    torch.as_tensor(group_index, dtype=torch.long), algo.gamma,
                                    algo.step_advantage_weight, algo.normalize_std)
        return Advantages({"advantages": Ragged.from_padded(turns.scatter(per_turn, mask).numpy(), lengths)},
                          sequence_kl)
    if algo.advantage == "reinforce_pp":
        advantages = reinforce_pp_advantages(token_rewards, mask, algo.gamma)
        return Advantages({"advantages": Ragged.from_padded(advantages.numpy(), lengths)}, sequence_kl)
    advantages, returns = gae_advantages(token_rewards, right_pad(values, 0.0, torch.float32), mask, algo.gamma,
                                         algo.lam)
    return Advantages({"advantages": Ragged.from_padded(advantages.numpy(), lengths),
                       "returns": Ragged.from_padded(returns.numpy(), lengths)}, sequence_kl)


def logged_kl_estimator(algo: AlgorithmConfig) -> str:
    """The estimator of the KL the job applies, for the `kl` metric: the reward's where only the
    reward holds one (PPO's, REINFORCE++'s k1), else the loss's."""
    in_reward = algo.kl_in_reward.coef > 0 or algo.kl_in_reward.target is not None
    return algo.kl_in_reward.estimator if in_reward and algo.kl_loss.coef == 0 else algo.kl_loss.estimator


def mean_kl(old_logprobs: Ragged, ref_logprobs: Ragged, estimator: str, loss_mask: Ragged | None = None) -> float:
    """The token-mean KL of the policy that generated the batch from the reference (for the logs),
    over the tokens the loss counts."""
    values = kl_penalty(torch.from_numpy(old_logprobs.values), torch.from_numpy(ref_logprobs.values), estimator)
    weights = torch.from_numpy(loss_mask.values) if loss_mask is not None else torch.ones_like(values)
    return float((values * weights).sum() / max(1.0, float(weights.sum())))
