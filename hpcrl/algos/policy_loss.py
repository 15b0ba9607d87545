"""Policy-gradient losses on token-level advantages [N, T], and off-policy correction weights.

Each loss returns ``(loss, metrics)``: the aggregated scalar to back-propagate and a few
floats (over this batch's valid tokens) that show how far the policy moved from ``old``.
Logprobs may hold anything on padding; advantages and importance weights must be finite there
(the estimators here put 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from hpcrl.algos.aggregation import aggregate_loss
from hpcrl.algos.kl import LOG_RATIO_LIMIT
from hpcrl.algos.masked import masked_mean
from hpcrl.algos.registry import lookup


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """``log pi - log pi_old``, clamped so that ``exp`` cannot overflow on outliers.

    The clamp also passes no gradient where the difference is NaN (e.g. -inf - -inf on
    padding), so padding values never turn into NaN gradients.
    """
    return (logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate ``max(-A r, -A clip(r, 1-low, 1+high))`` and where it clipped.

    Where the clipped term wins, the loss is constant in the policy: no gradient pushes the
    ratio further out of the trust region.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _finish(
    loss_mat: Tensor,
    log_ratio: Tensor,
    ratio: Tensor,
    was_clipped: Tensor,
    response_mask: Tensor,
    agg: str,
    global_token_count: float | None,
    importance_weights: Tensor | None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Weight, aggregate, and report the metrics common to all clipped losses."""
    if importance_weights is not None:
        loss_mat = loss_mat * importance_weights
    loss = aggregate_loss(loss_mat, response_mask, agg, global_token_count, norm_length)
    with torch.no_grad():
        metrics = {
            "clipfrac": masked_mean(was_clipped.to(ratio.dtype), response_mask).item(),
            "approx_kl": masked_mean(-log_ratio, response_mask).item(),
            "ratio_mean": masked_mean(ratio, response_mask).item(),
        }
    return loss, metrics


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg: str = "token-mean",
    global_token_count: float | None = None,
    importance_weights: Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate on per-token ratios ``pi / pi_old`` (Schulman et al. 2017).

    Separate ``clip_low``/``clip_high`` allow DAPO's clip-higher. ``dual_clip_c`` (> 1) bounds
    the loss of negative-advantage tokens at ``-c * A`` (Ye et al. 2020): without it, a token
    whose ratio has exploded contributes an unbounded loss, since PPO never clips a ratio
    above ``1 + high`` when ``A < 0``. ``importance_weights`` [N, T] (no grad) multiply the
    per-token loss, e.g. truncated importance weights correcting stale rollout samples.
    "clipfrac" counts the tokens cut off by either clip (their gradient is zero).
    """
    if dual_clip_c is not None and dual_clip_c <= 1:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    loss_mat, was_clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    if dual_clip_c is not None:
        dual = torch.minimum(loss_mat, -advantages * dual_clip_c)
        was_clipped = was_clipped | ((advantages < 0) & (dual < loss_mat))
        loss_mat = torch.where(advantages < 0, dual, loss_mat)
    return _finish(
        loss_mat, log_ratio, ratio, was_clipped, response_mask, agg, global_token_count,
        importance_weights, norm_length,
    )


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    global_token_count: float | None = None,
    importance_weights: Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025): clip one sequence-level ratio instead of per-token ratios.

    ``s_i = exp(mean over valid tokens of log(pi / pi_old))`` is the length-normalised
    sequence likelihood ratio; token-level noise averages out, which is why its clip range is
    tiny (defaults: the paper's 3e-4 / 4e-4). It is applied per token as GSPO-token:
    ``s_i,t = sg[s_i] * pi_t / sg[pi_t]`` has the value ``s_i`` but each token's gradient is
    ``s_i * grad log pi_t``, so token-level advantages weight their own tokens. The default
    aggregation is the paper's (mean over tokens per sequence, then over sequences).
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).unsqueeze(-1)
    token_log_ratio = seq_log_ratio.detach() + log_ratio - log_ratio.detach()
    ratio = torch.exp(token_log_ratio)
    loss_mat, was_clipped = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    return _finish(
        loss_mat, log_ratio, ratio, was_clipped, response_mask, agg, global_token_count,
        importance_weights, norm_length,
    )


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    agg: str = "token-mean",
    global_token_count: float | None = None,
    importance_weights: Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by the clipped ratio, held constant.

    ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi`` per token. PPO's clip zeroes the gradient of
    a token whose ratio left the trust region, and the rare tokens that start a reflection
    ("wait", "however") leave it first; CISPO keeps every token's gradient and bounds only its
    weight. Defaults: no lower bound (low = 1, as the paper) and DAPO's upper 0.28. "clipfrac"
    counts the tokens whose weight was cut.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_ratio)
    valid = response_mask.bool()   # padding's log-probs may be -inf: its weight and log-prob are set to 0
    weight = torch.where(valid, ratio.detach().clamp(1 - clip_low, 1 + clip_high), torch.zeros_like(ratio))
    was_clipped = (ratio.detach() > 1 + clip_high) | (ratio.detach() < 1 - clip_low)
    loss_mat = -advantages * weight * torch.where(valid, logprobs, torch.zeros_like(logprobs))
    return _finish(
        loss_mat, log_ratio, ratio, was_clipped, response_mask, agg, global_token_count,
        importance_weights, norm_length,
    )


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


def policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The policy loss called ``name`` (the keys of POLICY_LOSSES: `algorithm.policy_loss`)."""
    return lookup(POLICY_LOSSES, name, "policy loss")


@torch.no_grad()
def truncated_importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor, cap: float
) -> Tensor:
    """Truncated importance sampling (TIS) weights ``min(pi_old / pi_behaviour, cap)``, [N, T].

    Rollouts come from a behaviour policy (the inference engine, possibly some steps stale)
    that differs from ``pi_old`` (the trainer's recomputation). Reweighting corrects that
    mismatch; truncating at ``cap`` bounds the variance. Padding gets 0.
    """
    weights = torch.exp(_log_ratio(old_logprobs, behaviour_logprobs))
    return torch.where(response_mask.bool(), weights.clamp(max=cap), torch.zeros_like(weights))


@torch.no_grad()
def masked_importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor, cap: float
) -> Tensor:
    """Masked importance sampling (MIS) weights, [N, T]: ``pi_old / pi_behaviour`` where that ratio
    lies in ``[1/cap, cap]``, 0 elsewhere (IcePop; AReaL drops tokens over its cap the same way).

    Where the policy has moved far from the one that sampled a token, TIS still trains on the
    token with a capped, biased weight; MIS leaves it out, so a stale batch only pushes on the
    tokens the current policy would still plausibly produce. Padding gets 0.
    """
    weights = torch.exp(_log_ratio(old_logprobs, behaviour_logprobs))
    keep = response_mask.bool() & (weights <= cap) & (weights >= 1.0 / cap)
    return torch.where(keep, weights, torch.zeros_like(weights))


@torch.no_grad()
def sequence_importance_weights(
    old_logprobs: Tensor, behaviour_logprobs: Tensor, response_mask: Tensor, cap: float
) -> Tensor:
    """Sequence-level truncated weights ``min(prod_t pi_old / pi_behaviour, cap)`` on every token
    of the response, [N, T]. The reward belongs to the whole sequence, so the sequence's ratio is
    the exact correction of its advantage; per-token weights approximate it. Padding gets 0."""
    log_ratio = torch.where(response_mask.bool(), _log_ratio(old_logprobs, behaviour_logprobs),
                            torch.zeros_like(old_logprobs))
    weights = torch.exp(log_ratio.sum(-1, keepdim=True).clamp(max=math.log(cap))).expand_as(old_logprobs)
    return torch.where(response_mask.bool(), weights, torch.zeros_like(weights))

