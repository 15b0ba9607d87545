"""FSDP2 for the torch engine: build on the meta device, shard, then fill each rank's shard from the files.

As torchtitan does it: no rank ever holds more than its shard of the weights (plus, while
loading, one tensor's slice). The sharded parameters are fp32 master weights when the job
computes in bf16/fp16: FSDP2 casts them for each layer's forward (`param_dtype`) and reduces
gradients in fp32 (`reduce_dtype`), the layout Megatron and DeepSpeed keep too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpcrl.engines.model_files import ModelFiles, empty_model, init_buffers


def fully_shard_model(model: torch.nn.Module, dp_group: dist.ProcessGroup, device: torch.device,
                      compute_dtype: torch.dtype | None = None) -> None:
    """FSDP2 in place: every decoder layer a unit, then the rest (embeddings, norm, head) as the root.
    `compute_dtype`: cast the parameters to it for compute, reduce gradients in fp32."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(dp_group, device.type)
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype else None
    options = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for layer in getattr(getattr(model, "model", None), "layers", []):
        fully_shard(layer, **options)
    fully_shard(model, **options)


@torch.no_grad()
def load_sharded(files: ModelFiles, dp_group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None, value_head: bool = False) -> torch.nn.Module:
    """The HF model (the critic with `value_head`) sharded over `dp_group` with parameters in
    `dtype`, each rank's Shard(0) slice read straight from the safetensors files."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model = empty_model(files, dtype, value_head)
    fully_shard_model(model, dp_group, device, compute_dtype)
    model.to_empty(device=device)
    init_buffers(model)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            param.copy_(files.read(name, dtype=dtype))
            continue
        local = param.to_local()
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if local.numel():
            local.copy_(files.read(name, 0, offset[0], offset[0] + shape[0], dtype=dtype))
    return model
