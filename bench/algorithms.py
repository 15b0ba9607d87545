"""Every algorithm preset on the tiny job, side by side: final reward and samples/s.

Runs `hpcrl run jobs/tiny_grpo.yaml --set algorithm.name=NAME` for each preset (PPO with a critic
colocated with the trainer), once per seed, one run at a time, and prints the final reward (the
mean reward of the last 10% of the steps, averaged over the seeds), the spread between seeds and
samples/s. Everything but the algorithm is the tiny job's (lr schedule, entropy bonus, batch).

    .venv/bin/python bench/algorithms.py [--steps 700] [--seeds 1 2] [--names ppo grpo ...] [--set KEY=VALUE ...]

16 runs of 1.5 to 2.5 minutes each on a 2-core machine: about 35 minutes.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import fmean

from tiny_runs import run_job

from hpcrl.config.algorithms import PRESETS

# what a preset needs besides its name on the tiny job
NEEDS = {"ppo": ["roles.critic.engine=torch", "roles.critic.colocate_with=actor_train"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="jobs/tiny_grpo.yaml")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--names", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            for seed in args.seeds:
                overrides = [f"algorithm.name={name}", *NEEDS.get(name, []), *args.overrides]
                runs.setdefault(name, []).append(run_job(args.job, args.steps, seed, overrides,
                                                         Path(tmp) / f"{name}-s{seed}"))
                print(f"{name} seed {seed}: final reward {runs[name][-1]['final reward']:.3f}", flush=True)
    print(f"\n{args.job}, {args.steps} steps, seeds {' '.join(map(str, args.seeds))} (means over the seeds)")
    print(f"{'algorithm':<14}{'final reward':>13}{'per seed':>18}{'samples/s':>11}{'wall s':>8}")
    for name, found in runs.items():
        per_seed = " ".join(f"{r['final reward']:.3f}" for r in found)
        print(f"{name:<14}{fmean(r['final reward'] for r in found):>13.3f}{per_seed:>18}"
              f"{fmean(r['samples/s'] for r in found):>11.0f}{fmean(r['wall s'] for r in found):>8.0f}")
    if "ppo" in runs and "grpo" in runs:
        gap = fmean(r["final reward"] for r in runs["ppo"]) - fmean(r["final reward"] for r in runs["grpo"])
        print(f"PPO (critic) - GRPO final reward: {gap:+.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
