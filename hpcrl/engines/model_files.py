"""The policy's weights on disk: a Hugging Face directory (config.json + safetensors) every engine loads from.

One source for every engine and every rank: a real checkpoint (`model.path`) or, for a job with
random weights, the seeded model written once by the first worker rank (`write_random_init`). Readers
take only what they keep: a whole tensor, or a slice of it (safetensors' `get_slice` reads just
those bytes), so a rank that holds a shard never materialises the full model.
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from hpcrl.config.job import JobConfig, ModelConfig
from hpcrl.engines.expert_layout import FUSED_EXPERTS, HUB_PARTS, hub_tensors
from hpcrl.engines.hf_model import DTYPES, random_model

INIT_DIR = "model-init"
_INIT_STAMP = "hpcrl-init.json"
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
VALUE_HEAD = ("score.weight", "score.bias")   # a critic's head (transformers' *ForTokenClassification, one label)


@dataclass
class ModelFiles:
    """A local HF model directory, read tensor by tensor (safe to share between engines on a rank)."""

    path: Path
    _where: dict[str, Path] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: self.path / file for name, file in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path}: no *.safetensors files (a Hugging Face model directory "
                                        "saved with safetensors is needed)")
            for file in files:
                with safe_open(file, framework="pt") as handle:
                    self._where.update({name: file for name in handle.keys()})

    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, local_files_only=True)

    def names(self) -> list[str]:
        return list(self._where)

    def _hub_experts(self, name: str) -> list[list[str]] | None:
        """The per-expert tensors a hub checkpoint stores for transformers' fused expert tensor `name`
        (`...mlp.experts.gate_up_proj`: each expert's gate and up rows, stacked over experts;
        `...down_proj`: each expert's down projection), as transformers' conversion mapping merges
        them on load: Qwen-MoE's `mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral's
        `block_sparse_moe.experts.E.{w1,w3,w2}.weight`. None when `name` is not one of them."""
        match = FUSED_EXPERTS.fullmatch(name)
        if match is None:
            return None
        layer, fused = match.groups()
        for module, parts in HUB_PARTS.items():
            experts: list[list[str]] = []
            while (names := [f"{layer}.{module}.experts.{len(experts)}.{part}.weight" for part in parts[fused]]
                   )[0] in self._where:
                experts.append(names)
            if experts:
                return experts
        return None

    def _file_of(self, name: str) -> tuple[Path, str]:
        """Where `name` is stored: a tied lm_head is the embedding (HF does not save it twice)."""
        if name not in self._where and name == _HEAD:
            name = _EMBED
        if name not in self._where and (mixtral := name.replace(".mlp.", ".block_sparse_moe.")) in self._where:
            name = mixtral   # Mixtral's hub name for its MoE block (the router)
        if name not in self._where:
            raise KeyError(f"{self.path}: no tensor {name!r} in the safetensors files")
        return self._where[name], name

    def _new_value_head(self, name: str) -> bool:
        """A critic built from a policy's files: its value head is not in them and starts at 0."""
        return name in VALUE_HEAD and name not in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, from the file's header (no data read)."""
        if self._new_value_head(name):
            return (1, self.config().hidden_size) if name.endswith("weight") else (1,)
        experts = None if name in self._where else self._hub_experts(name)
        if experts is not None:   # stacked over experts, the parts of each concatenated by rows
            rows, columns = zip(*(self.shape(part) for part in experts[0]))
            return (len(experts), sum(rows), columns[0])
        file, stored = self._file_of(name)
        with safe_open(file, framework="pt") as handle:
            return tuple(handle.get_slice(stored).get_shape())

    def numel(self, prefix: str = "") -> int:
        """Elements of the stored tensors whose names start with `prefix` (all by default)."""
        return sum(math.prod(self.shape(name)) for name in self._where if name.startswith(prefix))

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name`, or only its rows/columns [start, stop) along `dim` (0 or 1), cast to `dtype`.
        A critic's value head that the files lack reads as zeros: every value starts at 0."""
        if self._new_value_head(name):
            whole = torch.zeros(self.shape(name), dtype=dtype or torch.float32)
            return whole if dim is None else whole.narrow(dim, start, (stop or whole.shape[dim]) - start)
        experts = None if name in self._where else self._hub_experts(name)
        if experts is not None:   # rows along dim 0 are experts: only those are read
            if dim not in (None, 0):
                raise ValueError(f"{self.path}: {name} is stored per expert; it is read by experts (dim 0) only")
            chosen = experts[start:stop] if dim == 0 else experts
            return torch.stack([torch.cat([self.read(part, dtype=dtype) for part in parts]) for parts in chosen])
        file, stored = self._file_of(name)
        with safe_open(file, framework="pt") as handle:
            if dim is None:
                tensor = handle.get_tensor(stored)
            else:
                piece = handle.get_slice(stored)
                tensor = piece[start:stop] if dim == 0 else piece[:, start:stop]
        return tensor if dtype is None else tensor.to(dtype)

    def read_flat(self, name: str, start: int, count: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Elements [start, start + count) of tensor `name` flattened in row-major order (a ZeRO-3
        partition), reading only the rows that hold them."""
        shape = self.shape(name)
        row = math.prod(shape[1:])
        first, last = start // row, -(-(start + count) // row)
        return self.read(name, 0, first, last, dtype).reshape(-1)[start - first * row:start - first * row + count]


def model_dir(job: JobConfig, run_dir: Path) -> Path:
    """Where this job's initial weights are: `model.path`, or the run's random init."""
    return Path(job.model.path) if job.model.path else Path(run_dir) / INIT_DIR


def _stamp(model: ModelConfig, seed: int, tokenizer) -> dict:
    """What decides the random weights: a directory with another stamp is rewritten."""
    ids = {k: getattr(tokenizer, k, None) for k in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id")}
    return {"seed": seed, "model": model.model_dump(mode="json"), "tokenizer": ids}


def write_random_init(job: JobConfig, tokenizer, run_dir: Path) -> Path:
    """The job's seeded random model as a HF directory under the run dir, written once (by the
    first worker rank, before any rank builds an engine) and kept for the run's restarts. Atomic: a
    directory with a matching stamp is complete; anything else is replaced."""
    target = Path(run_dir) / INIT_DIR
    stamp = _stamp(job.model, job.seed, tokenizer)
    stamp_file = target / _INIT_STAMP
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return target
    for leftover in target.parent.glob(f"{INIT_DIR}.partial-*"):   # an earlier attempt that died while writing
        shutil.rmtree(leftover, ignore_errors=True)
    partial = target.with_name(f"{INIT_DIR}.partial-{os.getpid()}")
    save_model(random_model(job.model, tokenizer, job.seed), partial)
    (partial / _INIT_STAMP).write_text(json.dumps(stamp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)
    return target


def save_model(model: torch.nn.Module, path: Path) -> Path:
    """`model` as a HF directory (see `write_model`; a tied head is stored once, as HF stores it)."""
    return write_model(model.config, type(model).__name__, model.named_parameters(), path)


SHARD_BYTES = 5 * 2**30   # transformers' default max_shard_size


def write_model(config, architecture: str, named: Iterable[tuple[str, torch.Tensor]], path: Path,
                shard_bytes: int = SHARD_BYTES) -> Path:
    """A HF directory that every engine, vLLM and transformers can load, written tensor by tensor
    as `named` yields them (transformers' names; experts go one tensor each, as the hub stores
    them): config.json and safetensors files of at most `shard_bytes` (a larger tensor alone),
    model.safetensors when one is enough, else model-0000i-of-0000n.safetensors and their index.
    Host memory holds one file's tensors at a time: a 70B model is never whole in it."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.architectures = [architecture]   # vLLM picks its model class by this
    config.save_pretrained(path)
    where: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    sizes: list[int] = []   # bytes of each file written
    held = 0

    def flush() -> None:
        save_file(shard, path / f"shard-{len(sizes)}.partial", metadata={"format": "pt"})
        sizes.append(held)
        where.update(dict.fromkeys(shard, len(sizes) - 1))
        shard.clear()

    for name, tensor in hub_tensors(named, config.model_type):
        if shard and held + tensor.nbytes > shard_bytes:
            flush()
            held = 0
        shard[name] = tensor.detach().contiguous()
        held += tensor.nbytes
    if shard or not sizes:
        flush()
    names = (["model.safetensors"] if len(sizes) == 1
             else [f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors" for i in range(len(sizes))])
    for i, name in enumerate(names):
        os.replace(path / f"shard-{i}.partial", path / name)
    if len(sizes) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": {n: names[i] for n, i in where.items()}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


@torch.no_grad()
def load_full(files: ModelFiles, dtype: torch.dtype | str, device: torch.device | str = "cpu",
              value_head: bool = False) -> torch.nn.Module:
    """The whole HF model in `dtype` on `device`: for a rank that keeps all of it (a DDP replica,
    a native sampler, a reference without FSDP). Allocated once on `device`, then filled tensor by
    tensor: no second copy in host memory. `value_head`: the critic (see `model_from_config`)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    model = empty_model(files, dtype, value_head)
    model.to_empty(device=device)
    model.tie_weights()   # to_empty gives every module a new tensor: tie the head to the embedding again
    init_buffers(model)
    for name, param in model.named_parameters():
        param.copy_(files.read(name, dtype=dtype))
    return model


def empty_model(files: ModelFiles, dtype: torch.dtype, value_head: bool = False) -> torch.nn.Module:
    """The HF model on the meta device (no storage): to be sharded, then filled by its shards."""
    with torch.device("meta"):
        return model_from_config(files.config(), dtype, value_head)


def model_from_config(config, dtype: torch.dtype, value_head: bool = False) -> torch.nn.Module:
    """The policy (a causal LM) or, with `value_head`, the critic: the same decoder with a linear
    head to one value per position instead of the vocabulary (transformers' *ForTokenClassification
    with one label, as verl builds its critic; dropout off, so that values are deterministic)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    if not value_head:
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    config = copy.deepcopy(config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    return AutoModelForTokenClassification.from_config(config, dtype=dtype)


@torch.no_grad()
def init_buffers(model: torch.nn.Module) -> None:
    """Recompute the non-persistent buffers (rotary `inv_freq`) that `to_empty` left uninitialised:
    they are not in the checkpoint, HF computes them in the constructor."""
    for module in model.modules():
        if any(True for _ in module.buffers(recurse=False)) and not any(True for _ in module.parameters(recurse=False)):
            model._init_weights(module)
