"""RL algorithms as pure torch functions: advantages, KL estimators, losses, filters.

Shapes: N samples (responses), T response tokens; [N, T] tensors come with a response mask
(bool or 0/1) whose padded positions are ignored whatever they hold.
"""

from hpcrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    discounted_returns,
    gae_advantages,
    gigpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from hpcrl.algos.aggregation import AGGREGATION_MODES, aggregate_loss
from hpcrl.algos.filters import nonzero_variance_groups
from hpcrl.algos.groups import GroupStats, group_stats
from hpcrl.algos.kl import KL_ESTIMATORS, adaptive_kl_coef, kl_penalty
from hpcrl.algos.masked import masked_mean, masked_sum, masked_whiten
from hpcrl.algos.policy_loss import (POLICY_LOSSES, cispo_loss, gspo_loss, masked_importance_weights, policy_loss,
                                     ppo_clip_loss, sequence_importance_weights, truncated_importance_weights)
from hpcrl.algos.shaping import overlong_penalty
from hpcrl.algos.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "GroupStats",
    "adaptive_kl_coef",
    "advantage_estimator",
    "aggregate_loss",
    "cispo_loss",
    "clipped_value_loss",
    "discounted_returns",
    "gae_advantages",
    "gigpo_advantages",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "nonzero_variance_groups",
    "overlong_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "truncated_importance_weights",
    "masked_importance_weights",
    "sequence_importance_weights",
]
