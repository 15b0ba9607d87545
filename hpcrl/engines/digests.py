"""Digests of named tensors: equal digests mean bit-identical weights, however they were sharded.

Used to check that every trainer replica and every rollout rank hold the same weights after a
sync (the rollout engine may compute them where its weights live, e.g. inside vLLM's workers).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


@torch.no_grad()
def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """(name, SHA-256 of the bytes) of every tensor: collect them bucket by bucket, then combine."""
    # of a copy: `.numpy()` of a tensor makes its storage fixed-size for good, and an engine's
    # weights must stay resizable to be offloaded (engines/offload.py)
    return [(name, hashlib.sha256(t.detach().to("cpu", copy=True).contiguous().view(torch.uint8).numpy()).hexdigest())
            for name, t in named]


def combine_digests(per_tensor: list[tuple[str, str]]) -> str | None:
    """One digest over (name, digest) pairs in name order (None for no tensors): equal digests mean
    bit-identical weights, whatever order or sharding the engine holding them iterates in."""
    if not per_tensor:
        return None
    return hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(per_tensor)).encode()).hexdigest()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    return combine_digests(tensor_digests(named))
