"""Move a set of tensors' storages to host memory and back, in place: how every engine offloads.

Parameters and gradients are often views into flat buffers (Megatron's and FSDP2's, ZeRO's
partitions), and optimizers hold their own copies: replacing `.data` would leave the buffers on
the device. Shrinking each distinct storage to zero bytes frees the memory while every view stays
valid, and growing it back restores them all at once (verl offloads Megatron the same way). On a
CPU the bytes go to a separate host copy just the same, so an engine that touched its state while
offloaded would fail, and a run with offloading can be compared bit for bit with one without.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

Saved = list[tuple[torch.UntypedStorage, torch.Tensor]]


def release(tensors: list[torch.Tensor], reuse: Saved = ()) -> Saved:
    """Copy each distinct storage to host memory, then shrink it to nothing, and hand the freed
    device blocks back to the driver (another process, vLLM's workers, needs them). `reuse`: the
    host copies of the previous release of the same tensors, filled again instead of pinning new
    memory every stage (pinned allocations are slow, and rounded up to a power of two)."""
    saved: Saved = []
    seen: set[int] = set()
    spare = [host for _, host in reuse]
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        if not storage.resizable():
            raise RuntimeError(f"cannot offload a {tuple(tensor.shape)} {tensor.dtype} tensor: its storage is not "
                               "resizable (`.numpy()` or `torch.from_numpy` made it so); use a copy there")
        host = spare.pop(0) if spare and spare[0].numel() == storage.nbytes() else torch.empty(
            storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
        host.untyped_storage().copy_(storage)
        saved.append((storage, host))
    for storage, _ in saved:
        storage.resize_(0)
    if any(storage.device.type == "cuda" for storage, _ in saved):
        torch.cuda.empty_cache()
    return saved


def restore(saved: Saved) -> None:
    """Grow every released storage back and copy its bytes in (`saved` keeps the host copies, for
    the next `release` to reuse)."""
    for storage, host in saved:
        storage.resize_(host.numel())
        storage.copy_(host.untyped_storage())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def model_state_tensors(parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None = None
                        ) -> list[torch.Tensor]:
    """What an engine offloads: its parameters (and a ZeRO-3 parameter's partition, `ds_tensor`),
    their gradients, and the optimizer's parameters (fp32 masters) and state (Adam's moments)."""
    tensors: list[torch.Tensor] = []
    for p in parameters:
        tensors += [_local(t) for t in (p, p.grad, getattr(p, "ds_tensor", None), getattr(p, "main_grad", None))
                    if isinstance(t, torch.Tensor)]
    if optimizer is not None:
        for group in optimizer.param_groups:
            tensors += [_local(p) for p in group["params"]]
        for state in optimizer.state.values():
            tensors += [_local(v) for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
    return tensors
