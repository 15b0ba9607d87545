"""Synchronous (K=0) against asynchronous (K=2) rollout on the tiny job, side by side.

Runs `hpcrl run jobs/tiny_grpo.yaml` in one process tree, with `rollout.max_staleness` 0 and 2,
once per seed (one run at a time, so that samples/s are measured on an idle machine), and prints
samples/s, the idle fractions of the rollout and training ranks, and the final reward: the mean
reward of the last 10% of the steps, averaged over the seeds. One RL run is one random trajectory:
a single seed, or a 10-step window, says little about a difference of a few hundredths.

    .venv/bin/python bench/async_vs_sync.py [--steps 700] [--seeds 1 2 3 4] [--set KEY=VALUE ...]

Eight runs of 2 to 2.5 minutes each on a 2-core machine: about 17 minutes.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import fmean

from tiny_runs import run_job


def run(job: str, staleness: int, steps: int, seed: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    return run_job(job, steps, seed, [f"rollout.max_staleness={staleness}", *overrides], run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    per_seed: dict[int, list[dict[str, float]]] = {0: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for k in per_seed:
                per_seed[k].append(run(args.job, k, args.steps, seed, args.overrides, Path(tmp) / f"k{k}-s{seed}"))
    results = {k: {key: fmean(r[key] for r in runs) for key in runs[0]} for k, runs in per_seed.items()}
    print(f"{args.job}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))} (means over the seeds)")
    print(f"{'':<15}{'K=0 (sync)':>12}{'K=2 (async)':>13}{'ratio':>8}")
    for key in results[0]:
        sync, asyn = results[0][key], results[2][key]
        ratio = f"{asyn / sync:.2f}" if sync else "-"
        print(f"{key:<15}{sync:>12.3f}{asyn:>13.3f}{ratio:>8}")
    for k, runs in per_seed.items():
        print(f"final reward per seed, K={k}: " + ", ".join(f"{r['final reward']:.3f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
