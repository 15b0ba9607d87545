"""The train/infer log-prob gap of a mixture-of-experts model, with and without router replay.

The native sampler generates (bf16 weights, KV cache, continuous batching: what the rollout role
runs) and records each position's experts; the torch engine (fp32 master weights, bf16 autocast:
what the actor_train role runs) recomputes the log-probs of the same tokens with its own routing,
then replaying the recorded one (algorithm.router_replay). Printed: the gap |trainer - rollout| over
the response tokens (mean, 99th percentile, max), the share of routings (position x layer) where the
trainer's own router picks other experts than rollout's (what replay corrects), and what recording
costs the sampler. With random weights a router's logits are near-uniform, so flips are far more
frequent than in a trained model; the figure to read is the gap each flip opens and replay closes.

Last, the routing's size beside the other per-token columns the controller moves per step, for
the job in --job (positions x layers x top-k bytes per sample) against what the plan's shapes give.

    .venv/bin/python bench/router_replay.py [--layers 8 --hidden 256 --experts 16 --top-k 4 --prompts 48]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--job", default=os.path.join(REPO, "jobs", "qwen3-30b-a3b-grpo.yaml"))
    return parser.parse_args()


def replayed_with_flips(trainer, prompts, responses, routing) -> tuple:
    """The trainer's log-probs replaying `routing`, and per routing (position x layer with a record)
    whether the trainer's own router would have picked other experts (seen before the replay hook)."""
    from hpcrl.engines import router_replay

    flips = []

    def compare(index, router, inputs, output):
        replayed = trainer._replay[:, index]
        recorded = replayed[:, 0] >= 0
        flips.append((output[2][recorded].sort(-1).values != replayed[recorded].sort(-1).values).any(-1))

    hooks = [router.register_forward_hook(lambda m, i, o, index=index: compare(index, m, i, o), prepend=True)
             for index, router in enumerate(router_replay.routers(trainer.module))]
    replayed = trainer.logprobs(prompts, responses, routing)
    for hook in hooks:
        hook.remove()
    return replayed, torch.cat(flips)


def gap_row(name: str, trainer_logprobs, rollout_logprobs) -> str:
    gap = np.abs(trainer_logprobs.values - rollout_logprobs.values)
    return f"{name:<22} {gap.mean():>10.2e} {np.quantile(gap, 0.99):>10.2e} {gap.max():>10.2e}"


def main() -> None:
    args = parse()
    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines import router_replay
    from hpcrl.engines.model_files import ModelFiles, load_full, write_random_init
    from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
    from hpcrl.engines.torch_trainer import TorchTrainer
    from hpcrl.ragged import Ragged

    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    heads = max(1, args.hidden // 32)
    job = load_job(os.path.join(REPO, "jobs", "tiny_grpo.yaml"), [
        "model.arch=qwen3_moe", f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
        f"model.num_heads={heads}", f"model.num_kv_heads={max(1, heads // 2)}", f"model.num_experts={args.experts}",
        f"model.experts_per_token={args.top_k}", f"model.moe_intermediate_size={args.hidden}",
        f"model.intermediate_size={2 * args.hidden}", f"model.dtype={args.dtype}", "algorithm.router_replay=true"])
    files = ModelFiles(write_random_init(job, tokenizer, Path(tempfile.mkdtemp(prefix="hpcrl-replay-"))))
    rng = np.random.default_rng(0)
    prompts = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, n) for n in rng.integers(8, 32, args.prompts)],
                               np.int32)
    model = load_full(files, job.model.dtype)
    params = SamplingParams(args.max_new)
    timings = {}
    NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id).generate(   # warm-up
        prompts.slice(0, 4), params, torch.Generator().manual_seed(0))
    for record in (False, True):
        sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id, max_seqs=16,
                                record_routing=record)
        started = time.perf_counter()
        out = sampler.generate(prompts, params, torch.Generator().manual_seed(1))
        timings[record] = out.response_ids.lengths.sum() / (time.perf_counter() - started)
    trainer = TorchTrainer(files, job, tokenizer.pad_token_id, None)
    plain = trainer.logprobs(prompts, out.response_ids)
    replayed, flips = replayed_with_flips(trainer, prompts, out.response_ids, out.routed_experts)
    layers, k = len(router_replay.routers(model)), args.top_k
    print(f"qwen3_moe {args.layers} layers x {args.experts} experts (top-{args.top_k}), hidden {args.hidden}, "
          f"{args.dtype}; {len(prompts)} prompts, {int(out.response_ids.lengths.sum())} generated tokens")
    print(f"routings (position x layer) where the trainer's own router picks other experts: "
          f"{float(flips.float().mean()):.2%} of {flips.numel()}")
    print(f"{'|trainer - rollout|':<22} {'mean':>10} {'p99':>10} {'max':>10}")
    print(gap_row("own routing", plain, out.logprobs))
    print(gap_row("router replay", replayed, out.logprobs))
    plain_gap, replay_gap = (np.abs(x.values - out.logprobs.values) for x in (plain, replayed))
    print(f"replay / own: mean {replay_gap.mean() / plain_gap.mean():.2f}x, max {replay_gap.max() / plain_gap.max():.2f}x")
    print(f"sampler tokens/s: {timings[False]:.0f} without recording, {timings[True]:.0f} recording "
          f"({timings[True] / timings[False]:.2f}x)")
    sizes(load_job(args.job), out.routed_experts, prompts, out.response_ids, layers, k)


def sizes(job, routing, prompts, responses, layers: int, top_k: int) -> None:
    """The routing's bytes: measured per position here against positions x layers x k, and per
    step of `job` beside the other per-token columns at its longest samples."""
    from hpcrl.engines.router_replay import index_dtype
    from hpcrl.placement.memory import human_bytes

    positions = int((prompts.lengths + responses.lengths - 1).sum())
    print(f"measured: {routing.values.nbytes} B of routing for {positions} positions = "
          f"{routing.values.nbytes / positions:.0f} B per position; predicted layers x top-k = {layers * top_k} B")
    model = job.model
    width = np.dtype(index_dtype(model.num_experts)).itemsize * model.num_layers * model.experts_per_token
    samples = job.train.prompts_per_step * job.algorithm.group_size
    tokens = samples * model.max_position_embeddings   # prompt + response at the rollout context
    columns = samples * job.rollout.max_new_tokens * (4 + 4 + 4 + 4)   # ids, behaviour, old log-probs, advantages
    print(f"{job.name}: {samples} samples x {model.max_position_embeddings} positions x "
          f"{model.num_layers} layers x top-{model.experts_per_token} = {human_bytes(tokens * width)} of routing per "
          f"step, beside {human_bytes(columns)} of per-token response columns ({tokens * width / columns:.0f}x)")


if __name__ == "__main__":
    main()
