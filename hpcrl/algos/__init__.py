"""RL algorithms as pure torch functions: advantages, KL estimators, losses, filters.

Shapes: N samples (responses), T response tokens; [N, T] tensors come with a response mask
(bool or 0/1) whose padded positions are ignored whatever they hold.
"""

from hpcrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage_estimator,
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from hpcrl.algos.aggregation import AGGREGATION_MODES, aggregate_loss
from hpcrl.algos.filters import nonzero_variance_groups
from hpcrl.algos.groups import GroupStats, group_stats
from hpcrl.algos.kl import KL_ESTIMATORS, kl_penalty
from hpcrl.algos.masked import masked_mean, masked_sum, masked_whiten
from hpcrl.algos.policy_loss import (gspo_loss, masked_importance_weights, ppo_clip_loss,
                                     sequence_importance_weights, truncated_importance_weights)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "KL_ESTIMATORS",
    "GroupStats",
    "advantage_estimator",
    "aggregate_loss",
    "discounted_returns",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "nonzero_variance_groups",
    "ppo_clip_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "truncated_importance_weights",
    "masked_importance_weights",
    "sequence_importance_weights",
]
