"""Chaos under the real local Slurm: one tiny GRPO run of 300 steps, faults injected at random steps.

The faults, drawn in a random order (one of each kind at least):
  kill     SIGKILL of a worker rank              -> named by the watchdog, the job restarts
  stop     SIGSTOP of a worker rank              -> no heartbeat: named, stacks dumped, restart
  warning  the warning signal (USR2 to the batch script, as --signal=B:USR2@T) -> checkpoint, requeue
  requeue  `scontrol requeue` from outside       -> the ranks save and stop, Slurm requeues
  corrupt  the newest checkpoint damaged, then a SIGKILL -> the restart skips it (kept as .corrupt)
After the run the bench prints what was injected and survived, how many steps were computed again,
whether metrics.jsonl has every step exactly once, and whether the metrics and the final weights
equal those of an uninterrupted `hpcrl run` of the same job and seed (bit for bit).

    .venv/bin/python bench/chaos.py [--steps 300] [--faults 10] [--seed 0]

Needs root and Slurm from apt (scripts/install-system-deps); starts its own cluster and stops it.
About 10 minutes on this 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
KINDS = ("kill", "stop", "warning", "requeue", "corrupt")
# Fast steps and a short watchdog: a stopped rank is found in 8 s. Checkpoints every 10 steps, so a
# fault costs at most 10 steps; three kept, so the one before a damaged newest one is still there.
SETTINGS = ["train.prompts_per_step=8", "algorithm.group_size=4", "log.tensorboard=false", "log.check_weights=true",
            "checkpoint.every=10", "checkpoint.keep=3", "watchdog.heartbeat_s=1", "watchdog.lost_after_s=8"]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="of the fault schedule (the run's seed is the job's)")
    return parser.parse_args()


def read_metrics(path: Path) -> list[dict]:
    from hpcrl.metrics import read_metrics as read

    try:
        return read(path)
    except (OSError, ValueError):
        return []


class Chaos:
    def __init__(self, run_dir: Path, slurm_env: dict[str, str], job_id: str):
        self.run_dir, self.env, self.job_id = run_dir, slurm_env, job_id

    def slurm(self, *args: str) -> str:
        from slurm_cluster import slurm_cmd

        return slurm_cmd(list(args), self.env)

    def state(self) -> str:
        from slurm_cluster import job_info

        return job_info(self.job_id, self.env)[0].get("JobState", "?")

    def steps(self) -> int:
        return max((m.get("step", 0) for m in read_metrics(self.run_dir / "metrics.jsonl")), default=0)

    def wait_running_past(self, step: int, timeout: float = 600) -> int:
        """Wait until the job runs and has recorded a step past `step` (after a restart too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                return -1
            if state == "RUNNING" and self.steps() > step and (self.run_dir / "ranks.json").exists():
                return self.steps()
            time.sleep(0.2)
        raise TimeoutError(f"job {self.job_id} did not get past step {step} (state {self.state()})")

    def worker_pid(self, rng: random.Random) -> int:
        ranks = json.loads((self.run_dir / "ranks.json").read_text())
        return ranks[rng.choice(sorted(ranks))]["pid"]

    def inject(self, kind: str, rng: random.Random) -> None:
        if kind in ("kill", "stop"):
            os.kill(self.worker_pid(rng), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        elif kind == "warning":
            self.slurm("scancel", "--batch", "--signal=USR2", self.job_id)
        elif kind == "requeue":
            self.slurm("scontrol", "requeue", self.job_id)
        else:   # corrupt the newest checkpoint, then kill a rank so that the restart must pass it over
            newest = max((p for p in (self.run_dir / "checkpoints").glob("step-*") if p.name[5:].isdigit()),
                         key=lambda p: int(p.name[5:]))
            victim = max((p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"),
                         key=lambda p: p.stat().st_size)
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))
            os.kill(self.worker_pid(rng), signal.SIGKILL)


def main() -> int:
    args = parse()
    from slurm_cluster import ensure_slurm, slurm_environ, stop_slurm, wait_job

    rng = random.Random(args.seed)
    schedule = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, args.faults - len(KINDS)))]
    rng.shuffle(schedule)
    # fault i lands at a random step of the i-th stretch of the run (not in the last 20 steps)
    stretch = (args.steps - 20) // len(schedule)
    at = [i * stretch + rng.randint(5, stretch) for i in range(len(schedule))]
    sets = [f"train.steps={args.steps}", *SETTINGS]
    with tempfile.TemporaryDirectory(prefix="hpcrl-chaos-") as tmp:
        tmp = Path(tmp)
        profile = tmp / "slurm-local-chaos.yaml"
        profile.write_text((REPO / "clusters" / "slurm-local.yaml").read_text()
                           .replace("max_restarts: 1", f"max_restarts: {len(schedule) + 2}")
                           .replace('time: "00:15:00"', 'time: "01:00:00"'))
        env = ensure_slurm()
        try:
            run_dir = tmp / "chaos"
            submitted = subprocess.run([sys.executable, "-m", "hpcrl", "submit", "jobs/tiny_grpo.yaml", "--cluster",
                                        str(profile), "--run-dir", str(run_dir),
                                        *[x for s in sets for x in ("--set", s)]], cwd=REPO, capture_output=True,
                                       text=True, env=slurm_environ(env), check=True)
            job_id = submitted.stdout.split("submitted job ")[1].split()[0].rstrip(":,")
            chaos = Chaos(run_dir, env, job_id)
            injected, survived = [], 0
            started = time.monotonic()
            for kind, step in zip(schedule, at):
                reached = chaos.wait_running_past(step - 1)
                if reached < 0:
                    break
                chaos.inject(kind, rng)
                injected.append((kind, reached))
                print(f"chaos: step {reached}: {kind}", flush=True)
                if chaos.wait_running_past(reached) > reached:
                    survived += 1
            (info,) = wait_job(job_id, env, timeout=1800, poll=1)
            elapsed = time.monotonic() - started
            straight = tmp / "straight"
            subprocess.run([sys.executable, "-m", "hpcrl", "run", "jobs/tiny_grpo.yaml", "--run-dir", str(straight),
                            *[x for s in sets for x in ("--set", s)]], cwd=REPO, capture_output=True, check=True)
            report(args, info, injected, survived, run_dir, straight, elapsed)
        finally:
            stop_slurm(env["HPCRL_SLURM_DIR"], remove=True)
    return 0


def report(args, info: dict, injected: list, survived: int, run_dir: Path, straight: Path, elapsed: float) -> None:
    metrics, reference = read_metrics(run_dir / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    steps = [m["step"] for m in metrics]
    recomputed = len(read_metrics(run_dir / "metrics.superseded.jsonl"))
    compared = ("reward_mean", "reward_std", "kl", "loss", "entropy", "grad_norm", "rollout_logprob_gap_max")
    equal = len(metrics) == len(reference) and all(
        m.get(k) == r.get(k) for m, r in zip(metrics, reference) for k in compared)
    same_weights = bool(metrics) and metrics[-1].get("digest_actor_train") == reference[-1].get("digest_actor_train")
    counts = {k: sum(1 for kind, _ in injected if kind == k) for k in KINDS}
    print(f"run: {args.steps} steps of jobs/tiny_grpo.yaml under the local Slurm, {elapsed:.0f} s, job state "
          f"{info.get('JobState')}, Slurm restarts {info.get('Restarts')}")
    print(f"faults injected:            {len(injected)} ({', '.join(f'{k} x{n}' for k, n in counts.items() if n)})")
    print(f"faults survived:            {survived} of {len(injected)}")
    print(f"steps recomputed:           {recomputed} (records moved to metrics.superseded.jsonl)")
    print(f"corrupt checkpoints kept:   {len(list((run_dir / 'checkpoints').glob('*.corrupt*')))}")
    print(f"every step exactly once:    {steps == list(range(1, args.steps + 1))}")
    print(f"metrics equal (per step):   {equal} ({', '.join(compared)})")
    print(f"final weights bit-identical: {same_weights}")


if __name__ == "__main__":
    sys.exit(main())
