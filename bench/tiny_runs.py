"""One `hpcrl run` of a job with overrides, summarised: the helper the comparison benches share."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean

from hpcrl.metrics import read_metrics


def run_job(job: str, steps: int, seed: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    """Train `job` for `steps` at `seed` (no checkpoints, no TensorBoard) and return samples/s and the
    idle fractions over the steps after the first five, and the final reward: the mean reward of the
    last 10% of the steps (at least 10). One RL run is one random trajectory: a single seed, or a
    10-step window, says little about a difference of a few hundredths."""
    sets = [f"train.steps={steps}", f"seed={seed}", "log.tensorboard=false", "checkpoint.every=0", *overrides]
    command = [sys.executable, "-m", "hpcrl", "run", job, "--run-dir", str(run_dir)]
    command += [x for s in sets for x in ("--set", s)]
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    rows = read_metrics(run_dir / "metrics.jsonl")
    steady = rows[min(5, len(rows) - 1):]
    return {
        "samples/s": sum(r["samples"] for r in steady) / sum(r["time_step_s"] for r in steady),
        # tokens of the trained responses per second of rollout busy time (generation rounds in flight)
        "gen tokens/s": sum(r["samples"] * r["response_len"] for r in steady)
                         / sum(r["time_rollout_s"] for r in steady),
        "rollout idle": fmean(r["rollout_idle_frac"] for r in steady),
        "train idle": fmean(r["train_idle_frac"] for r in steady),
        "final reward": fmean(r["reward_mean"] for r in rows[-max(10, len(rows) // 10):]),
        "max staleness": max(r["staleness_max"] for r in rows),
        "wall s": wall,
    }
