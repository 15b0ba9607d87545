"""The objectives of one micro-batch, as its share of the whole minibatch's loss: every engine's.

The policy's terms are hpcrl.algos' (PPO-clip, GSPO or CISPO, the KL loss to the reference, the
entropy bonus); the critic's is the clipped value loss. A minibatch is split over DP ranks and micro-batches and the engines sum the shares'
gradients (Megatron: calculate_per_token_loss; torch/DeepSpeed: accumulation, with DP's average
undone), so each share is normalised by minibatch totals: token-mean by the global token count,
the sequence means by the global number of sequences. The sum of the shares' gradients is then
the gradient of the whole minibatch's loss, whatever the micro-batch size.
"""
from __future__ import annotations

import torch

from hpcrl.algos import aggregate_loss, clipped_value_loss, kl_penalty, policy_loss
from hpcrl.config.job import JobConfig
from hpcrl.ragged import Ragged


class Shares:
    """How one micro-batch's loss becomes its share of the minibatch's: token-mean over the global
    token count; the sequence means over the local sequences, weighted by their part of the global
    ones (`seq-mean-token-sum-norm` by the longest response allowed: job.response_budget)."""

    def __init__(self, job: JobConfig, mask: torch.Tensor, global_tokens: float, global_sequences: int):
        self.mode = job.algorithm.loss_agg
        self.mask = mask
        token_mean = self.mode == "token-mean"
        self.count = global_tokens if token_mean else None
        self.weight = 1.0 if token_mean else mask.shape[0] / max(global_sequences, 1)
        self.norm_length = job.response_budget()

    @property
    def loss_kwargs(self) -> dict:
        """The aggregation arguments of hpcrl.algos' losses."""
        return {"agg": self.mode, "global_token_count": self.count, "norm_length": self.norm_length}

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        """The share of a per-token term [N, R]."""
        return aggregate_loss(values, self.mask, self.mode, self.count, self.norm_length) * self.weight


def trained_mask(mask: torch.Tensor, columns: dict[str, torch.Tensor]) -> torch.Tensor:
    """The response tokens the loss counts: all of a response's, or those its `loss_mask` keeps (an
    env's observation tokens are context the policy did not write)."""
    return mask * columns["loss_mask"] if "loss_mask" in columns else mask


def trained_tokens(responses: Ragged, columns: dict[str, Ragged]) -> float:
    """How many response tokens the loss counts (token-mean's denominator, before the DP sum)."""
    return float(columns["loss_mask"].values.sum()) if "loss_mask" in columns else float(responses.lengths.sum())


def policy_objective(logprobs: torch.Tensor, entropy: torch.Tensor | None, columns: dict[str, torch.Tensor],
                     mask: torch.Tensor, job: JobConfig, global_tokens: float,
                     global_sequences: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss share, metrics) for [N, R] response-token tensors; `columns` as in Samples.columns.

    The KL to the reference enters here only as `algorithm.kl_loss`; `kl_in_reward` is already in
    the advantages (hpcrl.runtime.advantages), so no algorithm counts it twice.
    metrics: the loss function's, plus `loss` and `kl_loss` (shares: sum them over micro-batches),
    `entropy_sum` and `tokens` (for token-weighted means: see `combine_micro_metrics`)."""
    algo = job.algorithm
    mask = trained_mask(mask, columns)
    share = Shares(job, mask, global_tokens, global_sequences)
    extra = {"dual_clip_c": algo.dual_clip_c} if algo.policy_loss == "ppo_clip" else {}
    policy, metrics = policy_loss(algo.policy_loss)(
        logprobs, columns["old_logprobs"], columns["advantages"], mask, clip_low=algo.clip_low,
        clip_high=algo.clip_high, importance_weights=columns.get("importance_weights"), **share.loss_kwargs, **extra)
    loss = policy * share.weight
    if algo.kl_loss.coef > 0 and "ref_logprobs" in columns:
        kl = share(kl_penalty(logprobs, columns["ref_logprobs"], algo.kl_loss.estimator))
        loss = loss + algo.kl_loss.coef * kl
        metrics["kl_loss"] = float(kl.detach())
    if algo.entropy_coef > 0 and entropy is not None:
        loss = loss - algo.entropy_coef * share(entropy)
    metrics = {key: float(value) for key, value in metrics.items()}
    metrics.update(loss=float(loss.detach()), tokens=float(mask.sum()))
    if entropy is not None:
        metrics["entropy_sum"] = float((entropy.detach() * mask).sum())
    return loss, metrics


def value_objective(values: torch.Tensor, columns: dict[str, torch.Tensor], mask: torch.Tensor, job: JobConfig,
                    global_tokens: float, global_sequences: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss share, metrics) of the critic's clipped value loss, aggregated as the policy's is; the
    metrics are named `value_loss` (a share, summed like `loss`), `vf_clipfrac`, `value_mean`..."""
    share = Shares(job, mask, global_tokens, global_sequences)
    loss, metrics = clipped_value_loss(values, columns["values"], columns["returns"], mask, job.algorithm.value_clip,
                                       **share.loss_kwargs)
    loss = loss * share.weight
    return loss, {**metrics, "value_loss": float(loss.detach()), "tokens": float(mask.sum())}


def combine_micro_metrics(outputs: list[dict], dp: int) -> dict[str, float]:
    """One minibatch's metrics from its micro-batches' `policy_objective` metrics.

    `loss`, `kl_loss` and `value_loss` are shares of the global loss: summed, and scaled by the DP
    size to estimate the global value from this replica. The others are token-weighted means over
    this replica's micro-batches.
    """
    tokens = sum(o["tokens"] for o in outputs)
    summed = {"loss", "kl_loss", "value_loss"}
    metrics = {k: sum(o[k] for o in outputs) * dp for k in summed if k in outputs[0]}
    for key in outputs[0].keys() - summed - {"tokens", "entropy_sum"}:   # every micro-batch has these
        metrics[key] = sum(o[key] * o["tokens"] for o in outputs) / max(tokens, 1.0)
    measured = [o for o in outputs if "entropy_sum" in o]   # the micro-batches whose entropy was computed
    if measured:
        metrics["entropy"] = sum(o["entropy_sum"] for o in measured) / max(sum(o["tokens"] for o in measured), 1.0)
    return metrics
