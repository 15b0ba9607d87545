"""Parameter count from the model config and the per-device memory of each role, in each engine's layout.

GB here means GiB (2**30 bytes), on both sides of the comparison with `device_memory_gb`.
Every figure is per device, while the role is resident (see the plan's stages). Calibrated on
CPU against the measured peak of a training step (bench/memory.py, tests/test_memory_estimate.py).

P = parameter count; b = bytes per element of `model.dtype` (4 float32, 2 bfloat16/float16);
shards = tp*pp.

- P: embedding V*H; per layer: q H*H (+H bias), k and v H*KV (+KV bias each) with KV = kv_heads *
  head_dim (GQA), o H*H, SwiGLU MLP 3*H*I, two RMSNorms 2*H; final norm H; lm head V*H unless the
  embeddings are tied. qkv biases for arch qwen2 and qwen2_moe (and for a config.json with
  attention_bias); Qwen3's q/k RMSNorms 2*head_dim. A MoE layer (`moe_layers` of them; Qwen-MoE's
  mlp_only_layers and decoder_sparse_step keep others dense) has a router H*E and E experts of
  3*H*I_e instead of the MLP, and Qwen2-MoE a shared expert 3*H*I_s with its gate H.
  V = model.vocab_size, or 256 (the built-in task tokenizer's order of size) when unset. The critic
  has a value head (H + 1) instead of the lm head.
- Model state of a training role (actor_train, critic), by engine:
  - torch: fp32 master weights 4P, fp32 gradients 4P, Adam 8P, and 8P of transients (AdamW's
    temporaries, foreach on GPUs, and gradient accumulation's; calibrated on CPU by
    bench/memory.py); with FSDP2 all divided by dp (by dp x cp with context parallelism),
    plus the units gathered for compute (two decoder layers and the root's embedding and head,
    in b); with DDP (dp > 1) its gradient buckets (4P); with autocast (b = 2, no FSDP2) the
    weights' 16-bit copies (bP).
  - deepspeed: weights bP, gradients bP (4P from ZeRO-2: summed and reduced in fp32), optimizer state 12P (fp32 master weights, also for an
    fp32 model, and Adam) and 8P of step transients (AdamW over the flat fp32 partition); ZeRO
    divides the optimizer state and transients by dp (stage >= 1), the gradients (stage >= 2)
    and the weights (stage 3). ZeRO-3 steps its optimizer one sub-group at a time (two decoder
    layers, or the embedding alone: see deepspeed_engine.zero_buckets), so its transients are
    12 bytes (the sub-group's flat fp32 gradient and AdamW's temporaries) per element of the
    largest sub-group's partition instead.
  - megatron: weights bS' / tp, fp32 gradient buffer 4S' / tp, and the distributed optimizer's
    share (fp32 master weights when b = 2, and Adam) (4 + 8)S / tp / dp, where S is the largest
    pipeline stage's parameters: its layers and the embedding (first stage) or the output layer
    (last; a copy of the embedding when tied); S = P when pp = 1. S' = S - X + X / ep, X the
    stage's routed experts (ep splits them; their optimizer state is sharded over the dp * cp / ep
    expert-data-parallel ranks, the same share as the dense parameters' with cp = 1).
- Activations of a training role: one micro-batch of T = rows x S tokens, S the context
  (model.max_position_embeddings), rows = train.micro_batch_size (or the DP rank's minibatch;
  for a forward-only role its whole share of the step), fewer when train.max_tokens_per_micro_batch caps rows x S;
  with pp > 1 Megatron cuts equal micro-batches, at least pp of them (pipeline_micro_batches: its
  runtime's rule). What a decoder layer keeps for the
  backward, per token: b * (2H + 6Q + 3KV + 4I) + 8H bytes (Q = heads * head_dim: the norms'
  outputs, q/k/v before and after RoPE, the repeated k/v and the attention output, SwiGLU's four
  I-wide tensors; the RMSNorms' fp32 inputs). In a MoE layer I is k*I_e + I_s (the k experts a
  token is routed to, and the shared one), plus b*(2k+1)*H (the token's k routed copies and the k
  expert outputs before their weighted sum) and 8E (fp32 router logits and probabilities),
  averaged with the dense layers' over the layers. With context parallelism (engine torch) a cp
  rank keeps 1/cp of it and of the response logits, plus the (cp-1)/cp of the keys and values it
  gathers from the others (2*KV*b per token). Q, KV and I are split by tp (KV at most down to one head
  per rank: megatron-core shares a head among tp/kv_heads ranks); a pipeline stage holds
  layers / pp layers for the micro-batches in flight (1F1B: up to pp). train.recompute keeps only
  each layer's input (bH per token, for the micro-batches in flight) plus one layer's
  activations.
- Attention scores (engine megatron only: megatron-core's local DotProductAttention materialises
  them, where torch's sdpa kernels do not): per sequence and layer heads/tp x S x S elements; a
  layer keeps the fp32 softmax output and, when b < 4, its b-byte copy (6 bytes each in bf16,
  4 in fp32), for every kept layer (those of the stage for the micro-batches in flight; one with
  train.recompute), plus one layer's backward (the softmax's fp32 gradients and megatron's score
  buffer: 8 bytes in bf16, 12 in fp32). A forward-only role holds one layer's: what it would keep
  and 8 bytes of raw scores, their fp32 copy and the buffer. This is Korthikanti et al.'s 5as/h
  term, which Megatron's own formula leaves out because it assumes flash attention.
- Logits: rows x R x V / tp (R = job.response_budget(), rollout.max_new_tokens or env.max_tokens: the torch engines compute logits for
  response positions only) in b, their gradient in b, and for one chunk of 16M elements (at
  least one position: rows x V) the fp32 log-softmax, its exp and its gradient (recomputed in the backward); megatron computes
  fp32 logits for all S positions (and their gradient) and keeps three vocab-wide fp32 tensors
  of the response positions'. The critic has one fp32 value per position (and its gradient).
  Forward-only roles (reference) keep the logits and one layer's
  activations of a micro-batch.
- reference: weights bS / tp (/ dp with fsdp or ZeRO-3, plus the units gathered for compute).
- actor_infer: weights b*P / (tp*pp) (none when it samples with the trainer's) plus the KV cache
  of one rollout batch held at once:
  2 (K and V) * ceil(layers/pp) * ceil(kv_heads/tp) * head_dim * b * seqs * seq_len, where
  seqs = ceil(train.prompts_per_step * algorithm.group_size / dp) (the sequences of a step that one
  replica generates concurrently), at most rollout.max_num_seqs, and seq_len =
  model.max_position_embeddings (the context cap: prompt plus response never exceed it). vLLM
  replicates kv heads when tp > kv_heads, hence the ceil. vLLM takes
  `rollout.gpu_memory_utilization` of the device whatever it needs and keeps the KV cache inside
  that pool (preempting sequences when it is full): it holds max(pool, weights).
- reward, env: no model on the device (0).
- Roles sharing a device (device_bytes): the sum of what each holds, but of the working sets
  (activations, attention scores, logits) only the largest: one rank serves its roles' calls one
  after another.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config.job import JobConfig, ModelConfig, Parallel
from hpcrl.config.constants import LOGSOFTMAX_CHUNK_ELEMENTS
from hpcrl.placement.errors import PlacementError

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_VOCAB = 256
TRAINING_ROLES = ("actor_train", "critic")
GENERATION_ROLES = ("actor_infer",)
FORWARD_ROLES = ("reference",)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide parameter count and KV-cache size."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    # mixture of experts (0 experts: dense): `moe_layers` of the layers have experts, the rest a dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: int = 0
    qk_norm: bool = False   # Qwen3's per-head RMSNorm of queries and keys

    @classmethod
    def from_model(cls, model: ModelConfig) -> "ModelShape":
        """From the job's sizes, or from `model.path`/config.json when a path is given."""
        if model.path:
            return cls._from_hf_config(model)
        experts, per_token, width, shared = model.expert_sizes()
        return cls(arch=model.arch, hidden_size=model.hidden_size, num_layers=model.num_layers,
                   num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                   head_dim=model.head_width, intermediate_size=model.intermediate_size,
                   vocab_size=model.vocab_size or DEFAULT_VOCAB, tie_word_embeddings=model.tie_word_embeddings,
                   qkv_bias=model.arch in _QKV_BIAS_ARCHS, qk_norm=model.arch.startswith("qwen3"),
                   max_position_embeddings=model.max_position_embeddings,
                   num_experts=experts, experts_per_token=per_token, expert_intermediate_size=width,
                   shared_expert_intermediate_size=shared, moe_layers=model.num_layers if experts else 0)

    @classmethod
    def _from_hf_config(cls, model: ModelConfig) -> "ModelShape":
        path, config = hf_config(model)
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            model_type = str(config.get("model_type", model.arch))
            # An explicit max_position_embeddings in the job caps the rollout context below the model's.
            context = int(config.get("max_position_embeddings", model.max_position_embeddings))
            if "max_position_embeddings" in model.model_fields_set:
                context = min(context, model.max_position_embeddings)
            layers = int(config["num_hidden_layers"])
            return cls(arch=model_type, hidden_size=hidden, num_layers=layers,
                       num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       intermediate_size=int(config["intermediate_size"]),
                       vocab_size=int(config.get("vocab_size") or model.vocab_size or DEFAULT_VOCAB),
                       tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                       qkv_bias=model_type in _QKV_BIAS_ARCHS or bool(config.get("attention_bias", False)),
                       qk_norm=model_type.startswith("qwen3"), max_position_embeddings=context,
                       **_expert_fields(config, model_type, layers))
        except KeyError as exc:
            raise PlacementError(f"model.path: {path} has no {exc.args[0]!r}; is it a decoder-only LM config?") from None


def hf_config(model: ModelConfig) -> tuple[Path, dict[str, Any]]:
    """`model.path`'s config.json and its fields (a multimodal model's text_config), read without
    transformers so that the plan runs on a login node."""
    path = Path(model.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlacementError(f"model.path: {path} does not exist; give a local Hugging Face model "
                             "directory or drop model.path and give the sizes") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise PlacementError(f"model.path: cannot read {path}: {exc}") from None
    return path, config.get("text_config", config)


_QKV_BIAS_ARCHS = ("qwen2", "qwen2_moe")
# What transformers' MoE configs default to when a config.json leaves a field out
_MOE_DEFAULTS = {
    "qwen2_moe": {"num_local_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "shared_expert_intermediate_size": 5632},
    "qwen3_moe": {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


def _expert_fields(config: dict, model_type: str, layers: int) -> dict[str, int]:
    """ModelShape's MoE fields from a HF config.json (none for a dense model); a field it leaves
    out takes transformers' default for its model type."""
    given = {k: v for k, v in config.items() if v is not None}
    if "num_experts" in given:   # Qwen-MoE's spelling (transformers 4), Mixtral's and transformers 5's below
        given.setdefault("num_local_experts", given["num_experts"])
    config = {**_MOE_DEFAULTS.get(model_type, {}), **given}
    experts = int(config.get("num_local_experts") or 0)
    if not experts:
        return {}
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
    return {"num_experts": experts, "experts_per_token": int(config.get("num_experts_per_tok") or 0),
            "expert_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
            "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0),
            # Qwen-MoE keeps the layers of mlp_only_layers, and those off decoder_sparse_step, dense
            "moe_layers": sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)}


def count_parameters(shape: ModelShape, head: str = "lm") -> int:
    """Parameters of a Qwen2/LLaMA decoder, dense or MoE (router, experts, Qwen2-MoE's gated shared
    expert); head "lm" (vocab projection) or "value" (critic)."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    attention = (h * q + 2 * h * kv + q * h + ((q + 2 * kv) if shape.qkv_bias else 0)
                 + (2 * shape.head_dim if shape.qk_norm else 0))
    dense_mlp = 3 * h * shape.intermediate_size
    shared = 3 * h * shape.shared_expert_intermediate_size + h if shape.shared_expert_intermediate_size else 0
    moe_mlp = h * shape.num_experts + shape.num_experts * 3 * h * shape.expert_intermediate_size + shared
    sparse = min(shape.moe_layers, shape.num_layers)
    layers = sparse * moe_mlp + (shape.num_layers - sparse) * dense_mlp + shape.num_layers * (attention + 2 * h)
    embedding = shape.vocab_size * h
    if head == "value":
        out = h + 1
    elif head == "lm":
        out = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    else:
        raise ValueError(f"head must be 'lm' or 'value', not {head!r}")
    return embedding + layers + h + out


# What a role allocates for one call and frees when it returns
WORKING_PARTS = ("activations", "attention scores", "logits")
TRANSIENT_PARTS = WORKING_PARTS + ("KV cache", "vLLM pool reserve")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device of a role holds while the role is on the device, part by part."""

    params: int
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def gb(self) -> float:
        return self.total / GIB

    def part(self, name: str) -> int:
        return sum(n for key, n in self.parts if key == name)

    @property
    def state(self) -> int:
        """What goes to host memory when the role leaves its device: weights, gradients, optimizer
        state. Activations, logits and vLLM's KV cache and pool are freed, not moved."""
        return self.total - sum(self.part(name) for name in TRANSIENT_PARTS)

    @property
    def working(self) -> int:
        return sum(self.part(name) for name in WORKING_PARTS)

    def describe(self) -> str:
        if not self.params:
            return "0 GB (no model on the device)"
        parts = ", ".join(f"{name} {human_bytes(n)}" for name, n in self.parts if n)
        return f"{human_bytes(self.total)} ({parts}; {human_count(self.params)} params)"


def device_bytes(estimates: Iterable[MemoryEstimate]) -> int:
    """What the roles sharing one device hold at most together: each its state (and vLLM its pool),
    and the largest working set of one call, not their sum: a rank serves its roles' calls one after
    another (runtime/worker.serve), so two of them never compute at once on a device."""
    estimates = list(estimates)
    return sum(e.total - e.working for e in estimates) + max((e.working for e in estimates), default=0)


def human_bytes(nbytes: float) -> str:
    """2**30-based sizes: '14.18 GB', '3.5 MB', '512 B'."""
    for unit, scale in (("GB", GIB), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if nbytes >= scale / 10:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def human_count(n: int) -> str:
    for unit, scale in (("B", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def kv_bytes_per_token(job: JobConfig, shape: ModelShape, parallel: Parallel) -> int:
    """Keys and values of one position on one device of a generation replica."""
    return (2 * math.ceil(shape.num_layers / parallel.pp) * math.ceil(shape.num_kv_heads / parallel.tp)
            * shape.head_dim * DTYPE_BYTES[job.model.dtype])


def kv_cache_bytes(job: JobConfig, shape: ModelShape, parallel: Parallel) -> int:
    """KV cache of the rollout sequences one generation replica holds at once (see the module doc)."""
    per_token = kv_bytes_per_token(job, shape, parallel)
    sequences = math.ceil(job.train.prompts_per_step * job.algorithm.group_size / parallel.dp)
    if job.rollout.max_num_seqs is not None:   # both engines decode at most this many at once
        sequences = min(sequences, job.rollout.max_num_seqs)
    return per_token * sequences * shape.max_position_embeddings


def _vllm_pool(weights: int, kv_cache: int, pool: int) -> list[tuple[str, int]]:
    """vLLM takes its pool (rollout.gpu_memory_utilization of the device) whatever a step needs, and
    keeps the KV cache in what the weights leave of it: a step that needs more waits (vLLM preempts
    sequences and recomputes them), so the role holds max(pool, weights)."""
    room = max(0, pool - weights)
    held = min(kv_cache, room)
    return [("weights", weights), ("KV cache", held), ("vLLM pool reserve", room - held)]


def layer_parameters(shape: ModelShape) -> int:
    return (count_parameters(shape) - count_parameters(ModelShape(**{**shape.__dict__, "num_layers": 0}))) \
        // max(1, shape.num_layers)


def pipeline_micro_batches(samples: int, pp: int, fits: Callable[[int], bool], at_least: int = 1) -> int:
    """How many equal micro-batches a pipeline (pp > 1) cuts `samples` rows into: the fewest, at
    least pp to fill it (or one per sample) and at least `at_least`, that split the rows evenly and
    whose size `fits` (called with the count); one per sample when none does. The plan's estimate
    and the megatron engine's packing (engines/megatron/packing.equal_micro_batches) both cut so."""
    first = max(min(pp, samples), at_least)
    return next((m for m in range(first, samples + 1) if samples % m == 0 and fits(m)), samples)


def micro_batches(job: JobConfig, parallel: Parallel, context: int, training: bool = True) -> tuple[int, int]:
    """(samples per micro-batch, micro-batches) on one DP rank (see the module doc): a training step
    cuts each minibatch, a log-prob pass the rank's whole share of the step; a pipeline cuts equal
    micro-batches, at least pp of them, whatever train.micro_batch_size says."""
    train = job.train
    share = math.ceil(job.train.prompts_per_step * job.algorithm.group_size
                      / (parallel.dp * (train.minibatches if training else 1)))
    if parallel.pp > 1:
        def fits(count: int) -> bool:
            rows, tokens = share // count, train.max_tokens_per_micro_batch
            return ((train.micro_batch_size is None or rows <= train.micro_batch_size)
                    and (tokens is None or rows * context <= tokens))
        count = pipeline_micro_batches(share, parallel.pp, fits)
        return share // count, count
    rows = share
    if train.micro_batch_size is not None:
        rows = min(rows, train.micro_batch_size)
    if train.max_tokens_per_micro_batch is not None:
        rows = min(rows, max(1, train.max_tokens_per_micro_batch // context))
    rows = max(1, rows)
    return rows, math.ceil(share / rows)


def _activation_per_token(shape: ModelShape, b: int, tp: int) -> float:
    """Bytes one decoder layer keeps for the backward, per token (see the module doc)."""
    h, q = shape.hidden_size, shape.num_heads * shape.head_dim
    # with fewer KV heads than tp ranks each rank still holds a whole head (megatron-core shares it)
    kv, i = max(shape.num_kv_heads, tp) * shape.head_dim, shape.intermediate_size
    dense = b * (2 * h + (6 * q + 3 * kv + 4 * i) / tp) + 8 * h
    if not shape.moe_layers:
        return dense
    k = shape.experts_per_token   # a MoE layer: the experts a token is routed to, and their routing
    routed = k * shape.expert_intermediate_size + shape.shared_expert_intermediate_size
    sparse = b * (2 * h + (6 * q + 3 * kv + 4 * routed) / tp + (2 * k + 1) * h) + 8 * h + 8 * shape.num_experts
    share = min(shape.moe_layers, shape.num_layers) / shape.num_layers
    return share * sparse + (1 - share) * dense


def _attention_scores(shape: ModelShape, b: int, tp: int, context: int) -> tuple[int, int, int]:
    """Bytes per sequence of one layer's [heads/tp, S, S] attention scores, which megatron-core's
    local DotProductAttention (the megatron engine's layer spec: no flash attention) materialises:
    (kept for the backward: the fp32 softmax output and, when b < 4, its b-byte copy that probs @ V
    saves; held beside that while the layer's forward runs: the raw scores and megatron's global
    score buffer in b and their fp32 copy, 8 bytes either way; while its backward runs: the
    softmax's fp32 gradients in and out and the buffer, less the copy freed by then)."""
    elements = math.ceil(shape.num_heads / tp) * context * context
    copy = b if b < 4 else 0
    return elements * (4 + copy), elements * 8, elements * (8 + b - copy)


def routed_expert_parameters(shape: ModelShape, layers: int) -> int:
    """The routed experts' parameters in `layers` decoder layers (what expert parallelism splits);
    the share of MoE layers is taken as even over the pipeline stages."""
    share = min(shape.moe_layers, shape.num_layers) / max(1, shape.num_layers)
    return math.ceil(layers * share * shape.num_experts * 3 * shape.hidden_size * shape.expert_intermediate_size)


def stage_parameters(shape: ModelShape, params: int, pp: int, head: str = "lm") -> int:
    """Parameters of the largest pipeline stage: its share of the layers, and the embedding (first
    stage) or the output layer (last stage; with tied embeddings a copy of the embedding)."""
    if pp == 1:
        return params
    end = shape.vocab_size * shape.hidden_size if head == "lm" else shape.hidden_size + 1
    return math.ceil(shape.num_layers / pp) * layer_parameters(shape) + max(end, shape.vocab_size * shape.hidden_size)


def _gathered_units(shape: ModelShape, b: int) -> int:
    """What FSDP2 / ZeRO-3 hold unsharded for compute: two decoder layers and the embedding and head."""
    root = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    return (2 * layer_parameters(shape) + root) * b


def _model_state(role: str, job: JobConfig, params: int, parallel: Parallel, shape: ModelShape
                 ) -> list[tuple[str, int]]:
    """Weights, gradients, master weights and optimizer state in the engine's layout."""
    b = DTYPE_BYTES[job.model.dtype]
    tp, dp = parallel.tp, parallel.dp
    engine = job.engine(role)
    trainable = role in TRAINING_ROLES
    shards = dp * parallel.cp   # FSDP2 shards over the DP x CP ranks (cp > 1 runs on engine torch only)
    sharded = job.zero_stage(role) >= 3 and shards > 1
    stage = stage_parameters(shape, params, parallel.pp, "value" if role == "critic" else "lm")
    gathered = [("gathered units", _gathered_units(shape, b))] if sharded else []
    # megatron splits the routed experts over ep as well (and shards their optimizer state over the
    # expert-DP ranks, dp * cp / ep of them: the same dp share as the dense parameters' with cp = 1)
    experts = routed_expert_parameters(shape, math.ceil(shape.num_layers / parallel.pp)) \
        if engine == "megatron" else 0
    held = stage - experts + experts / parallel.ep
    if not trainable:
        return [("weights", math.ceil(held * b / tp / (shards if sharded else 1)))] + gathered
    if engine == "megatron":
        master = 4 if b < 4 else 0
        return [("weights", math.ceil(held * b / tp)), ("grads", math.ceil(held * 4 / tp)),
                ("master+Adam", math.ceil(stage * (master + 8) / tp / dp))]
    if engine == "deepspeed":   # ZeRO keeps an fp32 master partition whatever the dtype
        zero = job.zero_stage(role)
        stepped = params if zero < 3 else max(2 * layer_parameters(shape), shape.vocab_size * shape.hidden_size)
        return [("weights", math.ceil(params * b / (dp if zero >= 3 else 1))),
                # partitioned (zero >= 2) 16-bit gradients are summed and reduced in fp32 (deepspeed_config)
                ("grads", math.ceil(params * (4 if zero >= 2 else b) / (dp if zero >= 2 else 1))),
                ("master+Adam", math.ceil(params * 12 / (dp if zero >= 1 else 1))),
                ("step transients", math.ceil(stepped * (8 if zero < 3 else 12) / (dp if zero >= 1 else 1)))
                ] + gathered
    # torch: fp32 master weights are the parameters; FSDP2 shards all of it over dp (x cp)
    share = shards if sharded else 1
    parts = [("weights", math.ceil(params * 4 / share)), ("grads", math.ceil(params * 4 / share)),
             ("Adam", math.ceil(params * 8 / share)), ("step transients", math.ceil(params * 8 / share))]
    if not sharded:
        if shards > 1:
            parts.append(("DDP buckets", params * 4))
        if b < 4:
            parts.append(("autocast copies", params * b))
    return parts + gathered


def _activations(role: str, job: JobConfig, shape: ModelShape, parallel: Parallel) -> list[tuple[str, int]]:
    """Activations, attention scores and logits of one micro-batch (training roles: kept for the
    backward, for the micro-batches in flight)."""
    b = DTYPE_BYTES[job.model.dtype]
    context = shape.max_position_embeddings
    rows, count = micro_batches(job, parallel, context, training=role in TRAINING_ROLES)
    in_flight = min(parallel.pp, count)   # 1F1B: stage 0 holds up to pp micro-batches
    tokens = rows * context
    cp = parallel.cp   # a cp rank keeps its share of the positions, and every position's keys and values
    per_token = (_activation_per_token(shape, b, parallel.tp)
                 + 2 * shape.num_kv_heads * shape.head_dim * b * (cp - 1)) / cp
    layers = math.ceil(shape.num_layers / parallel.pp)
    vocab = math.ceil(shape.vocab_size / parallel.tp)
    megatron = job.engine(role) == "megatron"
    kept, forward, backward = _attention_scores(shape, b, parallel.tp, context) if megatron else (0, 0, 0)
    if role not in TRAINING_ROLES:   # one layer at a time
        activations, scores = per_token * tokens, rows * (kept + forward)
    elif job.train.recompute:   # each layer's input, for the micro-batches in flight, and one layer's
        activations = tokens * (layers * b * shape.hidden_size * in_flight + per_token)
        scores = rows * (kept + backward)
    else:
        activations = tokens * layers * per_token * in_flight
        scores = rows * (kept * layers * in_flight + backward)
    response = rows * math.ceil((job.response_budget() + 1) / cp) * vocab
    if role == "critic":   # one fp32 value per position (and its gradient) instead of the vocabulary's logits
        logits = rows * context * 4 * 2
    elif megatron:   # fp32 logits of every position and their gradient; three fp32 tensors of the responses'
        logits = rows * context * vocab * 4 * (2 if role in TRAINING_ROLES else 1) + response * 4 * 3
    else:
        chunk = min(response, max(LOGSOFTMAX_CHUNK_ELEMENTS, rows * vocab))   # at least one position
        if role in TRAINING_ROLES:   # logits and their gradient; the chunk's log-softmax, exp and gradient
            logits = response * 2 * b + chunk * 3 * 4
        else:
            logits = response * b + chunk * 2 * 4
    return [("activations", math.ceil(activations)), ("attention scores", scores), ("logits", math.ceil(logits))]


def estimate_role_memory(role: str, job: JobConfig, shape: ModelShape, parallel: Parallel,
                         device_memory_gb: float | None = None, shared_weights: bool = False) -> MemoryEstimate:
    """Per-device bytes of `role` with `parallel` sizes (the role's footprint while it is resident).
    `device_memory_gb`: the device's size, for vLLM's pool (rollout.gpu_memory_utilization);
    `shared_weights`: rollout samples with the trainer's parameters (counted with the trainer)."""
    if role not in TRAINING_ROLES + GENERATION_ROLES + FORWARD_ROLES:
        return MemoryEstimate(params=0)
    params = count_parameters(shape, head="value" if role == "critic" else "lm")
    if role in GENERATION_ROLES:
        weights = 0 if shared_weights else math.ceil(params * DTYPE_BYTES[job.model.dtype]
                                                     / (parallel.tp * parallel.pp))
        kv_cache = kv_cache_bytes(job, shape, parallel)
        if job.engine(role) == "vllm" and device_memory_gb is not None:
            pool = int(job.rollout.gpu_memory_utilization * device_memory_gb * GIB)
            return MemoryEstimate(params, tuple(_vllm_pool(weights, kv_cache, pool)))
        return MemoryEstimate(params, (("weights", weights), ("KV cache", kv_cache)))
    return MemoryEstimate(params, tuple(_model_state(role, job, params, parallel, shape)
                                        + _activations(role, job, shape, parallel)))
