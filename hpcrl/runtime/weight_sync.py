"""Trainer -> rollout weight sync: HF-named tensors in flat buckets over a torch.distributed group.

The source (the first rank of the trainer's first DP replica) takes the weights from the engine's
iterator bucket by bucket; each bucket is two broadcasts, its (name, shape, dtype) list, then one
flat tensor (NCCL on GPUs, gloo here); an empty list ends the sync. Few large messages instead of
one per tensor, no files, and no rank ever holds a second full copy of the model: the source
gathers (Megatron TP/PP, ZeRO-3) one bucket ahead and receivers load bucket by bucket.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hpcrl.engines.base import NamedTensors
from hpcrl.engines.resharding import DEFAULT_BUCKET_BYTES, named_buckets


@torch.no_grad()
def broadcast_named(weights: Iterable[tuple[str, torch.Tensor]] | None, src: int, group: dist.ProcessGroup,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[NamedTensors]:
    """Yield the weights bucket by bucket: sent from `weights` on `src`, received elsewhere."""
    sending = dist.get_rank() == src
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    buckets = named_buckets(weights, bucket_bytes) if sending else None
    while True:
        bucket = next(buckets, []) if sending else []
        holder = [[(n, tuple(t.shape), t.dtype) for n, t in bucket]]
        dist.broadcast_object_list(holder, src=src, group=group)
        meta = holder[0]
        if not meta:
            return
        if sending:
            flat = _flatten_dense_tensors([t.to(device).contiguous() for _, t in bucket])
        else:
            flat = torch.empty(sum(torch.Size(s).numel() for _, s, _ in meta), dtype=meta[0][2], device=device)
        dist.broadcast(flat, src=src, group=group)
        templates = [torch.empty(shape, dtype=dtype, device=device) for _, shape, dtype in meta]
        yield [(name, value) for (name, _, _), value in zip(meta, _unflatten_dense_tensors(flat, templates))]


@torch.no_grad()
def tensor_digests(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str]]:
    """(name, SHA-256 of the bytes) of every tensor: collect them bucket by bucket, then combine."""
    return [(name, hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            for name, t in named]


def combine_digests(per_tensor: list[tuple[str, str]]) -> str | None:
    """One digest over (name, digest) pairs in name order (None for no tensors): equal digests mean
    bit-identical weights, whatever order or sharding the engine holding them iterates in."""
    if not per_tensor:
        return None
    return hashlib.sha256("".join(f"{n}={d};" for n, d in sorted(per_tensor)).encode()).hexdigest()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    return combine_digests(tensor_digests(named))
