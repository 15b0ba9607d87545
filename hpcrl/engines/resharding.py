"""Hugging Face <-> Megatron-core weight layouts, and gathering a sharded trainer into HF tensors.

The weight sync ships full tensors under HF names (see engines/base.py), so a Megatron trainer
sharded by TP and PP must rebuild them: TP shards are concatenated along the dimension each
parallel linear splits (the fused SwiGLU fc1 holds `[gate_r; up_r]` per shard, so it is
re-interleaved), PP stages number their layers from 0 and are shifted by the stage's offset
(each stage's leader yields its own layers), and
Megatron's fused QKV (per query group: that group's query heads, then its key and value head) is
cut back into q/k/v projections. Conversion follows the mcore <-> HF converters of verl,
NeMo-RL and ROLL for the local (non-Transformer-Engine) layer spec of Qwen2 and LLaMA, and of the
mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, Mixtral): the router is HF's `mlp.gate`, expert
e of a layer is `mlp.experts.local_experts.e` (numbered within its EP rank: rank r holds experts
r*E/ep ...), each a SwiGLU MLP whose fc1/fc2 are row e of transformers' fused, expert-stacked
`mlp.experts.gate_up_proj` / `down_proj`; Qwen2-MoE's shared expert and its sigmoid gate are
`mlp.shared_experts.*`, Qwen3's q/k RMSNorms `self_attention.{q,k}_layernorm`.

Everything here is torch only: no megatron import, so the layout logic is testable anywhere.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hpcrl.engines.capabilities import routed_experts

Named = tuple[str, torch.Tensor]
T = TypeVar("T")
Meta = list[tuple[str, tuple[int, ...], torch.dtype]]
DEFAULT_BUCKET_BYTES = 64 << 20

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per-layer and model-level parameters that map one to one.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
_MODEL_RENAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_QKV = "self_attention.linear_qkv."
_FC1 = "linear_fc1.weight"   # a SwiGLU MLP's fused [gate; up]: the dense MLP's, an expert's, the shared expert's
# Megatron fc1 -> the HF [gate, up] pair it fuses, for the dense MLP and Qwen2-MoE's shared expert.
_GATE_UP = {"mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
            "mlp.shared_experts.linear_fc1.weight": ("mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight")}
_EXPERT = re.compile(r"^(.*)mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_HF_EXPERTS = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}
# The dimension each tensor-parallel layer splits: column-parallel layers (and the vocab-parallel
# embedding) split their output rows, row-parallel layers their input columns; norms are replicated.
_COLUMN_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", _FC1, "word_embeddings.weight", "output_layer.weight")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


@dataclass(frozen=True)
class GPTShape:
    """The sizes the layout conversion depends on (a Qwen2/LLaMA decoder, dense or MoE)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    num_experts: int = 0   # routed experts per layer (0: dense)

    @classmethod
    def from_hf(cls, config) -> GPTShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, head_dim,
                   bool(config.tie_word_embeddings), routed_experts(config))


# ---- full tensors: HF <-> Megatron names and fused layouts ----------------------------------------------------

def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: GPTShape) -> torch.Tensor:
    groups, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: GPTShape) -> tuple[torch.Tensor, ...]:
    groups, d = shape.num_kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    per_group = shape.num_heads // groups * d
    q, k, v = qkv.reshape(groups, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


_HF_GATE = {gate: fc1 for fc1, (gate, _) in _GATE_UP.items()}
_HF_UP = {up for _, up in _GATE_UP.values()}
_HF_EXPERT_NAMES = {hf: fc for fc, hf in _HF_EXPERTS.items()}


def hf_to_mcore(hf: Mapping[str, torch.Tensor], shape: GPTShape) -> dict[str, torch.Tensor]:
    """The unsharded Megatron state (global layer numbers) of an HF Qwen2/LLaMA state dict."""
    out: dict[str, torch.Tensor] = {}
    hf_model_names = {v: k for k, v in _MODEL_RENAMES.items()}
    for name, tensor in hf.items():
        if name in hf_model_names:
            if not (name == "lm_head.weight" and shape.tied):
                out[hf_model_names[name]] = tensor
            continue
        match = _HF_LAYER.match(name)
        if match is None:
            raise KeyError(f"HF -> Megatron: no Megatron parameter for {name!r}")
        layer, rest = match.groups()
        prefix = f"decoder.layers.{layer}."
        hf_prefix = f"model.layers.{layer}."
        if rest.startswith("self_attn.q_proj."):
            kind = rest.rsplit(".", 1)[1]
            out[prefix + _QKV + kind] = _fuse_qkv(
                *(hf[f"{hf_prefix}self_attn.{p}_proj.{kind}"] for p in "qkv"), shape)
        elif rest in _HF_GATE:
            out[prefix + _HF_GATE[rest]] = torch.cat([tensor, hf[hf_prefix + _GATE_UP[_HF_GATE[rest]][1]]], dim=0)
        elif rest in _HF_EXPERT_NAMES:   # [E, ...]: expert e's fc1 [gate_e; up_e] or fc2
            for expert, weight in enumerate(tensor):
                out[f"{prefix}mlp.experts.local_experts.{expert}.{_HF_EXPERT_NAMES[rest]}.weight"] = weight
        elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")) or rest in _HF_UP:
            continue  # fused with q_proj / gate_proj above
        else:
            mcore = {v: k for k, v in _LAYER_RENAMES.items()}.get(rest)
            if mcore is None:
                raise KeyError(f"HF -> Megatron: no Megatron parameter for {name!r}")
            out[prefix + mcore] = tensor
    return out


def _hf_layer(prefix: str) -> str:
    """"model.layers.N." of "decoder.layers.N."."""
    return prefix.replace("decoder.layers.", "model.layers.", 1)


def _hf_layer_prefix(name: str, error: str) -> tuple[str, str]:
    """("model.layers.N.", the rest of the name) of a Megatron decoder-layer parameter."""
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"{error} {name!r}")
    layer, rest = match.groups()
    return f"model.layers.{layer}.", rest


def mcore_to_hf(name: str, tensor: torch.Tensor, shape: GPTShape) -> list[Named]:
    """HF tensors of one unsharded Megatron parameter (global layer number); [] for a tied output
    layer. Not for an expert's: HF stacks a layer's experts in one tensor (`mcore_state_to_hf`)."""
    if name in _MODEL_RENAMES:
        return [] if name == "output_layer.weight" and shape.tied else [(_MODEL_RENAMES[name], tensor)]
    prefix, rest = _hf_layer_prefix(name, "Megatron -> HF: unknown parameter")
    if rest.startswith(_QKV):
        kind = rest[len(_QKV):]
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", _split_qkv(tensor, shape))]
    if rest in _GATE_UP:
        return [(prefix + hf, t.contiguous()) for hf, t in zip(_GATE_UP[rest], tensor.chunk(2, dim=0))]
    if rest not in _LAYER_RENAMES:
        raise KeyError(f"Megatron -> HF: unknown parameter {name!r}")
    return [(prefix + _LAYER_RENAMES[rest], tensor)]


def mcore_state_to_hf(named: Iterable[Named], shape: GPTShape) -> Iterator[Named]:
    """HF tensors of unsharded Megatron parameters (global layer and expert numbers), in order; a
    layer's experts are held until the last of them arrives, then yielded as one stacked tensor."""
    pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in named:
        match = _EXPERT.match(name)
        if match is None:
            yield from mcore_to_hf(name, tensor, shape)
            continue
        layer, expert, fc = match.groups()
        experts = pending.setdefault((layer, fc), {})
        experts[int(expert)] = tensor
        if len(experts) == shape.num_experts:
            yield _hf_layer(layer) + _HF_EXPERTS[fc], torch.stack([experts[e] for e in range(shape.num_experts)])
            del pending[layer, fc]
    if pending:
        raise KeyError(f"Megatron -> HF: experts missing of {sorted(pending)}: "
                       f"got {[sorted(e) for e in pending.values()]} of {shape.num_experts}")


# ---- tensor parallelism -----------------------------------------------------------------------------------------

def tp_dim(name: str) -> int | None:
    """The dimension TP splits this Megatron parameter along (None: replicated on every TP rank)."""
    if name.endswith(_COLUMN_PARALLEL):
        return 0
    if name.endswith(_ROW_PARALLEL):
        return 1
    return None


def split_tp(name: str, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The TP shards of an unsharded parameter, in TP-rank order."""
    dim = tp_dim(name)
    if dim is None:
        return [full] * tp
    if name.endswith(_FC1):
        gate, up = full.chunk(2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return [t.contiguous() for t in full.chunk(tp, dim=dim)]


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `split_tp`."""
    dim = tp_dim(name)
    if dim is None:
        return shards[0]
    if name.endswith(_FC1):
        pairs = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([g for g, _ in pairs] + [u for _, u in pairs], dim=0)
    return torch.cat(shards, dim=dim)


# ---- pipeline parallelism ---------------------------------------------------------------------------------------

def expert_offset(name: str, offset: int) -> str:
    """A parameter name with its expert number shifted by `offset` (EP-rank-local <-> global)."""
    match = _EXPERT.match(name)
    return name if match is None else \
        f"{match.group(1)}mlp.experts.local_experts.{int(match.group(2)) + offset}.{match.group(3)}.weight"


def is_expert(name: str) -> bool:
    """A routed expert's parameter: split over EP ranks, replicated over expert-data-parallel ones."""
    return _EXPERT.match(name) is not None


def layer_offset(num_layers: int, pp: int, pp_rank: int) -> int:
    """Global number of a stage's first layer (Megatron's even split; each stage counts from 0)."""
    if num_layers % pp:
        raise ValueError(f"num_layers={num_layers} does not split evenly into pp={pp} pipeline stages")
    return pp_rank * (num_layers // pp)


def renumber(name: str, offset: int) -> str:
    """A parameter name with its layer number shifted by `offset` (stage-local <-> global)."""
    match = _LAYER.match(name)
    return name if match is None else f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}"


def stage_state(full: Mapping[str, torch.Tensor], shape: GPTShape, tp: int, tp_rank: int, pp: int,
                pp_rank: int, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """What one (TP rank, PP stage, EP rank) of a Megatron GPTModel holds, under its local names.

    The first stage holds the embedding, the last the final norm and output layer; with tied
    embeddings and pp > 1 the last stage keeps its own copy of the embedding as `output_layer`.
    EP rank r holds experts r*E/ep ... (r+1)*E/ep - 1, numbered from 0.
    """
    per_stage = shape.num_layers // pp
    first = layer_offset(shape.num_layers, pp, pp_rank)
    per_rank = shape.num_experts // ep
    out = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match is not None:
            if not first <= int(match.group(1)) < first + per_stage:
                continue
            expert = _EXPERT.match(name)
            if expert is not None:
                if not ep_rank * per_rank <= int(expert.group(2)) < (ep_rank + 1) * per_rank:
                    continue
                name = expert_offset(name, -ep_rank * per_rank)
        elif name.startswith("embedding.") and pp_rank != 0:
            continue
        elif name.startswith(("decoder.final_layernorm", "output_layer")) and pp_rank != pp - 1:
            continue
        out[renumber(name, -first)] = split_tp(name, tensor, tp)[tp_rank]
    if shape.tied and pp > 1 and pp_rank == pp - 1:
        embedding = full["embedding.word_embeddings.weight"]
        out["output_layer.weight"] = split_tp("output_layer.weight", embedding, tp)[tp_rank]
    return out


class TensorReader(Protocol):
    """Where HF tensors come from, a slice at a time (engines.model_files.ModelFiles)."""

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor: ...


def _rows(reader: TensorReader, name: str, per_rank: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return reader.read(name, 0, rank * per_rank, (rank + 1) * per_rank, dtype)


def read_stage_tensor(reader: TensorReader, local_name: str, shape: GPTShape, sizes: Mapping[str, int], tp: int,
                      tp_rank: int, pp: int, pp_rank: int, dtype: torch.dtype, ep: int = 1, ep_rank: int = 0
                      ) -> torch.Tensor:
    """One parameter of a (TP rank, PP stage, EP rank) of a Megatron GPTModel, read straight from HF
    tensors: only the rows or columns this TP rank holds, of the experts this EP rank holds (what
    `stage_state(hf_to_mcore(...))` gives).

    `sizes`: the unsharded sizes the slices depend on ("vocab", "ffn", and "shared_ffn": Qwen2-MoE's
    shared expert)."""
    name = renumber(local_name, layer_offset(shape.num_layers, pp, pp_rank))
    name = expert_offset(name, ep_rank * (shape.num_experts // max(1, ep)))
    expert = _EXPERT.match(name)
    if expert is not None:   # one expert's row of the stacked HF tensor, then this TP rank's part of it
        layer, index, fc = expert.groups()
        stacked = reader.read(_hf_layer(layer) + _HF_EXPERTS[fc], 0,
                              int(index), int(index) + 1, dtype)[0]
        return split_tp(fc + ".weight", stacked, tp)[tp_rank]
    if name == "embedding.word_embeddings.weight":
        return _rows(reader, "model.embed_tokens.weight", sizes["vocab"] // tp, tp_rank, dtype)
    if name == "output_layer.weight":   # tied: the last stage's copy of the embedding
        source = "model.embed_tokens.weight" if shape.tied else "lm_head.weight"
        return _rows(reader, source, sizes["vocab"] // tp, tp_rank, dtype)
    if name == "decoder.final_layernorm.weight":
        return reader.read("model.norm.weight", dtype=dtype)
    prefix, rest = _hf_layer_prefix(name, "HF -> Megatron: no HF tensor for Megatron parameter")
    if rest.startswith(_QKV):
        kind = rest[len(_QKV):]
        # kv_heads >= tp: this rank's kv_heads/tp whole query groups. kv_heads < tp (megatron-core
        # all-gathers the fused rows and picks its group): tp/kv_heads ranks share one group, each
        # holding an equal run of its fused rows, as chunking the whole fused tensor gives.
        groups, share = max(1, shape.num_kv_heads // tp), max(1, tp // shape.num_kv_heads)
        first = tp_rank // share * groups
        d, heads_per_group = shape.head_dim, shape.num_heads // shape.num_kv_heads
        q, k, v = (reader.read(f"{prefix}self_attn.{p}_proj.{kind}", 0, first * rows, (first + groups) * rows, dtype)
                   for p, rows in (("q", heads_per_group * d), ("k", d), ("v", d)))
        local = GPTShape(shape.num_layers, groups * heads_per_group, groups, d, shape.tied)
        return _fuse_qkv(q, k, v, local).chunk(share)[tp_rank % share].contiguous()
    ffn = sizes["shared_ffn"] if rest.startswith("mlp.shared_experts.") else sizes["ffn"]
    if rest in _GATE_UP:
        return torch.cat([_rows(reader, prefix + hf, ffn // tp, tp_rank, dtype) for hf in _GATE_UP[rest]], dim=0)
    hf = prefix + _LAYER_RENAMES.get(rest, "")
    if rest not in _LAYER_RENAMES:
        raise KeyError(f"HF -> Megatron: no HF tensor for Megatron parameter {name!r}")
    if tp_dim(rest) == 1:   # row parallel: o_proj's input is the heads, down_proj's the MLP width
        per_rank = (shape.num_heads * shape.head_dim if rest.startswith("self_attention") else ffn) // tp
        return reader.read(hf, 1, tp_rank * per_rank, (tp_rank + 1) * per_rank, dtype)
    return reader.read(hf, dtype=dtype)


# ---- bucketing and the collective gather --------------------------------------------------------------------------

def _buckets(items: Iterable[T], size_and_dtype: Callable[[T], tuple[int, torch.dtype]],
             bucket_bytes: int) -> Iterator[list[T]]:
    """Consecutive runs of same-dtype items of at most `bucket_bytes` (a larger item is alone)."""
    bucket: list[T] = []
    size, dtype = 0, None
    for item in items:
        nbytes, item_dtype = size_and_dtype(item)
        if bucket and (size + nbytes > bucket_bytes or item_dtype != dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
        dtype = item_dtype
    if bucket:
        yield bucket


def plan_buckets(meta: Meta, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Meta]:
    """The buckets of (name, shape, dtype) entries that one flat collective each moves."""
    def size(entry):
        return torch.Size(entry[1]).numel() * torch.empty((), dtype=entry[2]).element_size(), entry[2]
    return list(_buckets(meta, size, bucket_bytes))


def named_buckets(named: Iterable[Named], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[Named]]:
    """Buckets of (name, tensor) pairs, taken from `named` as they come (an iterator is not drained)."""
    return _buckets(named, lambda pair: (pair[1].nbytes, pair[1].dtype), bucket_bytes)


def _meta(named: Iterable[Named]) -> Meta:
    return [(n, tuple(t.shape), t.dtype) for n, t in named]


def _unflatten(flat: torch.Tensor, bucket: Meta) -> list[torch.Tensor]:
    return list(_unflatten_dense_tensors(flat, [torch.empty(s, dtype=d, device="meta") for _, s, d in bucket]))


def _gather_tp(local: list[Named], group: dist.ProcessGroup | None, bucket_bytes: int) -> Iterator[Named]:
    """Unsharded tensors (stage-local names) on TP rank 0, one flat `gather` per bucket."""
    tp = dist.get_world_size(group) if group is not None else 1
    if tp == 1:
        yield from local
        return
    tensors = dict(local)
    leader = dist.get_rank(group) == 0
    for bucket in plan_buckets(_meta(local), bucket_bytes):
        flat = _flatten_dense_tensors([tensors[name].contiguous() for name, _, _ in bucket])
        gathered = [torch.empty_like(flat) for _ in range(tp)] if leader else None
        dist.gather(flat, gathered, group=group, group_dst=0)
        if leader:
            per_rank = [_unflatten(g, bucket) for g in gathered]
            for index, (name, _, _) in enumerate(bucket):
                yield name, merge_tp(name, [shards[index] for shards in per_rank])


def _gather_ep(local: list[Named], group: dist.ProcessGroup | None, bucket_bytes: int) -> list[Named] | None:
    """On EP rank 0, `local` with the routed experts of every EP rank (global expert numbers), one
    flat `gather` per bucket of expert tensors; None on the other EP ranks."""
    ep = dist.get_world_size(group) if group is not None else 1
    if ep == 1:
        return local
    experts = [(name, t) for name, t in local if is_expert(name)]
    tensors = dict(experts)
    per_rank = len({_EXPERT.match(name).group(2) for name, _ in experts})
    leader = dist.get_rank(group) == 0
    out = [(name, t) for name, t in local if not is_expert(name)]
    for bucket in plan_buckets(_meta(experts), bucket_bytes):
        flat = _flatten_dense_tensors([tensors[name].contiguous() for name, _, _ in bucket])
        gathered = [torch.empty_like(flat) for _ in range(ep)] if leader else None
        dist.gather(flat, gathered, group=group, group_dst=0)
        if leader:
            out += [(expert_offset(name, rank * per_rank), t) for rank, g in enumerate(gathered)
                    for (name, _, _), t in zip(bucket, _unflatten(g, bucket))]
    return out if leader else None


def _by_layer(local: list[Named]) -> Iterator[list[Named]]:
    """Runs of consecutive parameters of one decoder layer (or of none: embedding, final norm, head)."""
    run: list[Named] = []
    for name, tensor in local:
        if run and _layer_of(run[0][0]) != _layer_of(name):
            yield run
            run = []
        run.append((name, tensor))
    if run:
        yield run


def _layer_of(name: str) -> str | None:
    match = _LAYER.match(name)
    return None if match is None else match.group(1)


def gather_hf(local: list[Named], shape: GPTShape, tp_group: dist.ProcessGroup | None, pp: int, pp_rank: int,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES, ep_group: dist.ProcessGroup | None = None
              ) -> Iterator[Named]:
    """One pipeline stage's full HF-named tensors (global layer numbers), yielded on the stage's TP
    rank 0 of EP rank 0; every stage at once, none funnelled through another (the weight sync
    sends each stage from its own leader).

    Collective: every rank of the TP and EP groups iterates it to the end (the others yield
    nothing). A layer at a time, its experts are gathered bucket by bucket to EP rank 0 (each TP
    rank its own shards), then its TP shards to TP rank 0 (whose TP group has the same EP rank):
    a leader holds one layer's gathered tensors beyond what it yields, not a stage's (a 30B MoE
    stage's experts would not fit beside the model). Tensors stay on the device of `local` (NCCL
    moves device tensors only).
    """
    def merged() -> Iterator[Named]:
        for layer in _by_layer(local):
            gathered = _gather_ep(layer, ep_group, bucket_bytes)
            if gathered is not None:
                yield from _gather_tp(gathered, tp_group, bucket_bytes)

    leader = all(group is None or dist.get_rank(group) == 0 for group in (tp_group, ep_group))
    if not leader:
        for _ in merged():
            pass
        return
    yield from hf_tensors(merged(), shape, pp, pp_rank)


def hf_tensors(merged: Iterable[Named], shape: GPTShape, pp: int, pp_rank: int) -> Iterator[Named]:
    """HF tensors of one pipeline stage's unsharded Megatron parameters (stage-local layer
    numbers, global expert numbers)."""
    offset = layer_offset(shape.num_layers, pp, pp_rank)
    return mcore_state_to_hf(((renumber(name, offset), full) for name, full in merged), shape)
