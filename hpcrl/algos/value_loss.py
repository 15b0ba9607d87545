"""The critic's loss: PPO's clipped value regression towards the GAE returns."""

from __future__ import annotations

import torch
from torch import Tensor

from hpcrl.algos.aggregation import aggregate_loss
from hpcrl.algos.masked import masked_mean


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip: float,
    agg: str = "token-mean",
    global_token_count: float | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token, aggregated.

    As PPO's value loss (and verl's ``compute_value_loss``): the new value may not earn a lower
    loss by moving further than ``clip`` from the value the advantages were computed with, which
    keeps the critic's update as conservative as the policy's. "vf_clipfrac" counts the tokens
    where the clipped term decided.
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped_loss = (values - returns).square()
    clipped_loss = (clipped - returns).square()
    loss_mat = torch.maximum(unclipped_loss, clipped_loss)
    loss = 0.5 * aggregate_loss(loss_mat, response_mask, agg, global_token_count, norm_length)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).to(values.dtype), response_mask).item(),
            "value_mean": masked_mean(values, response_mask).item(),
            "value_error": masked_mean(unclipped_loss, response_mask).item(),
        }
    return loss, metrics
