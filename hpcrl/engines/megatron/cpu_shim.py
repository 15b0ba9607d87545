"""Let megatron-core run on a CPU-only torch (tests, the local profile): a stand-in for the GPU, scoped.

megatron-core assumes CUDA: it asks `torch.cuda` for the current device and the RNG states it
forks (tensor-parallel regions), synchronises the device after pipeline sends, builds a few
tensors with `device="cuda"` (token counts in the pipeline schedules, the grad-norm buffers, the
default causal mask), calls `.cuda()` on the tied output layer, and the distributed optimizer
accepts only parameters whose `.type()` is "torch.cuda.*Tensor". Without CUDA these raise or
refuse. Inside `cuda_on_cpu()` "cuda" maps to the CPU, the CUDA RNG to the CPU generator, and CPU
tensors report their CUDA type names (see shared/notes/FINDINGS.md).

The patches are torch-global, so they hold only while a Megatron call runs: the Megatron engine
enters the context around each of its calls and everything else in the process (a Hugging Face
model on the same rank, a rollout engine) sees torch unchanged. With a GPU it does nothing.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor")
_lock = threading.Lock()
_depth = 0
_originals: list[tuple[object, str, object]] = []


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return wrapper


def _cuda_type_name(real_type):
    @functools.wraps(real_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            return real_type(self).replace("torch.", "torch.cuda.", 1)
        return real_type(self, dtype, non_blocking, **kwargs)
    return type_


def _patches() -> list[tuple[object, str, object]]:
    import megatron.core.tensor_parallel.random as mcore_random

    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),   # CPU work is synchronous
        # Not torch.manual_seed: it calls cuda.manual_seed_all, which would recurse.
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (torch.cuda, "manual_seed_all", lambda seed: None),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (mcore_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (mcore_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        (torch.Tensor, "type", _cuda_type_name(torch.Tensor.type)),
    ]
    return patches + [(torch, name, _on_cpu(getattr(torch, name))) for name in _FACTORIES]


@contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Megatron's CUDA calls served by the CPU while the block runs (re-entrant); a no-op with a GPU."""
    global _depth
    if torch.cuda.is_available():
        yield
        return
    with _lock:
        if _depth == 0:
            for owner, name, replacement in _patches():
                _originals.append((owner, name, getattr(owner, name)))
                setattr(owner, name, replacement)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _originals:
                    owner, name, original = _originals.pop()
                    setattr(owner, name, original)


def on_cpu_shim(method):
    """Run a Megatron engine method inside `cuda_on_cpu()`."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with cuda_on_cpu():
            return method(*args, **kwargs)
    return wrapped
