"""A run's trained policy as a Hugging Face model directory (`hpcrl export`), from any engine's checkpoint.

One process, no MPI, no GPU: each engine's files are read as they were written.
- torch (DDP or FSDP2): DCP shards, loaded whole into the HF model (any DP size wrote them);
- deepspeed (ZeRO 1-3): DeepSpeed's own fp32 reconstruction of the partitions (`zero_to_fp32`);
- megatron: one file per (TP, EP, PP) coordinate; TP shards merged, experts of every EP rank renumbered
  to their global numbers, layers renumbered per stage and
  converted to HF names by the same functions the weight sync uses (engines/resharding.py).
The weights are written in the job's dtype, as the trainer hands them to rollout, so the export's
digest is the trainer's (`log.check_weights`). The directory holds what transformers and vLLM
load: config.json, model.safetensors (5 GB shards and their index for a larger model), the tokenizer
(the character tokenizer as a tokenizer.json)
and generation_config.json with the job's sampling settings.
"""
from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from hpcrl.config.job import JobConfig
from hpcrl.engines.hf_model import DTYPES
from hpcrl.engines.model_files import ModelFiles, empty_model, load_full, model_dir, write_model

Named = tuple[str, torch.Tensor]


def _torch_weights(files: ModelFiles, state: Path) -> Iterator[Named]:
    from hpcrl.checkpoint.model_state import load_train_state

    model = load_full(files, torch.float32)   # the masters are fp32 whatever the compute dtype
    load_train_state(model, None, state)
    yield from model.named_parameters()


def _deepspeed_weights(state: Path) -> Iterator[Named]:
    """Each parameter put together from the ZeRO partitions as it is asked for (lazy_mode)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for name, lazy in get_fp32_state_dict_from_zero_checkpoint(str(state), tag="state", lazy_mode=True).items():
        yield name, lazy.contiguous()


def _megatron_weights(files: ModelFiles, state: Path) -> Iterator[Named]:
    """Each stage's shards merged over TP, and with ep > 1 the experts of every EP rank renumbered
    to their global numbers (dense parameters from EP rank 0: the others hold the same)."""
    from hpcrl.engines.resharding import GPTShape, expert_offset, hf_tensors, is_expert, merge_tp

    shape = GPTShape.from_hf(files.config())
    shards: dict[tuple[int, int], dict[int, Path]] = {}   # (pp, ep) -> tp -> file
    for path in state.glob("tp*_pp*.pt"):
        match = _MEGATRON_FILE.fullmatch(path.name)
        if match is not None:
            tp, ep, pp = (int(g or 0) for g in match.groups())
            shards.setdefault((pp, ep), {})[tp] = path
    if not shards:
        raise FileNotFoundError(f"{state}: no Megatron state files (tpXX_ppYYY.pt, tpXX_epZZ_ppYYY.pt)")
    stages = sorted({pp for pp, _ in shards})
    for pp_rank in stages:
        ep_ranks = sorted(ep for pp, ep in shards if pp == pp_rank)
        merged: list[Named] = []
        for ep_rank in ep_ranks:
            models = [torch.load(shards[pp_rank, ep_rank][tp], map_location="cpu", weights_only=False,
                                 mmap=True)["model"]   # the optimizer state beside it stays on disk
                      for tp in sorted(shards[pp_rank, ep_rank])]
            names = [n for n in models[0] if not n.endswith("_extra_state") and (ep_rank == 0 or is_expert(n))]
            per_rank = shape.num_experts // len(ep_ranks)
            merged += [(expert_offset(name, ep_rank * per_rank), merge_tp(name, [m[name] for m in models]))
                       for name in names]
        yield from hf_tensors(merged, shape, len(stages), pp_rank)


_MEGATRON_FILE = re.compile(r"tp(\d+)(?:_ep(\d+))?_pp(\d+)\.pt")


def trained_weights(job: JobConfig, files: ModelFiles, checkpoint: Path) -> Iterator[Named]:
    """The actor's weights in `checkpoint` under HF names (the engine's own precision)."""
    state = checkpoint / "actor_train"
    engine = job.engine("actor_train")
    if engine == "torch":
        return _torch_weights(files, state)
    if engine == "deepspeed":
        return _deepspeed_weights(state)
    return _megatron_weights(files, state)


def export_policy(job: JobConfig, run_dir: Path, checkpoint: Path, tokenizer, out: Path) -> Path:
    """Write the policy of `checkpoint` to `out` as a HF model directory; returns `out`. Tensor by
    tensor, in the job's dtype: host memory holds what the engine's reader needs and one output
    file (model_files.write_model), not the whole model. Written beside `out`, which it replaces
    only once complete."""
    files = ModelFiles(model_dir(job, run_dir))
    skeleton = empty_model(files, DTYPES[job.model.dtype])   # the names and shapes, no storage
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    fitted = _fitted(trained_weights(job, files, checkpoint), skeleton,
                     f"{checkpoint}: the checkpoint does not fit the model of {files.path}")
    try:
        write_model(skeleton.config, type(skeleton).__name__, fitted, partial)
        _save_tokenizer(tokenizer, partial)
        _generation_config(job, tokenizer).save_pretrained(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return out


def _fitted(weights: Iterator[Named], skeleton: torch.nn.Module, problem: str) -> Iterator[Named]:
    """`weights` in the model's dtype, checked against its parameters (a tied head is the
    embedding, stored once): every one exactly once, with its shape."""
    expected = {name: param for name, param in skeleton.named_parameters()}
    tied = skeleton.config.tie_word_embeddings
    seen, unexpected = set(), []
    for name, tensor in weights:
        if name == "lm_head.weight" and tied:
            continue
        param = expected.get(name)
        if param is None or param.shape != tensor.shape or name in seen:
            unexpected.append(f"{name} {tuple(tensor.shape)}")
            continue
        seen.add(name)
        yield name, tensor.to(param.dtype)
    missing = sorted(expected.keys() - seen)
    if missing or unexpected:
        raise RuntimeError(f"{problem}: missing {missing}, unexpected or misshapen {unexpected}")


def _save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.to_hf().save_pretrained(out)


def _generation_config(job: JobConfig, tokenizer):
    """The job's sampling and stop tokens, so that `generate` and vLLM sample as rollout did by
    default. top_k 0 is written as 0, which both read as no top-k: left out (None), transformers'
    `generate` fills in its default of 50."""
    from transformers import GenerationConfig

    rollout = job.rollout
    return GenerationConfig(do_sample=True, temperature=rollout.temperature, top_p=rollout.top_p,
                            top_k=rollout.top_k, max_new_tokens=rollout.max_new_tokens,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=list(tokenizer.stop_token_ids),
                            pad_token_id=tokenizer.pad_token_id)
