"""Synchronous (K=0) against asynchronous (K=2) rollout on the tiny job, side by side.

Runs `hpcrl run jobs/tiny_grpo.yaml` twice in one process tree, with `rollout.max_staleness` 0
and 2, and prints samples/s, the idle fractions of the rollout and training ranks, and the final
reward (mean of the last 10 steps) of each.

    .venv/bin/python bench/async_vs_sync.py [--steps 600] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

from hpcrl.metrics import read_metrics


def run(job: str, staleness: int, steps: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    sets = [f"train.steps={steps}", f"rollout.max_staleness={staleness}", "log.tensorboard=false",
            "checkpoint.every=0", *overrides]
    command = [sys.executable, "-m", "hpcrl", "run", job, "--run-dir", str(run_dir)]
    command += [x for s in sets for x in ("--set", s)]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = read_metrics(run_dir / "metrics.jsonl")
    steady = rows[min(5, len(rows) - 1):]
    return {
        "samples/s": sum(r["samples"] for r in steady) / sum(r["time_step_s"] for r in steady),
        "rollout idle": fmean(r["rollout_idle_frac"] for r in steady),
        "train idle": fmean(r["train_idle_frac"] for r in steady),
        "final reward": fmean(r["reward_mean"] for r in rows[-10:]),
        "max staleness": max(r["staleness_max"] for r in rows),
        "wall s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {k: run(args.job, k, args.steps, args.overrides, Path(tmp) / f"k{k}") for k in (0, 2)}
    print(f"{args.job}, {args.steps} steps")
    print(f"{'':<15}{'K=0 (sync)':>12}{'K=2 (async)':>13}{'ratio':>8}")
    for key in results[0]:
        sync, asyn = results[0][key], results[2][key]
        ratio = f"{asyn / sync:.2f}" if sync else "-"
        print(f"{key:<15}{sync:>12.3f}{asyn:>13.3f}{ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
