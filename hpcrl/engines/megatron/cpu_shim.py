"""Let megatron-core run on a CPU-only torch (tests, the local profile): a stand-in for the GPU.

megatron-core assumes CUDA: it asks `torch.cuda` for the current device and the RNG states it
forks (tensor-parallel regions), synchronises the device after pipeline sends, builds a few
tensors with `device="cuda"` (token counts in the pipeline schedules, the grad-norm buffers, the
default causal mask), calls `.cuda()` on the tied output layer, and the distributed optimizer
accepts only parameters whose `.type()` is "torch.cuda.*Tensor". Without CUDA these raise or
refuse. Applied only when no GPU exists, before megatron-core builds anything, this maps "cuda"
to the CPU, the CUDA RNG to the CPU generator, and reports CPU tensors as their CUDA types (see
shared/notes/FINDINGS.md). On a CPU-only torch the CUDA calls fail anyway; only the type name
that `.type()` reports changes.
"""
from __future__ import annotations

import functools

import torch

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor")
_applied = False


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


def apply_if_no_cuda() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    import megatron.core.tensor_parallel.random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None  # CPU work is synchronous
    # Not torch.manual_seed: it calls cuda.manual_seed_all, which would recurse.
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _cuda_type_name(torch.Tensor.type)
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    _applied = True
