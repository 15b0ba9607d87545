"""What each engine can run, as one table: the plan refuses from it before anything starts, and the
engines check the same function again when they build (so the two cannot drift apart).

Pure Python (no torch, no engine import): `hpcrl plan` runs it on a login node.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The model-parallel axes each engine implements beyond data parallelism.
MODEL_PARALLEL: dict[str, tuple[str, ...]] = {
    "torch": ("cp",), "deepspeed": (), "megatron": ("tp", "pp", "ep"), "native": (), "vllm": ("tp",),
}
# Why an axis is missing, and what to use instead.
_MISSING = {
    ("megatron", "cp"): "context parallelism needs Transformer Engine's attention (the local layer spec hpcrl "
                        "builds has none); use tp, pp or dp, or engine torch (its cp gathers keys and values)",
    ("native", "tp"): "the native sampler runs one whole copy of the model per rank; use dp, or engine: vllm "
                      "on GPUs for tensor parallelism",
    ("vllm", "pp"): "hpcrl runs vLLM with tensor parallelism only; use tp (up to a node) and dp",
}
# Roles the runtime implements.
IMPLEMENTED_ROLES = ("actor_train", "actor_infer", "reference", "critic", "reward", "env")
# (role, engine) pairs an engine cannot host, and why.
_ROLE_ENGINE = {("critic", "megatron"): "hpcrl builds Megatron's GPTModel with a vocabulary head only, no value "
                                        "head; give the critic engine: torch (fsdp: true to shard it) or deepspeed "
                                        "(its engine may differ from the actor's)"}


def routed_experts(config) -> int:
    """Routed experts per layer of a Hugging Face config (Qwen-MoE's num_experts, Mixtral's
    num_local_experts); 0 for a dense model."""
    return int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)


@dataclass(frozen=True)
class ModelDims:
    """The sizes that parallel splits must divide."""

    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_layers: int
    num_experts: int = 0   # routed experts per MoE layer; 0: a dense model
    mlp_widths: tuple[int, ...] = ()   # the widths TP splits: the dense MLP's, an expert's, the shared expert's

    @classmethod
    def from_hf(cls, config) -> ModelDims:
        """From a Hugging Face config (what an engine builds from)."""
        experts = routed_experts(config)
        widths = (config.intermediate_size, getattr(config, "moe_intermediate_size", 0) if experts else 0,
                  getattr(config, "shared_expert_intermediate_size", 0) if experts else 0)
        return cls(config.num_attention_heads, config.num_key_value_heads, config.vocab_size,
                   config.num_hidden_layers, experts, tuple(int(w) for w in widths if w))


def role_refusals(role: str, engine: str) -> list[str]:
    """Why `role` cannot run at all, or not on `engine` (empty when it can)."""
    if role not in IMPLEMENTED_ROLES:
        return [f"roles.{role}: no implementation; remove the role"]
    if (role, engine) in _ROLE_ENGINE:
        return [f"roles.{role}.engine: {engine}: {_ROLE_ENGINE[role, engine]}"]
    return []


def parallel_refusals(role: str, engine: str, parallel: Mapping[str, int], dims: ModelDims | None = None
                      ) -> list[str]:
    """Why `engine` cannot run `role` with these parallel sizes on a model of `dims` (each message
    names the key and the fix; empty when it can). Without `dims` only the axes are checked."""
    sizes = {axis: int(parallel.get(axis, 1)) for axis in ("tp", "pp", "cp", "ep")}
    out = []
    for axis, size in sizes.items():
        if size > 1 and axis not in MODEL_PARALLEL.get(engine, ()):   # rule, text: no model to split
            reason = _MISSING.get((engine, axis), f"the {engine} engine is data parallel only")
            out.append(f"roles.{role}.parallel.{axis}: {axis} = {size}, but {reason}")
    if dims is None:
        return out
    tp, pp, ep = sizes["tp"], sizes["pp"], sizes["ep"]
    if ep > 1 and engine == "megatron":
        dp_cp = int(parallel.get("dp", 1)) * sizes["cp"]
        if not dims.num_experts:
            out.append(f"roles.{role}.parallel.ep: ep = {ep} splits the experts of a mixture-of-experts model, and "
                       "this model is dense; use ep: 1")
        elif dims.num_experts % ep:
            out.append(f"roles.{role}.parallel.ep: {dims.num_experts} experts do not split over ep = {ep}; use an ep "
                       f"that divides {dims.num_experts}")
        if dp_cp % ep:
            out.append(f"roles.{role}.parallel.ep: the expert-parallel ranks are data-parallel ranks of the dense "
                       f"layers (megatron-core folds ep into dp x cp = {dp_cp}), and ep = {ep} does not divide "
                       f"{dp_cp}; use a dp that ep divides")
    if tp > 1 and engine in ("megatron", "vllm"):
        if dims.num_heads % tp:
            out.append(f"roles.{role}.parallel.tp: {dims.num_heads} attention heads (model.num_heads) do not split "
                       f"over tp = {tp}; use a tp that divides {dims.num_heads}")
        # Both split the KV heads over tp, or share each head among tp / kv_heads ranks (vLLM
        # replicates it; megatron-core gathers the fused QKV rows and takes its query heads' group).
        if dims.num_kv_heads % tp and tp % dims.num_kv_heads:
            out.append(f"roles.{role}.parallel.tp: {dims.num_kv_heads} KV heads (model.num_kv_heads) neither split "
                       f"over tp = {tp} nor share out evenly among its ranks; use a tp that divides "
                       f"{dims.num_kv_heads} or a multiple of it")
    if tp > 1 and engine == "megatron" and any(width % tp for width in dims.mlp_widths):
        out.append(f"model: the MLP widths {list(dims.mlp_widths)} (intermediate_size, and a MoE model's "
                   f"moe_intermediate_size and shared_expert_intermediate_size) must split evenly over "
                   f"roles.{role}.parallel.tp = {tp}; use a tp that divides them")
    if tp > 1 and engine == "megatron" and dims.vocab_size % tp:
        out.append(f"model.vocab_size: {dims.vocab_size} does not split evenly over roles.{role}.parallel.tp = {tp} "
                   "(Megatron's vocab-parallel embedding); pad the vocabulary to a multiple of tp")
    if pp > 1 and engine == "megatron" and dims.num_layers % pp:
        out.append(f"model.num_layers: {dims.num_layers} layers do not split evenly into roles.{role}.parallel.pp = "
                   f"{pp} pipeline stages; use a pp that divides {dims.num_layers}")
    return out


MEGATRON_ARCHS = ("qwen2", "llama", "qwen2_moe", "qwen3_moe", "mixtral")


def megatron_model_refusals(config: Mapping[str, Any]) -> list[str]:
    """What in a Hugging Face config (config.json's fields, or a config's `to_dict()`) the megatron
    engine's converter cannot represent exactly, each naming the field; empty when it can. A field
    left out takes transformers' default. The engine refuses these when it builds, the plan before
    anything is submitted."""
    arch = config.get("model_type")
    if arch not in MEGATRON_ARCHS:
        return [f"model_type={arch!r}: the megatron engine converts {', '.join(MEGATRON_ARCHS)} models only"]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    mlp_only, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)
    checks = (
        (arch in ("qwen2_moe", "qwen3_moe") and (mlp_only or step != 1),
         f"mlp_only_layers={mlp_only}, decoder_sparse_step={step}: the megatron engine builds every layer with "
         "experts"),
        (config.get("hidden_act", "silu") != "silu",
         f"hidden_act={config.get('hidden_act')!r}: only SwiGLU (silu) MLPs are converted"),
        (rope_type != "default", f"rope_type={rope_type!r}: only plain rotary embeddings are converted"),
        (bool(config.get("use_sliding_window")), "use_sliding_window=True is not supported by the megatron engine"),
        # Mixtral windows its attention whenever sliding_window is set (Qwen2's only with use_sliding_window)
        (arch == "mixtral" and bool(config.get("sliding_window")),
         f"sliding_window={config.get('sliding_window')}: Mixtral's windowed attention is not supported by the "
         "megatron engine (it would attend to the whole prefix); set it to null"),
        (arch == "llama" and bool(config.get("attention_bias") or config.get("mlp_bias")),
         "LLaMA attention_bias/mlp_bias add biases (o_proj, MLP) the converter does not map"),
        (arch == "mixtral" and bool(config.get("router_jitter_noise")),
         f"router_jitter_noise={config.get('router_jitter_noise')}: Mixtral's router noise is not mapped to "
         "megatron (the engines would route differently); set it to 0"),
        (arch == "qwen3_moe" and bool(config.get("attention_bias")),
         "Qwen3-MoE attention_bias adds an o_proj bias the converter does not map"),
    )
    return [reason for refused, reason in checks if refused]
