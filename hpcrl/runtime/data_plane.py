"""A replica's share of a batch, from its data leader to its other ranks (Megatron's `broadcast_data`).

The controller sends each replica's shard to one rank only; the replica's TP/PP ranks get it from
there in two collectives over the replica's gloo group: a small description of the columns, then
every numeric column's bytes in one flat buffer. Gloo (host memory) whatever the device: batches are
token ids and per-token floats, megabytes, and stay off the training stream.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.ragged import Batch, Ragged

_ALIGN = 8


def _arrays(batch: Batch) -> tuple[list, list[np.ndarray]]:
    """The columns' description and their numeric arrays, in the order the buffer holds them."""
    meta, arrays = [], []
    for name, column in batch.items():
        if isinstance(column, Ragged):
            meta.append((name, "ragged", None))
            arrays += [column.values, column.offsets]
        elif isinstance(column, np.ndarray):
            meta.append((name, "array", None))
            arrays.append(column)
        else:
            meta.append((name, "object", list(column)))
    return meta, arrays


def _layout(arrays: list[tuple[str, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Byte offsets of each array in the flat buffer (8-byte aligned) and the total size."""
    starts, size = [], 0
    for dtype, shape in arrays:
        starts.append(size)
        size += -(-np.dtype(dtype).itemsize * int(np.prod(shape)) // _ALIGN) * _ALIGN
    return starts, size


def broadcast_batch(batch: Batch | None, src: int, group: dist.ProcessGroup) -> Batch:
    """`batch` on `src` (a world rank of `group`), None elsewhere; every rank returns the batch."""
    sending = dist.get_rank() == src
    if sending:
        meta, arrays = _arrays(batch)
        shapes = [(a.dtype.str, a.shape) for a in arrays]
        holder = [(meta, shapes)]
    else:
        holder = [None]
    dist.broadcast_object_list(holder, src=src, group=group)
    meta, shapes = holder[0]
    starts, size = _layout(shapes)
    flat = np.empty(size, dtype=np.uint8)
    if sending:
        for start, array in zip(starts, arrays):
            flat[start:start + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
    dist.broadcast(torch.from_numpy(flat), src=src, group=group)
    received = iter(np.frombuffer(flat, dtype=np.dtype(dtype), count=int(np.prod(shape)), offset=start).reshape(shape)
                    for start, (dtype, shape) in zip(starts, shapes))
    out: Batch = {}
    for name, kind, objects in meta:
        if kind == "ragged":
            out[name] = Ragged(next(received), next(received))
        elif kind == "array":
            out[name] = next(received)
        else:
            out[name] = objects
    return out
