"""Reductions over the valid (unmasked) tokens of a padded batch.

Masks are bool or 0/1 tensors. Padded positions may hold anything (even inf or NaN logprobs),
so they are selected away with ``torch.where`` rather than multiplied by zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (over all of them when ``dim`` is None)."""
    selected = torch.where(mask.bool(), x, torch.zeros_like(x))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Number of valid positions, at least 1, so that empty rows give a mean of 0 instead of NaN."""
    m = mask.bool().to(dtype)
    return (m.sum() if dim is None else m.sum(dim)).clamp(min=1)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over valid positions; 0 where there are none."""
    return masked_sum(x, mask, dim) / masked_count(mask, dim, x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale ``x`` to mean 0, variance 1 over valid positions; padding becomes 0.

    The variance is unbiased (Bessel-corrected), as in verl's ``masked_whiten``.
    """
    valid = mask.bool()
    mean = masked_mean(x, valid)
    centered = torch.where(valid, x - mean, torch.zeros_like(x))
    var = centered.square().sum() / (masked_count(valid, dtype=x.dtype) - 1).clamp(min=1)
    return centered * torch.rsqrt(var + eps)
