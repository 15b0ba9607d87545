"""This rank's Megatron-core GPTModel stage, and its weights from HF files: each rank reads only its slices."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from hpcrl.engines.megatron.config import gpt_model_kwargs, transformer_config_kwargs
from hpcrl.engines.model_files import ModelFiles
from hpcrl.engines.resharding import GPTShape, read_stage_tensor, tp_dim


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as megatron's local layer spec builds it (WrappedTorchNorm), but also under
    sequence parallelism, which megatron-core requires of MoE layers with tp > 1 and which its
    local spec refuses (it leaves the norm to Apex or Transformer Engine). A norm needs nothing
    more for it than its weight marked `sequence_parallel`: each TP rank normalises its own
    positions, and megatron's finalize_model_grads sums the marked gradients over TP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def layer_spec(config, num_layers: int):
    """megatron-core's local layer spec (no Transformer Engine or Apex needed), experts run one
    after another, with `RMSNorm` for every norm; as the block spec of a stage of `num_layers`."""
    from dataclasses import replace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    attention = spec.submodules.self_attention
    norms = {kind: RMSNorm for kind in ("q_layernorm", "k_layernorm")
             if getattr(attention.submodules, kind) is not IdentityOp}
    attention = replace(attention, submodules=replace(attention.submodules, **norms))
    layer = replace(spec, submodules=replace(spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm,
                                             self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)


def _route_as_transformers(model: torch.nn.Module) -> None:
    """Router logits in the model's dtype, then fp32: transformers multiplies the hidden states by
    the router in the model's dtype and only then takes the softmax and top-k in fp32, while
    megatron's fp32 router (moe_router_dtype) multiplies in fp32. In bf16 the two round apart and
    near-ties at the k-th expert would route tokens differently in training and rollout. The
    router keeps its last logits (`last_logits`) for the engine's load-balancing loss and metrics."""
    import types

    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    def gating(router, hidden: torch.Tensor) -> torch.Tensor:
        router.last_logits = router_gating_linear(hidden, router.weight, router.bias, hidden.dtype).float()
        return router.last_logits

    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.gating = types.MethodType(gating, module)


def _share_kv_heads_in_the_roles_group(model: torch.nn.Module, tp_group) -> None:
    """With fewer KV heads than TP ranks, megatron-core 0.16's attention all-gathers the fused QKV
    rows and picks its query group with the global TP group and rank (parallel_state), ignoring
    the model's `pg_collection`; a role's groups are not global here (hpcrl.engines.megatron.groups),
    so the gather found no group. For that call only, the two names it uses take the role's TP
    group; the all-gather's backward keeps the group it ran with."""
    import functools
    import types

    from megatron.core.transformer import attention as megatron_attention

    gather = functools.partial(megatron_attention.all_gather_last_dim_from_tensor_parallel_region, group=tp_group)
    names = {"all_gather_last_dim_from_tensor_parallel_region": gather, "get_tensor_model_parallel_rank": tp_group.rank}

    def qkv(attention, *args, **kwargs):
        outside = {name: getattr(megatron_attention, name) for name in names}
        vars(megatron_attention).update(names)
        try:
            return type(attention).get_query_key_value_tensors(attention, *args, **kwargs)
        finally:
            vars(megatron_attention).update(outside)

    for module in model.modules():
        if isinstance(module, megatron_attention.Attention) and module.config.num_query_groups < tp_group.size():
            module.get_query_key_value_tensors = types.MethodType(qkv, module)


def _mend_megatron_without_te() -> None:
    """megatron-core 0.16's router reads `te_general_gemm`, which its moe_utils defines only when
    Transformer Engine imports: without TE every MoE forward raised NameError. None is what the
    code tests for (and then takes torch's matmul)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(files: ModelFiles, pgc, seed: int, dtype: torch.dtype, recompute: bool = False
                    ) -> torch.nn.Module:
    """The GPTModel stage of this rank (TP shard of PP stage, sizes from the groups in `pgc`), its
    parameters allocated but not initialised: `load_gpt_weights` fills them from the files.

    Uses megatron-core's local layer spec (`layer_spec`). Parameters are
    allocated on the CPU (untouched, they take no memory there yet), then moved to the current
    device; bf16/fp16 models are wrapped in Float16Module, as Megatron-LM does, so logits come out
    in float32. Loading comes after megatron's DDP has moved the parameters into its contiguous
    buffer: loaded before, the rank would hold its weights twice while DDP copies them.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # a per-process scratch buffer, not tied to any group
        parallel_state._set_global_memory_buffer()
    hf_config = files.config()
    parallel = {kind: getattr(pgc, kind).size() for kind in ("tp", "pp", "cp", "ep", "dp")}
    config = TransformerConfig(**transformer_config_kwargs(hf_config, parallel, dtype, recompute))
    tp_rank, pp_rank, pp = pgc.tp.rank(), pgc.pp.rank(), pgc.pp.size()
    model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=pgc.ep.rank(), etp_rank=pgc.expt_tp.rank())
    _mend_megatron_without_te()
    model = GPTModel(config, layer_spec(config, config.num_layers // pp), pre_process=pp_rank == 0,
                     post_process=pp_rank == pp - 1, pg_collection=pgc, **gpt_model_kwargs(hf_config))
    _route_as_transformers(model)
    _share_kv_heads_in_the_roles_group(model, pgc.tp)
    _mark_tensor_parallel(model)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.to(device)
    return Float16Module(config, model) if config.bf16 or config.fp16 else model


def load_gpt_weights(gpt: torch.nn.Module, files: ModelFiles, pgc) -> None:
    """Fill this rank's GPTModel stage from `files`, reading only its slices, tensor by tensor."""
    hf_config = files.config()
    shape = GPTShape.from_hf(hf_config)
    sizes = {"vocab": hf_config.vocab_size, "ffn": hf_config.intermediate_size,
             "shared_ffn": getattr(hf_config, "shared_expert_intermediate_size", 0) or 0}
    tp_rank, pp_rank, pp, tp = pgc.tp.rank(), pgc.pp.rank(), pgc.pp.size(), pgc.tp.size()
    dtype = next(gpt.parameters()).dtype
    load_stage(gpt, ((name, read_stage_tensor(files, name, shape, sizes, tp, tp_rank, pp, pp_rank, dtype,
                                              pgc.ep.size(), pgc.ep.rank()))
                     for name, _ in gpt.named_parameters()))


def _mark_tensor_parallel(model: torch.nn.Module) -> None:
    """The attributes megatron-core sets only when it initialises weights itself: which dimension
    each parameter is split along over TP. The gradient norm (clipping) and the distributed
    optimizer count a parameter without them as a TP duplicate, on TP rank 0 only."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = tp_dim(name)
        if dim is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


@torch.no_grad()
def load_stage(model: torch.nn.Module, state: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy a stage's Megatron-named tensors into the model, one at a time; names and shapes must
    match exactly."""
    params = dict(model.named_parameters())
    seen = set()
    for name, tensor in state:
        if name not in params:
            raise KeyError(f"Megatron stage has no parameter {name!r} (converted from the HF weights)")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: the model has shape {tuple(params[name].shape)}, the converted weight "
                             f"{tuple(tensor.shape)}")
        params[name].copy_(tensor)
        seen.add(name)
    if seen != params.keys():
        raise KeyError(f"Megatron stage parameters without a converted HF weight: {sorted(params.keys() - seen)}")
