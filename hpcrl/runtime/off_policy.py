"""How stale samples are corrected (`rollout.is_correction`): the per-token columns that change."""
from __future__ import annotations

from hpcrl.algos import masked_importance_weights, sequence_importance_weights, truncated_importance_weights
from hpcrl.config.job import RolloutConfig
from hpcrl.engines.batch import length_mask, right_pad

IMPORTANCE_WEIGHTS = {"tis": truncated_importance_weights, "mis": masked_importance_weights,
                      "seq-tis": sequence_importance_weights}


def off_policy_columns(rollout: RolloutConfig, old_logprobs: list[list[float]],
                       behaviour_logprobs: list[list[float]]) -> dict[str, list[list[float]]]:
    """The train batch's columns that replace or join the on-policy ones for a batch with stale samples.

    `ppo`: the loss's ratio and clip are taken against the behaviour policy, so the ratio is the
    importance weight and the trust region bounds the whole move from the policy that sampled: a token
    the previous step already pushed up gets no further push, where `tis` weights it up to `is_cap`.
    `tis`, `mis`, `seq-tis` keep the ratio against the trainer's recomputed policy (decoupled PPO, as
    AReaL) and add an importance weight per token.
    """
    if rollout.is_correction == "ppo":
        return {"old_logprobs": behaviour_logprobs}
    lengths = [len(row) for row in old_logprobs]
    mask = length_mask(lengths)
    weights = IMPORTANCE_WEIGHTS[rollout.is_correction](
        right_pad(old_logprobs, 0.0, mask.dtype), right_pad(behaviour_logprobs, 0.0, mask.dtype), mask, rollout.is_cap)
    return {"importance_weights": [row[:n] for row, n in zip(weights.tolist(), lengths)]}
