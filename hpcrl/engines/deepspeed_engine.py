"""The deepspeed training engine: ZeRO stage 1, 2 or 3 over the role's data-parallel ranks.

The minibatch loop, the micro-batches and the losses are the torch engine's (this class only
changes who holds the weights and how a step is applied), so `engine: torch` and `engine:
deepspeed` train the same policy: ZeRO shards optimizer state (1), gradients (2) and parameters
(3) over the DP ranks instead of replicating them. Under ZeRO-3 the model is built inside
`deepspeed.zero.Init` (each parameter partitioned as it is created) and each rank fills its own
partitions from the files; no parameter is gathered whole at start-up (deepspeed_grad_hooks). hpcrl owns the accumulation boundary
(`managed_gradient_accumulation: false`): one `step()` per minibatch, whatever the number of
micro-batches. DeepSpeed runs with the role's rank group as its world (`deepspeed_world`); on
CPU it communicates over gloo (hpcrl's own counts over MPI: hpcrl.engines.dp_reduce), on GPUs over NCCL.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.config.job import JobConfig
from hpcrl.engines.deepspeed_grad_hooks import hooks_without_gather
from hpcrl.engines.deepspeed_world import scope_deepspeed_world
from hpcrl.engines.dp_reduce import DataParallelReducer
from hpcrl.engines.hf_model import DTYPES
from hpcrl.engines.model_files import ModelFiles, load_full, model_from_config
from hpcrl.engines.torch_trainer import TorchTrainer, adamw

_NEVER = 2 ** 62   # DeepSpeed's steps_per_print: hpcrl prints its own metrics


def zero_buckets(hidden_size: int, layer_numel: int, stage: int, dp_size: int) -> dict:
    """ZeRO's communication buckets sized by the model, as transformers' "auto" values are
    (reduce bucket hidden^2, prefetch 0.9 hidden^2, small parameters kept whole below 10 hidden),
    and under ZeRO-3 at most two decoder layers' parameters gathered at once and the optimizer
    stepped over sub-groups of two layers. DeepSpeed's defaults (500M-element buckets, 1e9 live
    parameters, 1e9-element sub-groups) would hold 2 GB of fp32 buckets per rank, keep a model
    below a billion parameters gathered whole, and at start-up zero a gradient buffer as large as
    the whole fp32 model (its size is a sub-group's full, not partitioned, numel) and run Adam's
    temporaries over the whole partition."""
    buckets = {"reduce_bucket_size": hidden_size * hidden_size, "allgather_bucket_size": hidden_size * hidden_size}
    if stage == 3:
        buckets.update(stage3_prefetch_bucket_size=int(0.9 * hidden_size * hidden_size),
                       stage3_param_persistence_threshold=10 * hidden_size,
                       stage3_max_live_parameters=2 * layer_numel, stage3_max_reuse_distance=2 * layer_numel,
                       sub_group_size=max(1, 2 * layer_numel // dp_size))   # counted in partitioned elements
    return buckets


def deepspeed_config(job: JobConfig, stage: int, trainable: bool, buckets: dict | None = None) -> dict:
    """The DeepSpeed config for one role: hpcrl cuts minibatches and micro-batches and calls step()
    at each minibatch's end (the sizes here only satisfy DeepSpeed's batch arithmetic)."""
    dtype = job.model.dtype
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "zero_optimization": {"stage": stage, **(buckets or {})},
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    if trainable and job.train.grad_clip is not None:
        config["gradient_clipping"] = job.train.grad_clip
    if trainable and stage >= 2 and dtype == "bfloat16":
        # DeepSpeed's defaults sum the micro-batches' gradients and reduce them over DP in bf16; the
        # torch engines (FSDP2's reduce_dtype) and Megatron do both in fp32
        config["data_types"] = {"grad_accum_dtype": "fp32"}
        config["communication_data_type"] = "fp32"
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
    def __init__(self, files: ModelFiles, job: JobConfig, pad_id: int, dp_group: dist.ProcessGroup,
                 device: str | torch.device = "cpu", trainable: bool = True, zero_stage: int = 2,
                 value_head: bool = False):
        """`dp_group` is always a group here, also of one rank: DeepSpeed's world (see deepspeed_world).
        `value_head`: the critic, as in TorchTrainer."""
        device = torch.device(device)
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        os.environ["LOCAL_RANK"] = str(device.index or 0)
        import deepspeed
        from deepspeed.utils import logger

        logger.setLevel(logging.WARNING)
        scope_deepspeed_world(dp_group)
        self.job, self.pad_id, self.dp_group = job, pad_id, dp_group
        self.dp_size = dist.get_world_size(dp_group)
        self.device = device
        self.dp_reducer = DataParallelReducer(dp_group, device)
        self.compute_dtype = DTYPES[job.model.dtype]
        self._autocast = False   # DeepSpeed casts the module to the job's dtype and keeps fp32 master weights
        # A frozen role (the reference) has no optimizer state or gradients for stages 1 and 2 to
        # shard: it keeps its replica (stage 0) unless ZeRO-3 partitions its parameters.
        zero_stage = zero_stage if trainable or zero_stage == 3 else 0
        self.stage = zero_stage
        # ZeRO-3 gathers each parameter from its DP shards
        self.gather_replicas = dist.get_world_size(dp_group) if zero_stage == 3 else 1
        self.gathers_parameters = zero_stage == 3   # even on one DP rank (see TorchTrainer)
        self.trainable = trainable
        self.value_head = value_head
        self._host, self._away = [], False
        hf_config = files.config()
        buckets = zero_buckets(hf_config.hidden_size, files.numel("model.layers.0."), zero_stage, self.dp_size)
        config = deepspeed_config(job, zero_stage, trainable, buckets)
        model = (self._build(files, hf_config, config) if zero_stage == 3
                 else load_full(files, self.compute_dtype, device, value_head))
        if trainable:
            if job.train.recompute:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            optimizer = adamw(model, job)
        else:
            model.requires_grad_(False)
            model.eval()
            optimizer = None
        with hooks_without_gather():
            self.model, wrapped, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, mpu=_DataParallelOnly(dp_group),
                dist_init_required=False)
        # a frozen engine gets a stand-in optimizer all the same (bf16: BF16_Optimizer over a
        # DummyOptim; ZeRO-3: DeepSpeedZeRoOffload), with no state to move when the plan offloads it
        self.optimizer = wrapped if trainable else None

    @torch.no_grad()
    def _build(self, files: ModelFiles, hf_config, config: dict) -> torch.nn.Module:
        """ZeRO-3: parameters partitioned as they are created (zero.Init, with HF's own guards: no
        random init of the empty partitions, RoPE buffers kept fp32), then each rank fills its own
        partitions straight from the files (the rows that hold them): no parameter is gathered, and
        no rank reads more than its shard plus a row per tensor."""
        import deepspeed
        from transformers.initialization import no_init_weights
        from transformers.integrations.deepspeed import prevent_arange_dtype_change

        # The parameters' dtype comes from the config's bf16/fp16 sections: an explicit `dtype` is
        # ignored on accelerators without fp16 (the CPU), where zero.Init then picks bf16.
        with no_init_weights(), prevent_arange_dtype_change(), deepspeed.zero.Init(
                data_parallel_group=self.dp_group, config_dict_or_path=config, mpu=_DataParallelOnly(self.dp_group)):
            model = model_from_config(hf_config, self.compute_dtype, self.value_head)
        model.tie_weights()   # HF ties the head in init_weights, which no_init_weights skipped
        for name, param in model.named_parameters():
            # DeepSpeed's layout: rank r holds elements [r * n, (r + 1) * n) of the flattened
            # parameter, n = ceil(numel / dp); the last rank's tail is padding
            partition = param.ds_tensor
            start = dist.get_rank(param.ds_process_group) * partition.ds_numel
            count = max(0, min(partition.ds_numel, param.ds_numel - start))
            if count:
                partition.narrow(0, 0, count).copy_(files.read_flat(name, start, count, dtype=partition.dtype))
        return model

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

    def _zero_grad(self) -> None:
        """DeepSpeed's step() zeroes the gradients it applied."""

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.model.backward(loss, scale_wrt_gas=False)

    def _step(self) -> float | None:
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
        """ZeRO-3 training on GPUs: DeepSpeed's own offload_states (its contiguous buffers too);
        otherwise the partitions, fp32 masters and Adam state as every engine does (TorchTrainer)."""
        if self._own_offload:
            self.model.offload_states()
            torch.cuda.empty_cache()
        else:
            super().offload()

    def reload(self) -> None:
        if self._own_offload:
            self.model.reload_states()
        else:
            super().reload()

    @property
    def _own_offload(self) -> bool:
        """DeepSpeed's offload_states serves a ZeRO-3 training engine on GPUs (it moves its optimizer's
        buffers); a frozen engine has none."""
        return self.device.type == "cuda" and self.stage == 3 and self.trainable
