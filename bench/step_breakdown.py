"""Where a step of the tiny GRPO job goes: rollout, reward, logprobs, training, weight sync.

Runs `hpcrl run jobs/tiny_grpo.yaml` for real (4 MPI ranks on this machine), skips the first
steps as warm-up, and prints each stage's mean time and share of the step, and the samples/s.

    .venv/bin/python bench/step_breakdown.py [--steps 40] [--warmup 5] [--set KEY=VALUE ...]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import fmean

from hpcrl.metrics import read_metrics

STAGES = ("rollout", "reward", "logprobs", "train", "stage", "sync")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"train.steps={args.steps}", "log.tensorboard=false", "checkpoint.every=0", *args.overrides]
        command = [sys.executable, "-m", "hpcrl", "run", args.job, "--run-dir", run_dir]
        command += [item for o in overrides for item in ("--set", o)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        rows = read_metrics(Path(run_dir) / "metrics.jsonl")[args.warmup:]
    step = fmean(r["time_step_s"] for r in rows)
    print(f"{args.job}: {len(rows)} steps after {args.warmup} warm-up, {step * 1000:.1f} ms per step")
    print(f"{'stage':<10}{'ms/step':>10}{'share':>9}")
    accounted = 0.0
    for stage in STAGES:
        mean = fmean(r[f"time_{stage}_s"] for r in rows)
        accounted += mean
        print(f"{stage:<10}{mean * 1000:>10.1f}{mean / step:>9.1%}")
    print(f"{'other':<10}{(step - accounted) * 1000:>10.1f}{(step - accounted) / step:>9.1%}   (controller: "
          "batching, advantages, metrics)")
    print(f"samples/s: {fmean(r['samples_per_s'] for r in rows):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
