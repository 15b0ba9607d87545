"""Continuous batching in the native sampler against lock-step rounds, on long-tailed response lengths.

Every prompt gets a response budget drawn from a long-tailed distribution (Pareto, capped at
--max-len tokens) and no <eos> ends a row early, so each response has exactly its budget's length.
Continuous batching: rows leave the batch as they finish (and, with --slots, waiting prompts take
their places). Lock-step, as the sampler decoded before: every row of a round runs until the
longest is done; it is the same engine given the longest budget for every row, keeping only each
row's own budget of tokens. Printed: useful tokens/s of both and the ratio.

    .venv/bin/python bench/continuous_batching.py [--prompts 256] [--slots 64] [--max-len 64] [--hidden 256]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.engines.hf_model import random_model
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.ragged import Ragged


def long_tailed(count: int, max_len: int, rng: np.random.Generator) -> np.ndarray:
    """Response lengths: mostly short, a few up to `max_len` (Pareto, shape 1.2, minimum 2)."""
    return np.minimum(max_len, np.ceil(2 * (1 + rng.pareto(1.2, count)))).astype(np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--slots", type=int, default=None, help="rollout.max_num_seqs (default: every prompt)")
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = CharTokenizer()
    job = load_job("jobs/tiny_grpo.yaml", [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                                           f"model.intermediate_size={args.hidden * 2}",
                                           f"model.max_position_embeddings={args.max_len + 16}"])
    model = random_model(job.model, tokenizer, seed=1)
    rng = np.random.default_rng(0)
    prompts = Ragged.from_rows([tokenizer.encode(f"{a}+{b}=") for a, b in rng.integers(0, 100, (args.prompts, 2))],
                               np.int32)
    budgets = long_tailed(args.prompts, args.max_len, rng)
    sampler = NativeSampler(model, (), tokenizer.pad_token_id, max_seqs=args.slots)   # -1: no <eos>
    params = SamplingParams(args.max_len)
    useful = int(budgets.sum())

    def best_of(budget_rows: np.ndarray) -> float:
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            sampler.generate(prompts, params, torch.Generator().manual_seed(0), budgets=budget_rows)
            times.append(time.perf_counter() - started)
        return min(times)

    continuous = best_of(budgets)
    lockstep = best_of(np.full(args.prompts, budgets.max()))
    print(f"{args.prompts} prompts, response lengths mean {budgets.mean():.1f}, median {np.median(budgets):.0f}, "
          f"max {budgets.max()} (Pareto tail); {args.slots or args.prompts} sequences at once; "
          f"Qwen2 hidden {args.hidden} x {args.layers} layers, best of {args.repeats}")
    print(f"lock-step rounds:    {useful / lockstep:8.0f} useful tokens/s ({lockstep:.2f} s)")
    print(f"continuous batching: {useful / continuous:8.0f} useful tokens/s ({continuous:.2f} s)")
    print(f"ratio {lockstep / continuous:.2f}x")


if __name__ == "__main__":
    main()
