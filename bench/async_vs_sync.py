"""Synchronous (K=0) against asynchronous (K>0) rollout on the tiny job, side by side.

Runs `hpcrl run jobs/tiny_grpo.yaml` in one process tree, with `rollout.max_staleness` 0 and K (2),
once per seed (one run at a time, so that samples/s are measured on an idle machine), and prints
samples/s, generated tokens per second of rollout, the idle fractions of the rollout and training
ranks, and the final reward: the mean reward of the last 10% of the steps, averaged over the seeds.
One RL run is one random trajectory: a single seed, or a 10-step window, says little about a
difference of a few hundredths.

`--long-tail`: jobs/tiny_longtail.yaml (answers of 1 to 64 tokens, long-tailed), K=1, 200 steps,
and a third run first: K=0 with `rollout.batching: lockstep` (every row of a round decodes until the
round's longest ends, as Hugging Face generate does), the baseline of continuous batching. With
partial rollout a K=1 round hands its batch to training as soon as the batch's last response ends,
its free slots start the next batch, and new weights interrupt it (rollout.partial_rollout).
Printed ratios: continuous batching over lock-step (both K=0), and K over K=0.

    .venv/bin/python bench/async_vs_sync.py [--steps 700] [--seeds 1 2 3 4] [--staleness 2] [--set KEY=VALUE ...]
    .venv/bin/python bench/async_vs_sync.py --long-tail [--seeds 1 2]

Eight runs of 2 to 2.5 minutes each on a 2-core machine: about 17 minutes.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import fmean

from tiny_runs import run_job


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default=None, help="default: jobs/tiny_grpo.yaml (--long-tail: jobs/tiny_longtail.yaml)")
    parser.add_argument("--long-tail", action="store_true", help="the long-tailed response lengths variant")
    parser.add_argument("--steps", type=int, default=None, help="default: 700 (--long-tail: 200)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--staleness", type=int, default=None, help="K of the asynchronous runs (default 2; "
                        "--long-tail: 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    args.job = args.job or ("jobs/tiny_longtail.yaml" if args.long_tail else "jobs/tiny_grpo.yaml")
    args.steps = args.steps or (200 if args.long_tail else 700)
    k_async = args.staleness if args.staleness is not None else (1 if args.long_tail else 2)
    variants = {"K=0 (sync)": ["rollout.max_staleness=0"], f"K={k_async} (async)": [f"rollout.max_staleness={k_async}"]}
    if args.long_tail:
        variants = {"K=0 lock-step": ["rollout.max_staleness=0", "rollout.batching=lockstep"], **variants}
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for index, (name, sets) in enumerate(variants.items()):
                per_seed[name].append(run_job(args.job, args.steps, seed, [*sets, *args.overrides],
                                              Path(tmp) / f"v{index}-s{seed}"))
    results = {name: {key: fmean(r[key] for r in runs) for key in runs[0]} for name, runs in per_seed.items()}
    names = list(variants)
    ratios = [("async/sync", names[-1], names[-2])] + ([("sync/lock-step", names[1], names[0])] if args.long_tail else [])
    print(f"{args.job}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))} (means over the seeds)")
    print(f"{'':<15}" + "".join(f"{name:>16}" for name in names) + "".join(f"{label:>16}" for label, _, _ in ratios))
    for key in results[names[0]]:
        cells = "".join(f"{results[name][key]:>16.3f}" for name in names)
        cells += "".join(f"{results[a][key] / results[b][key]:>16.2f}" if results[b][key] else f"{'-':>16}"
                         for _, a, b in ratios)
        print(f"{key:<15}{cells}")
    for name, runs in per_seed.items():
        print(f"final reward per seed, {name}: " + ", ".join(f"{r['final reward']:.3f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
