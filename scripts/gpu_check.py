"""The GPU check of the GPU engines: a few GRPO steps of a tiny Qwen2, megatron (TP=1) training and
vllm rollout on one GPU, with the weight sync between them; before that, the memory check: a ~0.4B
model loaded from safetensors by the torch and megatron engines, their GPU peak against the plan.

Each step: the rollout samples, the trainer recomputes the log-probabilities of the same tokens
(their mean absolute difference must stay under --tolerance nats), trains, stages its weights in
pinned host memory as the runtime does and the rollout loads them bucket by bucket. At the end a
round is cut by a deadline (partial rollout). Prints tokens/s and the stage and load times. Started by scripts/gpu_check.sh; stops
at the first thing that fails, saying what and why; exit status 0 only if every check passed.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import random
import socket
import sys
import time
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def fail(message: str) -> None:
    print(f"gpu_check: FAIL: {message}", flush=True)
    sys.exit(1)


def say(message: str) -> None:
    print(f"gpu_check: {message}", flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rollout", default="auto", choices=["auto", "vllm", "native"],
                        help="auto: vllm if importable, else the native sampler (on the CPU), said loudly")
    parser.add_argument("--tolerance", type=float, default=0.02, help="max mean |logprob difference| in nats")
    parser.add_argument("--memory-tolerance", type=float, default=0.3,
                        help="max relative difference of the plan's memory estimate from the measured GPU peak")
    return parser.parse_args()


def preflight(args: argparse.Namespace) -> str:
    """Everything that can fail before minutes are spent: GPU, packages. Returns the rollout engine."""
    import torch

    if not torch.cuda.is_available():
        fail(f"torch sees no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})")
    say(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for module, hint in (("megatron.core", "run `scripts/gpu_check.sh --prepare` where pip works and carry "
                          "build/gpu_wheels"), ("pydantic", "same: the prepared wheels include it")):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            fail(f"{module} is not importable: {hint}")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if args.rollout == "vllm" and not has_vllm:
        fail("vllm is not importable (it is too large to carry to a machine without a registry; install it "
             "where one is reachable, or run with --rollout native to check the megatron engine alone)")
    rollout = args.rollout if args.rollout != "auto" else ("vllm" if has_vllm else "native")
    if rollout == "native":
        say("NOTE: vllm is not installed here: the rollout is the native sampler on the CPU; "
            "the vllm engine is NOT CHECKED by this run")
    return rollout


def one_rank_world() -> None:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build(args: argparse.Namespace, rollout_kind: str):
    import tempfile

    from hpcrl.config.job import JobConfig
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.hf_model import DTYPES
    from hpcrl.engines.model_files import ModelFiles, load_full, write_random_init
    from hpcrl.engines.megatron.groups import new_role_groups, role_rank_groups
    from hpcrl.engines.registry import generation_engine, training_engine

    job = JobConfig.model_validate({
        "name": "gpu-check", "seed": 1, "task": {"name": "addition", "digits": 1},
        "model": {"arch": "qwen2", "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
                  "intermediate_size": 704, "max_position_embeddings": 128, "tie_word_embeddings": False,
                  "dtype": args.dtype},
        "algorithm": {"name": "grpo", "group_size": args.group},
        "train": {"prompts_per_step": args.prompts, "ppo_epochs": 1, "minibatches": 2, "lr": 1e-3},
        "rollout": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
        "roles": {"actor_train": {"engine": "megatron"}, "actor_infer": {"engine": rollout_kind}},
    })
    tokenizer = CharTokenizer()
    files = ModelFiles(write_random_init(job, tokenizer, Path(tempfile.mkdtemp(prefix="hpcrl-gpu-check-"))))
    started = time.perf_counter()
    groups = new_role_groups(role_rank_groups({"tp": 1}, [0]), 0)
    trainer = training_engine("megatron")(files, job, tokenizer.pad_token_id, groups, "cuda:0")
    say(f"megatron engine built in {time.perf_counter() - started:.1f}s")
    started = time.perf_counter()
    if rollout_kind == "vllm":
        # as in a job: vLLM's engine in its own process (a one-rank world would keep it in this one,
        # where collective_rpc passes arguments untouched), CUDA graphs on
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        rollout = generation_engine("vllm")(files.path, DTYPES[job.model.dtype], tokenizer.stop_token_ids, job.seed,
                                            gpu_memory_utilization=0.3,
                                            max_model_len=job.model.max_position_embeddings)
    else:
        rollout = generation_engine("native")(load_full(files, "float32", "cuda"), tokenizer.stop_token_ids,
                                              tokenizer.pad_token_id)
    say(f"{rollout_kind} engine built in {time.perf_counter() - started:.1f}s")
    return job, tokenizer, trainer, rollout


def mean_gap(a, b) -> float:
    """Mean |difference| of two packed per-token columns."""
    return float(abs(a.values - b.values).mean()) if len(a.values) else 0.0


def run(args: argparse.Namespace, rollout_kind: str) -> None:
    import numpy as np
    import torch

    from hpcrl.algos import grpo_advantages
    from hpcrl.data import addition_prompts
    from hpcrl.engines.digests import weights_digest
    from hpcrl.engines.native_sampler import SamplingParams
    from hpcrl.engines.torch_trainer import Samples
    from hpcrl.ragged import Ragged
    from hpcrl.rewards import score_responses
    from hpcrl.runtime.weight_sync import StagedWeights

    job, tokenizer, trainer, rollout = build(args, rollout_kind)
    params = SamplingParams(job.rollout.max_new_tokens, job.rollout.temperature)
    pool = addition_prompts(1)
    rng = random.Random(0)
    staged = StagedWeights(pin_memory=True)
    for step in range(1, args.steps + 1):
        chosen = rng.sample(pool, args.prompts)
        prompt_ids = Ragged.from_rows([tokenizer.encode(p.text) for p in chosen for _ in range(args.group)], np.int32)
        answers = [p.answer for p in chosen for _ in range(args.group)]

        started = time.perf_counter()
        out = rollout.generate(prompt_ids, params, torch.Generator().manual_seed(step))
        generate_s = time.perf_counter() - started
        responses, behaviour = out.response_ids, out.logprobs
        if (responses.lengths == 0).any() or not out.finished.all():
            fail(f"step {step}: the rollout returned an empty or unfinished response without a deadline")
        if any(tokenizer.eos_token_id in r[:-1] for r in responses):
            fail(f"step {step}: the rollout returned tokens after <eos>")

        started = time.perf_counter()
        old = trainer.logprobs(prompt_ids, responses)
        logprobs_s = time.perf_counter() - started
        gap = mean_gap(old, behaviour)
        if not gap < args.tolerance:
            fail(f"step {step}: trainer and rollout log-probabilities of the same tokens differ by {gap:.4f} nats "
                 f"on average (tolerance {args.tolerance})")

        rewards = score_responses(tokenizer, responses, answers)
        groups = torch.arange(len(rewards)) // args.group
        advantages = grpo_advantages(torch.from_numpy(rewards).float(), groups).numpy()
        samples = Samples(prompt_ids, responses,
                          {"old_logprobs": old, "advantages": old.with_values(np.repeat(advantages, old.lengths))})
        if rollout_kind == "vllm":   # colocated: vLLM sleeps while the trainer trains (level 1 keeps its weights)
            rollout.sleep()
        started = time.perf_counter()
        metrics = trainer.train_step(samples, job.train.lr)
        train_s = time.perf_counter() - started
        if not all(map(lambda v: v == v and abs(v) != float("inf"), metrics.values())):
            fail(f"step {step}: non-finite training metrics {metrics}")
        moved = mean_gap(trainer.logprobs(prompt_ids, responses), old) if step == args.steps else None

        # The sync as the runtime does it on a GPU: stage into pinned host memory, load bucket by bucket.
        started = time.perf_counter()
        staged.stage(trainer.named_weights(), step)
        stage_s = time.perf_counter() - started
        started = time.perf_counter()
        if rollout_kind == "vllm":
            rollout.wake()
        for bucket in staged.named():
            rollout.load_weights(bucket)
        if rollout_kind == "vllm":
            rollout.weights_loaded()
        torch.cuda.synchronize()
        sync_s = time.perf_counter() - started
        if rollout_kind == "native" and weights_digest(rollout.model.named_parameters()) != \
                weights_digest(trainer.named_weights()):
            fail(f"step {step}: the rollout's weights differ from the trainer's after the sync")
        megabytes = sum(b.flat.nbytes for b in staged.buckets) / 2**20
        trained_tokens = int(prompt_ids.lengths.sum() + responses.lengths.sum())
        say(f"step {step}: reward {rewards.mean():.3f}  logprob gap {gap:.4f} nats  "
            f"rollout {len(responses.values) / generate_s:,.0f} tok/s  logprobs {trained_tokens / logprobs_s:,.0f} "
            f"tok/s  train {trained_tokens / train_s:,.0f} tok/s  stage {stage_s * 1e3:.0f} ms  load "
            f"{sync_s * 1e3:.0f} ms ({megabytes:.1f} MiB)  loss {metrics['loss']:+.4f}  "
            f"grad_norm {metrics.get('grad_norm', float('nan')):.3f}")
    say(f"the last step moved the policy by {moved:.4f} nats per token (the sync check above is meaningful "
        f"when this exceeds the tolerance {args.tolerance})")
    deadline = time.monotonic() + 0.05
    cut = rollout.generate(prompt_ids, SamplingParams(job.model.max_position_embeddings - 8, job.rollout.temperature),
                           torch.Generator().manual_seed(0), stop=lambda finished: time.monotonic() > deadline)
    say(f"a round cut after 50 ms: {int((~cut.finished).sum())} of {len(cut.finished)} responses unfinished, "
        f"{len(cut.response_ids.values)} tokens kept (partial rollout)")


def memory_check(args: argparse.Namespace) -> None:
    """Sharded loading and the plan's estimate on the GPU: a ~0.4B Qwen2 (random weights written to
    safetensors, loaded through model.path as a checkpoint is) for the torch engine (fp32 master
    weights under bf16 autocast) and the megatron engine (tp 1). The engine must load straight onto
    the GPU (host memory never holds the whole model twice); the estimate for the job must lie
    within --memory-tolerance of torch.cuda's peak of the second training step."""
    import tempfile

    import numpy as np
    import torch

    from hpcrl.config.job import JobConfig
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.megatron.groups import new_role_groups, role_rank_groups
    from hpcrl.engines.model_files import ModelFiles, write_random_init
    from hpcrl.engines.registry import training_engine
    from hpcrl.engines.torch_trainer import Samples
    from hpcrl.placement.memory import ModelShape, estimate_role_memory
    from hpcrl.ragged import Ragged

    prompt, response, samples = 448, 64, 8
    tokenizer = CharTokenizer()
    rng = np.random.default_rng(0)
    prompts = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, prompt) for _ in range(samples)], np.int32)
    responses = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, response) for _ in range(samples)], np.int32)
    zeros = Ragged.from_rows([np.zeros(response, np.float32) for _ in range(samples)], np.float32)
    batch = Samples(prompts, responses, {"old_logprobs": zeros.with_values(zeros.values - 3.0),
                                         "advantages": zeros.with_values(rng.standard_normal(len(zeros.values))
                                                                          .astype(np.float32))})
    directory = Path(tempfile.mkdtemp(prefix="hpcrl-gpu-memory-"))
    for engine in ("torch", "megatron"):
        job = JobConfig.model_validate({
            "name": "gpu-memory", "seed": 1, "task": {"name": "addition", "digits": 1},
            "model": {"arch": "qwen2", "hidden_size": 1024, "num_layers": 24, "num_heads": 16, "num_kv_heads": 4,
                      "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": prompt + response,
                      "tie_word_embeddings": True, "dtype": "bfloat16"},
            "algorithm": {"name": "grpo", "group_size": 1, "kl_loss": {"coef": 0.0}},
            "train": {"prompts_per_step": samples, "minibatches": 1, "lr": 1e-6, "micro_batch_size": 2},
            "rollout": {"max_new_tokens": response},
            "roles": {"actor_train": {"engine": engine}, "actor_infer": {"engine": "native"}},
        })
        files = ModelFiles(write_random_init(job, tokenizer, directory))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        groups = new_role_groups(role_rank_groups({"tp": 1}, [0]), 0) if engine == "megatron" else None
        trainer = training_engine(engine)(files, job, tokenizer.pad_token_id, groups, "cuda:0")
        loaded = torch.cuda.max_memory_allocated() - base
        trainer.train_step(batch, job.train.lr)          # allocates gradients and optimizer state
        torch.cuda.reset_peak_memory_stats()
        trainer.train_step(batch, job.train.lr)
        peak = torch.cuda.max_memory_allocated() - base
        estimate = estimate_role_memory("actor_train", job, ModelShape.from_model(job.model),
                                        job.roles.actor_train.parallel)
        parts = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in estimate.parts if v)
        say(f"memory {engine}: loaded {loaded / 2**30:.2f} GB, step peak {peak / 2**30:.2f} GB, estimate "
            f"{estimate.total / 2**30:.2f} GB ({parts}): {estimate.total / peak:.2f}x")
        if not abs(estimate.total / peak - 1) <= args.memory_tolerance:
            fail(f"memory {engine}: the plan's estimate is {estimate.total / peak:.2f}x the measured peak "
                 f"(tolerance {args.memory_tolerance:.0%})")
        del trainer


def main() -> None:
    args = parse()
    rollout_kind = preflight(args)
    one_rank_world()
    memory_check(args)
    run(args, rollout_kind)
    checked = "megatron + vllm" if rollout_kind == "vllm" else "megatron only (vllm NOT CHECKED)"
    say(f"PASS: {checked}: {args.steps} GRPO steps, log-probabilities agree within {args.tolerance} nats")


if __name__ == "__main__":
    main()
