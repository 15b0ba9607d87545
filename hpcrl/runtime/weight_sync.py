"""Trainer -> rollout weight sync: bucketed broadcasts over a torch.distributed group.

The source (the first rank of the trainer's first DP replica) and every rollout rank walk the
parameters in the same order and cut them into the same buckets, so each bucket is one flat
broadcast (NCCL on GPUs, gloo here): few large messages instead of one per tensor, and no files.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

DEFAULT_BUCKET_BYTES = 64 << 20


def buckets(params: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive groups of same-dtype tensors of at most `bucket_bytes` (a larger tensor is alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not out or size + nbytes > bucket_bytes or out[-1][0].dtype != p.dtype:
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


@torch.no_grad()
def broadcast_parameters(module: torch.nn.Module, src: int, group: dist.ProcessGroup,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Send (on `src`) or receive (elsewhere) every parameter; returns the bytes moved."""
    moved = 0
    for bucket in buckets([p.data for p in module.parameters()], bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            for param, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                param.copy_(value)
        moved += flat.numel() * flat.element_size()
    return moved


@torch.no_grad()
def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for param in module.parameters():
        digest.update(param.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def copy_parameters(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """The colocated case: trainer and rollout share the rank, so the sync is a local copy."""
    for dst, src in zip(target.parameters(), source.parameters()):
        dst.copy_(src)
