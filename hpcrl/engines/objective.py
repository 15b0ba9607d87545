"""The policy objective of one micro-batch, as its share of the whole minibatch's loss: every engine's.

The terms are hpcrl.algos' (PPO-clip or GSPO, optional KL to the reference, optional entropy
bonus). A minibatch is split over DP ranks and micro-batches and the engines sum the shares'
gradients (Megatron: calculate_per_token_loss; torch/DeepSpeed: accumulation, with DP's average
undone), so each share is normalised by minibatch totals: token-mean by the global token count,
the sequence means by the global number of sequences. The sum of the shares' gradients is then
the gradient of the whole minibatch's loss, whatever the micro-batch size.
"""
from __future__ import annotations

import torch

from hpcrl.algos import aggregate_loss, gspo_loss, kl_penalty, ppo_clip_loss
from hpcrl.config.job import AlgorithmConfig


def policy_objective(logprobs: torch.Tensor, entropy: torch.Tensor | None, columns: dict[str, torch.Tensor],
                     mask: torch.Tensor, algo: AlgorithmConfig, global_tokens: float,
                     global_sequences: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss share, metrics) for [N, R] response-token tensors; `columns` as in Samples.columns.

    metrics: the loss function's, plus `loss` and `kl_loss` (shares: sum them over micro-batches),
    `entropy_sum` and `tokens` (for token-weighted means: see `combine_micro_metrics`)."""
    token_mean = algo.loss_agg == "token-mean"
    count = global_tokens if token_mean else None
    share = 1.0 if token_mean else mask.shape[0] / max(global_sequences, 1)

    def aggregate(values: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(values, mask, algo.loss_agg, count) * share

    loss_fn = gspo_loss if algo.policy_loss == "gspo" else ppo_clip_loss
    extra = {"dual_clip_c": algo.dual_clip_c} if algo.policy_loss == "ppo_clip" else {}
    policy, metrics = loss_fn(logprobs, columns["old_logprobs"], columns["advantages"], mask,
                              clip_low=algo.clip_low, clip_high=algo.clip_high, agg=algo.loss_agg,
                              global_token_count=count, importance_weights=columns.get("importance_weights"),
                              **extra)
    loss = policy * share
    if algo.kl_coef > 0 and "ref_logprobs" in columns:
        kl = aggregate(kl_penalty(logprobs, columns["ref_logprobs"], algo.kl_estimator))
        loss = loss + algo.kl_coef * kl
        metrics["kl_loss"] = float(kl.detach())
    if algo.entropy_coef > 0 and entropy is not None:
        loss = loss - algo.entropy_coef * aggregate(entropy)
    metrics = {key: float(value) for key, value in metrics.items()}
    metrics.update(loss=float(loss.detach()), tokens=float(mask.sum()))
    if entropy is not None:
        metrics["entropy_sum"] = float((entropy.detach() * mask).sum())
    return loss, metrics


def combine_micro_metrics(outputs: list[dict], dp: int) -> dict[str, float]:
    """One minibatch's metrics from its micro-batches' `policy_objective` metrics.

    `loss` and `kl_loss` are shares of the global loss: summed, and scaled by the DP size to
    estimate the global value from this replica. The others are token-weighted means over this
    replica's micro-batches.
    """
    tokens = sum(o["tokens"] for o in outputs)
    summed = {"loss", "kl_loss"}
    metrics = {k: sum(o[k] for o in outputs) * dp for k in summed if k in outputs[0]}
    for key in outputs[0].keys() - summed - {"tokens", "entropy_sum"}:   # every micro-batch has these
        metrics[key] = sum(o[key] * o["tokens"] for o in outputs) / max(tokens, 1.0)
    measured = [o for o in outputs if "entropy_sum" in o]   # the micro-batches whose entropy was computed
    if measured:
        metrics["entropy"] = sum(o["entropy_sum"] for o in measured) / max(sum(o["tokens"] for o in measured), 1.0)
    return metrics
