"""Let megatron-core run on a CPU-only torch (tests, the local profile): a stand-in for the GPU, scoped.

megatron-core assumes CUDA: it asks `torch.cuda` for the current device and the RNG states it
forks (tensor-parallel regions), synchronises the device after pipeline sends, builds a few
tensors with `device="cuda"` (token counts in the pipeline schedules, the grad-norm buffers, the
default causal mask), calls `.cuda()` on the tied output layer, and the distributed optimizer
accepts only parameters whose `.type()` is "torch.cuda.*Tensor"; the MoE all-to-all dispatcher
copies its split sizes to the host on a side stream, and gathers tokens over TP ranks in splits of
unequal sizes, which gloo's all_gather does not take. Without CUDA these raise or refuse. Inside
`cuda_on_cpu()` "cuda" maps to the CPU, the CUDA RNG to the CPU generator, streams to one host
stream, CPU tensors report their CUDA type names, and unequal gathers and reduce-scatters are
padded to equal ones (see shared/notes/FINDINGS.md).

The patches are torch-global, so they hold only while a Megatron call runs: the Megatron engine
enters the context around each of its calls and everything else in the process (a Hugging Face
model on the same rank, a rollout engine) sees torch unchanged. With a GPU it does nothing.
"""
from __future__ import annotations

import contextlib
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


class _HostStream:
    """The one "stream" of a CPU: work is synchronous, so waiting on it or on its events returns at once.
    The MoE all-to-all dispatcher copies its split sizes to the host on a side stream and waits on an
    event; with one shared stream it sees no side stream (no `record_stream` calls)."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None) -> _HostStream:
        return self

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


_HOST_STREAM = _HostStream()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for tensors already on the host: the all-to-all split
    sizes it asks for as numpy arrays (torch's all_to_all_single takes no tensor for them)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_gather(even_gather):
    """megatron's all-gather along the first dimension, for splits of unequal sizes too (the MoE
    dispatcher's tokens per TP rank): gloo gathers equal shapes only, so each split is padded to
    the largest, gathered, and cut back."""
    @functools.wraps(even_gather)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, use_global_buffer)
        width = max(output_split_sizes)
        padded = input_.new_zeros((width, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        out = input_.new_empty((width * group.size(), *input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * width:i * width + n] for i, n in enumerate(output_split_sizes)])
    return gather


def _uneven_reduce_scatter(even_reduce_scatter):
    """megatron's reduce-scatter along the first dimension, for splits of unequal sizes too (the
    backward of `_uneven_gather`): the splits are padded to the largest, reduced and cut back."""
    @functools.wraps(even_reduce_scatter)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return even_reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        width = max(input_split_sizes)
        padded = input_.new_zeros((width * group.size(), *input_.shape[1:]))
        for i, part in enumerate(torch.split(input_, list(input_split_sizes), dim=0)):
            padded[i * width:i * width + part.shape[0]] = part
        out = input_.new_empty((width, *input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[:input_split_sizes[group.rank()]]
    return reduce_scatter


def _patches() -> list[tuple[object, str, object]]:
    import megatron.core.tensor_parallel.mappings as mappings
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),   # CPU work is synchronous
        (torch.cuda, "Stream", lambda *args, **kwargs: _HOST_STREAM),
        (torch.cuda, "current_stream", lambda *args, **kwargs: _HOST_STREAM),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        # Not torch.manual_seed: it calls cuda.manual_seed_all, which would recurse.
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (torch.cuda, "manual_seed_all", lambda seed: None),
        (torch.cuda, "get_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (mcore_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.get_rng_state()),
        (mcore_random, "_set_cuda_rng_state", lambda state, *args, **kwargs: torch.set_rng_state(state)),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        (mappings, "_gather_along_first_dim", _uneven_gather(mappings._gather_along_first_dim)),
        (mappings, "_reduce_scatter_along_first_dim", _uneven_reduce_scatter(mappings._reduce_scatter_along_first_dim)),
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
