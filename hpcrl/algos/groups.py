"""Per-group reward statistics, shared by GRPO, RLOO and dynamic-sampling filters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupStats:
    """Statistics of each sample's group, broadcast back to the samples (all shaped [N])."""

    count: Tensor  # size of the sample's group
    deviation: Tensor  # value minus its group's mean
    std: Tensor  # unbiased standard deviation of the group; 0 for groups of one


def group_stats(values: Tensor, group_index: Tensor) -> GroupStats:
    """Group ``values`` [N] by ``group_index`` [N] (any integer ids, in any order).

    Values are shifted by their group's maximum before summing. Beyond the usual accuracy gain,
    this makes a group of equal values have deviations and std of exactly 0 whatever the
    values are, which the zero-variance filter and the singleton case rely on.
    """
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0

    def per_group_sum(x: Tensor) -> Tensor:
        return x.new_zeros(num_groups).index_add_(0, inverse, x)[inverse]

    shift = values.new_full((num_groups,), -torch.inf).scatter_reduce_(0, inverse, values, "amax")
    shifted = values - shift[inverse]
    count = per_group_sum(torch.ones_like(values))
    deviation = shifted - per_group_sum(shifted) / count
    std = (per_group_sum(deviation.square()) / (count - 1).clamp(min=1)).sqrt()
    return GroupStats(count=count, deviation=deviation, std=std)
