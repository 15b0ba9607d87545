"""Faults under the real local Slurm, with the real commands: scancel means cancel, an outside
`scontrol requeue` resumes without a false alarm, a second submission of a run directory is refused,
and a rank killed under srun is named and the job restarts (the profile allows one restart)."""
from __future__ import annotations

import json
import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path

from conftest import hpcrl
from slurm_cluster import slurm_cmd, slurm_env, slurm_environ, wait_job  # noqa: F401

from hpcrl.metrics import read_metrics

SETTINGS = ["train.prompts_per_step=4", "algorithm.group_size=4", "log.tensorboard=false"]


def submit(run_dir: Path, slurm_env, steps: int, *settings: str) -> tuple[str, object]:
    sets = [x for s in (*SETTINGS, f"train.steps={steps}", *settings) for x in ("--set", s)]
    result = hpcrl("submit", "jobs/tiny_grpo.yaml", "--cluster", "clusters/slurm-local.yaml", "--run-dir",
                   str(run_dir), *sets, env=slurm_environ(slurm_env), timeout=120)
    match = re.search(r"submitted job (\d+)", result.stdout)
    return (match.group(1) if match else None), result


def wait_steps(run_dir: Path, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(read_metrics(run_dir / "metrics.jsonl")) >= count:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not reach step {count}")


def log_of(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.glob("slurm-*.out"))


def test_scancel_cancels_a_running_job_after_saving_and_a_second_submit_is_refused(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    job, first = submit(run_dir, slurm_env, 300, "checkpoint.every=0")
    assert job, first.stdout + first.stderr
    wait_steps(run_dir, 2)
    _, second = submit(run_dir, slurm_env, 300)
    assert second.returncode == 1 and f"Slurm job {job}" in second.stderr and "is in use by" in second.stderr
    slurm_cmd(["scancel", job], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=120, poll=0.5)
    log = log_of(run_dir)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", log
    assert "not requeueing" in log and "requeueing to continue" not in log
    assert "SIGTERM received: checkpoint saved at step" in log, log
    step = int(re.search(r"checkpoint saved at step (\d+)", log).group(1))
    assert (run_dir / "checkpoints" / f"step-{step}").is_dir()
    # the job has ended: its lock is stale, and the next submission resumes from the checkpoint
    job2, again = submit(run_dir, slurm_env, step + 2)
    assert job2 and "took over a stale lock" in again.stderr and f"Slurm job {job} has ended" in again.stderr
    (info,) = wait_job(job2, slurm_env, timeout=300, poll=0.5)
    assert info["JobState"] == "COMPLETED", log_of(run_dir)
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, step + 3))


def test_an_outside_scontrol_requeue_resumes_without_a_false_alarm(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    job, result = submit(run_dir, slurm_env, 16, "checkpoint.every=0")
    assert job, result.stdout + result.stderr
    wait_steps(run_dir, 3)
    slurm_cmd(["scontrol", "requeue", job], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=400, poll=1)
    log = log_of(run_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert "resubmit by hand" not in log and "requeue failed" not in log
    assert "resuming from" in log
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 17)), "every step once"


def test_a_rank_killed_under_srun_is_named_and_the_job_restarts_from_its_checkpoint(slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    job, result = submit(run_dir, slurm_env, 12, "checkpoint.every=2")
    assert job, result.stdout + result.stderr
    wait_steps(run_dir, 3)
    rank = json.loads((run_dir / "ranks.json").read_text())["2"]
    os.kill(rank["pid"], signal.SIGKILL)
    killed = time.time()
    (info,) = wait_job(job, slurm_env, timeout=400, poll=1)
    log = log_of(run_dir)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log
    assert (f"rank 2 (role actor_train,reference, host {rank['host']}, pid {rank['pid']}) died: killed by signal 9 "
            "(SIGKILL)") in log
    ended = [json.loads(line) for line in (run_dir / "job_events.jsonl").read_text().splitlines()]
    restart = next(e for e in ended if e["action"] == "restart")
    seconds = datetime.fromisoformat(restart["time"]).timestamp() - killed
    assert seconds < 20, f"the world ended {seconds:.0f} s after the kill"
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 13))



def test_a_run_that_cannot_resume_is_refused_once_and_not_retried(slurm_env, tmp_path):
    """A refusal is not a failure. srun gives the step the exit code of the peers the refusal's abort
    killed (137 or 143), so the controller leaves RUN_DIR/ranks/refused-<job id> and the batch script,
    reading it, neither restarts nor requeues the run and ends with 97."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": 0.0}) + "\n" for s in (1, 2)))
    job, result = submit(run_dir, slurm_env, 4)
    assert job, result.stdout + result.stderr
    (info,) = wait_job(job, slurm_env, timeout=300, poll=0.5)
    log = log_of(run_dir)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "97:0" and info["Restarts"] == "0", log
    assert "holds a run (metrics of 2 step(s)) but no checkpoint it can resume from" in log
    assert "the ranks refused to start" in log and "restart 1 of" not in log
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [1, 2], "the run's metrics are kept"


def test_ranks_that_fail_before_mpi_joins_them_are_not_requeued_to_fail_again(slurm_env, tmp_path):
    """A setup error (here the profile's interpreter has none of hpcrl's packages: every rank dies
    importing it) would fail every restart the same way, each after a wait in the queue: the batch
    script requeues only failures of ranks that MPI had joined (RUN_DIR/ranks/world-<job id>)."""
    import yaml

    profile = yaml.safe_load((Path(__file__).parent.parent / "clusters/slurm-local.yaml").read_text())
    profile["slurm"]["python"] = "/usr/bin/python3"
    cluster = tmp_path / "system-python.yaml"
    cluster.write_text(yaml.safe_dump(profile))
    run_dir = tmp_path / "run"
    sets = [x for s in (*SETTINGS, "train.steps=4") for x in ("--set", s)]
    result = hpcrl("submit", "jobs/tiny_grpo.yaml", "--cluster", str(cluster), "--run-dir", str(run_dir), *sets,
                   env=slurm_environ(slurm_env), timeout=120)
    job = re.search(r"submitted job (\d+)", result.stdout)
    assert job, result.stdout + result.stderr
    (info,) = wait_job(job.group(1), slurm_env, timeout=300, poll=0.5)
    log = log_of(run_dir)
    assert info["JobState"] == "FAILED" and info["Restarts"] == "0", log
    assert "No module named" in log and "before MPI joined them" in log and "restart 1 of" not in log, log
