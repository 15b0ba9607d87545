"""Translate a Hugging Face config (Qwen2, LLaMA, Qwen2-MoE, Qwen3-MoE, Mixtral) into megatron-core's
TransformerConfig and GPTModel arguments.

Pure functions returning keyword dicts (no megatron import), so the translation is testable
without megatron-core; `model.build_gpt_model` passes them on. Anything the converter in
hpcrl.engines.resharding cannot represent exactly is refused here, with the field named, rather
than trained with silently different numerics.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from hpcrl.engines.capabilities import ModelDims, megatron_model_refusals, parallel_refusals, routed_experts
from hpcrl.engines.resharding import GPTShape


MOE_ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral")


def _check_supported(hf_config) -> None:
    """The converter's limits, from the table the plan checks config.json against too."""
    refused = megatron_model_refusals(hf_config.to_dict())
    if refused:
        raise ValueError("; ".join(refused))


def _moe_kwargs(hf_config) -> dict[str, Any]:
    """The routed experts, as each HF arch routes: softmax over all experts, then the top k, whose
    probabilities are renormalised (Mixtral; Qwen with norm_topk_prob) -- the same as a softmax over
    the top-k logits, megatron's default -- or kept as they are (Qwen without it: pre-softmax).
    Router scores in fp32, as transformers computes them (the logits in the model's dtype first: see
    model._route_as_transformers); no load-balancing loss (hpcrl's objective
    has none); dropless all-to-all dispatch, experts run one after another (no grouped GEMM kernel
    on CPU)."""
    arch = hf_config.model_type
    if arch not in MOE_ARCHS:
        return {}
    mixtral = arch == "mixtral"
    shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
    return dict(
        num_moe_experts=routed_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.intermediate_size if mixtral else hf_config.moe_intermediate_size,
        moe_router_pre_softmax=not (mixtral or hf_config.norm_topk_prob),
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        **({"moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": True} if shared else {}),
    )


def rope_theta(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def transformer_config_kwargs(hf_config, parallel: Mapping[str, int], dtype: torch.dtype,
                              recompute: bool = False) -> dict[str, Any]:
    """TransformerConfig(**these): the architecture, the parallel sizes, and CPU/GPU-neutral kernels.

    Fusions that need Apex or Transformer Engine are off (the local layer spec runs everywhere);
    `calculate_per_token_loss` because hpcrl's losses are already normalised by the global token
    count, so Megatron must sum gradients over micro-batches and DP ranks, never average them.
    No initialisation: the weights come from the HF files. `recompute`: full activation
    recomputation, one layer at a time (train.recompute).
    """
    _check_supported(hf_config)
    shape = GPTShape.from_hf(hf_config)
    tp, pp, cp, ep = (parallel.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    # the plan refuses these first, from the same table
    refused = parallel_refusals("<role>", "megatron", parallel, ModelDims.from_hf(hf_config))
    if refused:
        raise ValueError("; ".join(refused))
    return dict(
        num_layers=shape.num_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        # Qwen2-MoE builds its q/k/v biases from qkv_bias (default true), Qwen2 always
        add_qkv_bias=hf_config.model_type == "qwen2" or (hf_config.model_type == "qwen2_moe"
                                                         and getattr(hf_config, "qkv_bias", True)),
        qk_layernorm=hf_config.model_type == "qwen3_moe",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,   # megatron-core trains MoE layers with tp > 1 only so
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if recompute else {}),
        calculate_per_token_loss=True,
        **_moe_kwargs(hf_config),
    )


def gpt_model_kwargs(hf_config) -> dict[str, Any]:
    """GPTModel(config, spec, **these): vocabulary, positions and embedding tying."""
    return dict(
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        parallel_output=True,
    )
