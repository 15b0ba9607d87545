"""The deepspeed training engine: ZeRO stage 1, 2 or 3 over the role's data-parallel ranks.

The minibatch loop and the losses are the torch engine's (this class only changes who holds the
weights and how a step is applied), so `engine: torch` and `engine: deepspeed` train the same
policy: ZeRO shards optimizer state (1), gradients (2) and parameters (3) over the DP ranks
instead of replicating them. DeepSpeed runs with the role's rank group as its world
(`deepspeed_world`); on CPU it communicates over gloo, on GPUs over NCCL.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.config.job import JobConfig
from hpcrl.engines.deepspeed_world import scope_deepspeed_world
from hpcrl.engines.torch_trainer import TorchTrainer, adamw

_NEVER = 2 ** 62   # DeepSpeed's steps_per_print: hpcrl prints its own metrics


def deepspeed_config(job: JobConfig, stage: int, trainable: bool) -> dict:
    """The DeepSpeed config for one role: one micro-batch per step (hpcrl cuts the minibatches)."""
    dtype = job.model.dtype
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    if trainable and job.train.grad_clip is not None:
        config["gradient_clipping"] = job.train.grad_clip
    return config


class _DataParallelOnly:
    """DeepSpeed's `mpu`: the role is data parallel only, over its whole group."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_model_parallel_group(self) -> None:
        return None

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


class DeepSpeedTrainer(TorchTrainer):
    def __init__(self, model: torch.nn.Module, job: JobConfig, pad_id: int, dp_group: dist.ProcessGroup,
                 trainable: bool = True, zero_stage: int = 2):
        """`dp_group` is always a group here, also of one rank: DeepSpeed's world (see deepspeed_world)."""
        device = next(model.parameters()).device
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        os.environ["LOCAL_RANK"] = str(device.index or 0)
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        scope_deepspeed_world(dp_group)
        self.job, self.pad_id, self.dp_group = job, pad_id, dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.device = device
        self.stage = zero_stage
        self.gathers_over_dp = zero_stage == 3   # ZeRO-3 gathers each parameter from its DP shards
        self.trainable = trainable
        if trainable:
            model.train()
            optimizer = adamw(model, job)
        else:
            model.requires_grad_(False)
            model.eval()
            optimizer = None
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=deepspeed_config(job, zero_stage, trainable),
            mpu=_DataParallelOnly(dp_group), dist_init_required=False)

    @property
    def module(self) -> torch.nn.Module:
        return self.model.module

    def _gathered(self, params: list[torch.nn.Parameter]):
        """Full parameters inside the block: a collective over the DP ranks under ZeRO-3, a no-op below."""
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One parameter at a time, gathered from its ZeRO-3 shards: never a second full model in memory."""
        for name, param in self.module.named_parameters():
            with self._gathered([param]):
                yield name, param.detach().clone()

    def _update(self, loss: torch.Tensor) -> float | None:
        self.model.backward(loss)
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None and self.job.train.grad_clip is not None else None

    def save_state(self, path: Path) -> None:
        """DeepSpeed's own checkpoint (each rank its ZeRO shard); it loads on the same DP size."""
        self.model.save_checkpoint(str(path), tag="state", save_latest=False)

    def load_state(self, path: Path) -> None:
        saved_dp = len(list(Path(path, "state").glob("*optim_states.pt")))
        if saved_dp and saved_dp != self.dp_size:
            raise RuntimeError(f"{path}: this DeepSpeed checkpoint holds ZeRO shards of {saved_dp} DP ranks, the role "
                               f"now has {self.dp_size}; resume with the same dp (or engine: torch, whose checkpoints "
                               "load on any DP size)")
        self.model.load_checkpoint(str(path), tag="state", load_module_strict=True,
                                   load_optimizer_states=self.trainable, load_lr_scheduler_states=False)

    def offload(self) -> None:
        """ZeRO-3 on GPUs moves parameters and optimizer state to host memory; a no-op on CPU."""
        if self.device.type == "cuda" and self.stage == 3:
            self.model.offload_states()

    def reload(self) -> None:
        if self.device.type == "cuda" and self.stage == 3:
            self.model.reload_states()
