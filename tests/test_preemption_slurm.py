"""Preemption under the real local Slurm, end to end: `scancel --signal=USR1 --full` during training
-> checkpoint -> exit 99 -> `scontrol requeue` -> the job resumes and completes with the same final
weights as an uninterrupted run."""
from __future__ import annotations

import re
import time

from conftest import hpcrl
from slurm_cluster import slurm_cmd, slurm_env, slurm_environ, wait_job  # noqa: F401

from hpcrl.metrics import read_metrics

SETTINGS = ["train.steps=16", "train.prompts_per_step=4", "algorithm.group_size=4", "log.tensorboard=false",
            "log.check_weights=true", "checkpoint.every=0"]
SETS = [x for s in SETTINGS for x in ("--set", s)]


def test_scancel_usr1_checkpoints_requeues_and_finishes_with_the_same_weights(slurm_env, tmp_path):
    run_dir = tmp_path / "preempted"
    submitted = hpcrl("submit", "jobs/tiny_grpo.yaml", "--cluster", "clusters/slurm-local.yaml",
                      "--run-dir", str(run_dir), *SETS, env=slurm_environ(slurm_env), timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    job = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir / "metrics.jsonl")) >= 2:
            break
        time.sleep(0.1)
    slurm_cmd(["scancel", "--signal=USR1", "--full", job], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=400, poll=1)
    log = "\n".join(p.read_text(errors="replace") for p in run_dir.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", log
    assert info["Restarts"] == "1", "the job was requeued once"
    assert "SIGUSR1 received: checkpoint saved at step" in log and "resuming from" in log
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 17)), "every step exactly once"

    straight = tmp_path / "straight"
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(straight), *SETS, timeout=300)
    assert result.returncode == 0, result.stderr
    assert metrics[-1]["digest_actor_train"] == read_metrics(straight / "metrics.jsonl")[-1]["digest_actor_train"]
