"""Parameter count from the model config and the per-device memory of each role (a static estimate).

GB here means GiB (2**30 bytes), on both sides of the comparison with `device_memory_gb`.

Formulas (P = parameter count, b = bytes per element of `model.dtype`: 4 float32, 2 bfloat16/float16):

- P: embedding V*H; per layer: q H*H (+H bias), k and v H*KV (+KV bias each) with KV = kv_heads *
  head_dim (GQA), o H*H, SwiGLU MLP 3*H*I, two RMSNorms 2*H; final norm H; lm head V*H unless the
  embeddings are tied. qkv biases for arch qwen2 (and for a llama config.json with attention_bias).
  V = model.vocab_size, or 256 (the built-in task tokenizer's order of size) when unset. The critic
  has a value head (H + 1) instead of the lm head.
- training roles (actor_train, critic): 16 B/param over tp*pp: b weights + (16 - b) for gradients
  and Adam (bf16/fp16 mixed precision: 2 weights + 2 grads + 4 fp32 master + 4 m + 4 v; fp32:
  4 + 4 + 4 m + 4 v). Activations are not counted. With engine deepspeed, ZeRO divides by dp the
  optimizer state, 16 - 2b (stage >= 1), the gradients, b (stage >= 2), and the weights (stage 3).
- reference: weights only, b*P / (tp*pp).
- actor_infer: weights b*P / (tp*pp) plus the KV cache of one rollout batch held at once:
  2 (K and V) * ceil(layers/pp) * ceil(kv_heads/tp) * head_dim * b * seqs * seq_len, where
  seqs = ceil(train.prompts_per_step * algorithm.group_size / dp) (the sequences of a step that one
  replica generates concurrently) and seq_len = model.max_position_embeddings (the context cap: prompt
  plus response never exceed it). vLLM replicates kv heads when tp > kv_heads, hence the ceil.
- reward, env: no model on the device (0).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.job import JobConfig, ModelConfig, Parallel
from hpcrl.placement.errors import PlacementError

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAIN_BYTES_PER_PARAM = 16
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

    @classmethod
    def from_model(cls, model: ModelConfig) -> "ModelShape":
        """From the job's sizes, or from `model.path`/config.json when a path is given."""
        if model.path:
            return cls._from_hf_config(model)
        return cls(arch=model.arch, hidden_size=model.hidden_size, num_layers=model.num_layers,
                   num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                   head_dim=model.hidden_size // model.num_heads, intermediate_size=model.intermediate_size,
                   vocab_size=model.vocab_size or DEFAULT_VOCAB, tie_word_embeddings=model.tie_word_embeddings,
                   qkv_bias=model.arch == "qwen2", max_position_embeddings=model.max_position_embeddings)

    @classmethod
    def _from_hf_config(cls, model: ModelConfig) -> "ModelShape":
        path = Path(model.path) / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlacementError(f"model.path: {path} does not exist; give a local Hugging Face model "
                                 "directory or drop model.path and give the sizes") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise PlacementError(f"model.path: cannot read {path}: {exc}") from None
        config = config.get("text_config", config)
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            model_type = str(config.get("model_type", model.arch))
            # An explicit max_position_embeddings in the job caps the rollout context below the model's.
            context = int(config.get("max_position_embeddings", model.max_position_embeddings))
            if "max_position_embeddings" in model.model_fields_set:
                context = min(context, model.max_position_embeddings)
            return cls(arch=model_type, hidden_size=hidden, num_layers=int(config["num_hidden_layers"]),
                       num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       intermediate_size=int(config["intermediate_size"]),
                       vocab_size=int(config.get("vocab_size") or model.vocab_size or DEFAULT_VOCAB),
                       tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                       qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
                       max_position_embeddings=context)
        except KeyError as exc:
            raise PlacementError(f"model.path: {path} has no {exc.args[0]!r}; is it a decoder-only LM config?") from None


def count_parameters(shape: ModelShape, head: str = "lm") -> int:
    """Parameters of a Qwen2/LLaMA decoder; head "lm" (vocab projection) or "value" (critic)."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    q = shape.num_heads * shape.head_dim
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if shape.qkv_bias else 0)
    mlp = 3 * h * shape.intermediate_size
    layer = attention + mlp + 2 * h
    embedding = shape.vocab_size * h
    if head == "value":
        out = h + 1
    elif head == "lm":
        out = 0 if shape.tie_word_embeddings else shape.vocab_size * h
    else:
        raise ValueError(f"head must be 'lm' or 'value', not {head!r}")
    return embedding + shape.num_layers * layer + h + out


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device of a role holds while the role is on the device."""

    params: int
    weights: int = 0
    grads_optimizer: int = 0
    kv_cache: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads_optimizer + self.kv_cache

    @property
    def gb(self) -> float:
        return self.total / GIB

    def describe(self) -> str:
        if not self.params:
            return "0 GB (no model on the device)"
        parts = [f"weights {human_bytes(self.weights)}"]
        if self.grads_optimizer:
            parts.append(f"grads+Adam {human_bytes(self.grads_optimizer)}")
        if self.kv_cache:
            parts.append(f"KV cache {human_bytes(self.kv_cache)}")
        return f"{human_bytes(self.total)} ({', '.join(parts)}; {human_count(self.params)} params)"


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


def kv_cache_bytes(job: JobConfig, shape: ModelShape, parallel: Parallel) -> int:
    """KV cache of the rollout sequences one generation replica holds at once (see the module doc)."""
    per_token = (2 * math.ceil(shape.num_layers / parallel.pp) * math.ceil(shape.num_kv_heads / parallel.tp)
                 * shape.head_dim * DTYPE_BYTES[job.model.dtype])
    sequences = math.ceil(job.train.prompts_per_step * job.algorithm.group_size / parallel.dp)
    return per_token * sequences * shape.max_position_embeddings


def estimate_role_memory(role: str, job: JobConfig, shape: ModelShape, parallel: Parallel) -> MemoryEstimate:
    """Per-device bytes of `role` with `parallel` sizes (the role's footprint while it is resident)."""
    if role not in TRAINING_ROLES + GENERATION_ROLES + FORWARD_ROLES:
        return MemoryEstimate(params=0)
    params = count_parameters(shape, head="value" if role == "critic" else "lm")
    shards = parallel.tp * parallel.pp
    b = DTYPE_BYTES[job.model.dtype]
    zero = job.zero_stage(role)
    weights = math.ceil(params * b / shards / (parallel.dp if zero >= 3 else 1))
    if role in TRAINING_ROLES:
        grads = params * b / (parallel.dp if zero >= 2 else 1)
        optimizer = params * (TRAIN_BYTES_PER_PARAM - 2 * b) / (parallel.dp if zero >= 1 else 1)
        return MemoryEstimate(params, weights, math.ceil((grads + optimizer) / shards))
    if role in GENERATION_ROLES:
        return MemoryEstimate(params, weights, kv_cache=kv_cache_bytes(job, shape, parallel))
    return MemoryEstimate(params, weights)
