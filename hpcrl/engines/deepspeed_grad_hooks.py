"""ZeRO-3 start-up without gathering every parameter: a scoped patch of DeepSpeed 0.19.8.

`DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks` gathers each trainable
parameter whole (`param.all_gather()`), registers its gradient hook and partitions it again. The
gather served torch < 2.1, where a hook sat on the gradient accumulator that only a materialised
parameter exposes; from torch 2.1 DeepSpeed registers the hook with
`register_post_accumulate_grad_hook`, which needs no data. The gather is then a full all-gather of
the model, one parameter at a time, at every start: on a rank that keeps a shard it holds the
largest parameter whole, twice (gloo's output and the parameter), 0.25 GB above the shard for the
embedding of a 300M Qwen2 (bench/memory.py), 5 GB for a 72B one. Inside `hooks_without_gather()`
the hooks are made on the partitioned parameters; outside it DeepSpeed is unchanged.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

WRITTEN_FOR = "0.19.8"   # setup.cfg pins it; tests/test_sharded_engines.py checks the gradients it gives


def _nothing(*args, **kwargs) -> None:
    """Stands in for a parameter's all_gather/partition while its hook is made."""


@contextmanager
def hooks_without_gather() -> Iterator[None]:
    """Within the block, ZeRO-3's gradient hooks are registered without gathering the parameters
    (where DeepSpeed registers them with post-accumulate hooks; otherwise nothing changes)."""
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    from deepspeed.utils.torch import required_torch_version

    if deepspeed.__version__ != WRITTEN_FOR or not required_torch_version(min_version=2.1):
        yield
        return
    original = Stage3.create_reduce_and_remove_grad_hooks

    def create_hooks(self) -> None:
        params = [param for group in self.fp16_groups for param in group]
        kept = [(param.all_gather, param.partition) for param in params]
        for param in params:
            param.all_gather = param.partition = _nothing
        try:
            original(self)
        finally:
            for param, (all_gather, partition) in zip(params, kept):
                param.all_gather, param.partition = all_gather, partition

    Stage3.create_reduce_and_remove_grad_hooks = create_hooks
    try:
        yield
    finally:
        Stage3.create_reduce_and_remove_grad_hooks = original
