"""Build this rank's Megatron-core GPTModel stage from an HF model: same weights, Megatron layout."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from hpcrl.engines.megatron.config import gpt_model_kwargs, transformer_config_kwargs
from hpcrl.engines.megatron.cpu_shim import apply_if_no_cuda
from hpcrl.engines.resharding import GPTShape, hf_to_mcore, stage_state


def build_gpt_model(hf_model: torch.nn.Module, pgc, seed: int) -> torch.nn.Module:
    """The GPTModel stage of this rank (TP shard of PP stage, sizes from the groups in `pgc`),
    holding `hf_model`'s weights.

    Uses megatron-core's local layer spec (no Transformer Engine or Apex needed). Weights are
    built on the CPU, loaded, then moved to the current device; bf16/fp16 models are wrapped in
    Float16Module, as Megatron-LM does, so logits come out in float32.
    """
    apply_if_no_cuda()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # a per-process scratch buffer, not tied to any group
        parallel_state._set_global_memory_buffer()
    hf_config = hf_model.config
    dtype = next(hf_model.parameters()).dtype
    parallel = {kind: getattr(pgc, kind).size() for kind in ("tp", "pp", "cp", "ep")}
    config = TransformerConfig(**transformer_config_kwargs(hf_config, parallel, dtype))
    tp_rank, pp_rank, pp = pgc.tp.rank(), pgc.pp.rank(), pgc.pp.size()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), pre_process=pp_rank == 0,
                     post_process=pp_rank == pp - 1, pg_collection=pgc, **gpt_model_kwargs(hf_config))
    shape = GPTShape.from_hf(hf_config)
    full = hf_to_mcore({n: p.detach() for n, p in hf_model.named_parameters()}, shape)
    load_stage(model, stage_state(full, shape, pgc.tp.size(), tp_rank, pp, pp_rank))
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.to(device)
    return Float16Module(config, model) if config.bf16 or config.fp16 else model


@torch.no_grad()
def load_stage(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a stage's Megatron-named tensors into the model; names and shapes must match exactly."""
    params = dict(model.named_parameters())
    if params.keys() != state.keys():
        raise KeyError(f"Megatron stage parameters differ from the converted HF weights: model only "
                       f"{sorted(params.keys() - state.keys())}, converted only {sorted(state.keys() - params.keys())}")
    for name, param in params.items():
        if param.shape != state[name].shape:
            raise ValueError(f"{name}: the model has shape {tuple(param.shape)}, the converted weight "
                             f"{tuple(state[name].shape)}")
        param.copy_(state[name])
