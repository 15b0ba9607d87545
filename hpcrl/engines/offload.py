"""Move a set of tensors' storages to host memory and back, in place.

Megatron's parameters and gradients are views into flat DDP buffers, and the optimizer's main
parameters may be views too: replacing `.data` would leave the buffers on the device. Shrinking
each distinct storage to zero bytes frees the device memory while every view stays valid, and
growing it back restores them all at once (verl offloads Megatron the same way).
"""
from __future__ import annotations

import torch

Saved = list[tuple[torch.UntypedStorage, torch.Tensor]]


def release(tensors: list[torch.Tensor]) -> Saved:
    """Copy each distinct storage to host memory, then shrink it to nothing."""
    saved: Saved = []
    seen: set[int] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        host.untyped_storage().copy_(storage)
        saved.append((storage, host))
    for storage, _ in saved:
        storage.resize_(0)
    return saved


def restore(saved: Saved) -> None:
    """Grow every released storage back and copy its bytes in."""
    for storage, host in saved:
        storage.resize_(host.numel())
        storage.copy_(host.untyped_storage())
