"""Rows of a Hugging Face KV cache: drop finished sequences, add new ones, cut padding all rows share.

Continuous batching in the native sampler keeps one left-padded cache for the sequences decoding
together: a finished sequence leaves it (its rows are selected away), a waiting one joins after
its own prefill (both caches are left-padded to the longer one and stacked), and columns that
are padding for every row left are cut. The attention mask travels with the cache, a column per
cached position. transformers' DynamicCache keeps a (keys, values) pair of [rows, heads, positions,
head_dim] tensors per layer (`cache.layers`); these functions change those tensors in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def select_rows(cache, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Keep `rows` (indices) of the cache; returns their mask."""
    cache.batch_select_indices(rows)
    return mask[rows]


def pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [missing, 0]
    return F.pad(tensor, pad)


def cache_of(layers: list[torch.Tensor]):
    """A DynamicCache of the given per-layer tensors: keys, values, keys, values, ..."""
    from transformers import DynamicCache

    return DynamicCache(list(zip(layers[0::2], layers[1::2])))


def concat_rows(cache, mask: torch.Tensor, other, other_mask: torch.Tensor) -> torch.Tensor:
    """Append `other`'s rows to `cache` (each left-padded to the longer); returns the joint mask."""
    width = max(mask.shape[1], other_mask.shape[1])
    for layer, new in zip(cache.layers, other.layers):
        layer.keys = torch.cat([pad_left(layer.keys, width, 2), pad_left(new.keys, width, 2)])
        layer.values = torch.cat([pad_left(layer.values, width, 2), pad_left(new.values, width, 2)])
    return torch.cat([pad_left(mask, width, 1), pad_left(other_mask, width, 1)])


def trim_left(cache, mask: torch.Tensor) -> torch.Tensor:
    """Cut the leading columns that are padding in every row; returns the trimmed mask."""
    used = mask.any(0).nonzero()
    start = int(used[0]) if len(used) else mask.shape[1]
    if start == 0:
        return mask
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]
    return mask[:, start:]
