"""Dynamic-sampling filters: which samples are worth a gradient step."""

from __future__ import annotations

from torch import Tensor

from hpcrl.algos.groups import group_stats


def nonzero_variance_groups(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Keep-mask [N] of samples whose group's rewards are not all equal (DAPO dynamic sampling).

    In a group where every response got the same reward, every group-relative advantage is 0:
    the samples only dilute the batch. A group of one is dropped for the same reason.
    """
    return group_stats(rewards, group_index).std > 0
