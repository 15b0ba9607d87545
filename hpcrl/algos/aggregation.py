"""Reduce a per-token loss matrix [N, T] to the scalar that is back-propagated.

The choice weights samples differently: "token-mean" weights every token equally (long
responses count more, DAPO's recommendation); "seq-mean-token-mean" weights every sequence
equally (the original GRPO/GSPO objective); "seq-mean-token-sum" sums tokens per sequence
(for a fixed maximum length); "seq-mean-token-sum-norm" divides that sum by a constant, the
maximum response length (Dr. GRPO's length-unbiased form, as its authors' oat computes it).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from hpcrl.algos.masked import masked_mean, masked_sum
from hpcrl.algos.registry import lookup


def _token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(loss_mat, mask)


def _seq_mean_token_sum(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(loss_mat, mask, dim=-1).mean()


def _seq_mean_token_mean(loss_mat: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(loss_mat, mask, dim=-1).mean()


AGGREGATION_MODES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum,   # divided by norm_length in aggregate_loss
}


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, mode: str, global_token_count: float | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """Aggregate ``loss_mat`` over the valid tokens of ``mask`` according to ``mode``.

    ``global_token_count`` (token-mean only) replaces the local token count as the
    denominator. Pass the number of valid tokens of the whole minibatch, over all data-parallel
    ranks and micro-batches: each piece then contributes ``local sum / global count``, and the
    *sum* of their gradients is the gradient of the true global token mean, however unevenly
    tokens are spread. (DDP averages gradients over ranks, so scale such a loss by the
    data-parallel size.) Dividing by the local count instead would over-weight tokens of
    short micro-batches. ``norm_length`` is the constant of "seq-mean-token-sum-norm".
    """
    aggregate = lookup(AGGREGATION_MODES, mode, "loss aggregation mode")
    if mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise ValueError("'seq-mean-token-sum-norm' needs norm_length (the maximum response length)")
        return aggregate(loss_mat, mask) / norm_length
    if global_token_count is None:
        return aggregate(loss_mat, mask)
    if mode != "token-mean":
        raise ValueError(f"global_token_count applies to 'token-mean' only, not {mode!r}")
    return masked_sum(loss_mat, mask) / max(float(global_token_count), 1.0)
