"""Faults a hostile but realistic user meets, with the real processes, signals and files (`hpcrl run`,
4 MPI ranks): a second run on the same directory, a killed, stopped or hung rank, a stop request, every
checkpoint corrupt, a deleted metrics file, a changed job, and the inputs that must fail at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, hpcrl

from hpcrl.launch.lock import LOCK_NAME, Holder, read_holder
from hpcrl.launch.shm import stale_segments
from hpcrl.metrics import read_metrics

FAST = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false"]


def start(run_dir: Path, steps: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpcrl", "run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir),
                             "--set", f"train.steps={steps}", *FAST, *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def wait_until(predicate, timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def steps_done(run_dir: Path) -> int:
    try:
        return len(read_metrics(run_dir / "metrics.jsonl"))
    except (OSError, ValueError):
        return 0


def rank_pid(run_dir: Path, rank: int) -> int:
    wait_until(lambda: (run_dir / "ranks.json").exists(), what="ranks.json")
    return json.loads((run_dir / "ranks.json").read_text())[str(rank)]["pid"]


def test_one_run_per_directory_and_hpcrl_cancel_stops_it_after_a_checkpoint(tmp_path):
    first = start(tmp_path, 300, "--set", "checkpoint.every=0")
    wait_until(lambda: steps_done(tmp_path) >= 2, what="two steps")
    holder = read_holder(tmp_path)
    assert holder is not None and holder.pid == first.pid and holder.command == "run"
    second = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=3", *FAST,
                   timeout=120)
    assert second.returncode == 97
    assert f"is in use by `hpcrl run` (host {holder.host}, PID {first.pid}" in second.stderr
    cancelled = hpcrl("cancel", str(tmp_path), timeout=60)
    assert cancelled.returncode == 0 and "asked `hpcrl run`" in cancelled.stdout
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 98, stderr
    assert "SIGTERM received: checkpoint saved at step" in stdout + stderr and "stopping as asked" in stdout + stderr
    step = steps_done(tmp_path)
    assert (tmp_path / "checkpoints" / f"step-{step}").is_dir() and not (tmp_path / LOCK_NAME).exists()
    resumed = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", f"train.steps={step + 2}",
                    *FAST, timeout=300)
    assert resumed.returncode == 0 and f"(step {step})" in resumed.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, step + 3))


def test_a_stale_lock_is_taken_over_and_said_so(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = Holder.here("run")
    (tmp_path / LOCK_NAME).write_text(json.dumps({**vars(stale), "pid": int(dead.stdout)}))
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=1", *FAST,
                   timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"took over a stale lock of `hpcrl run` (host {stale.host}, PID {int(dead.stdout)}" in result.stderr
    assert f"PID {int(dead.stdout)} on {stale.host} has exited" in result.stderr


def test_a_killed_rank_is_named_with_its_role_host_and_signal_within_seconds(tmp_path):
    run = start(tmp_path, 300)
    wait_until(lambda: steps_done(tmp_path) >= 2, what="two steps")
    pid = rank_pid(tmp_path, 2)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = run.communicate(timeout=60)
    assert time.monotonic() - killed < 15, "the world ends within seconds"
    assert run.returncode == 96
    assert f"rank 2 (role actor_train,reference, host {os.uname().nodename}, pid {pid}) died: killed by signal 9 " \
           "(SIGKILL)" in stderr


def test_a_stopped_rank_is_named_every_live_rank_dumps_its_stacks_and_the_run_restarts(tmp_path):
    profile = tmp_path / "restarts.yaml"
    profile.write_text((REPO / "clusters" / "local.yaml").read_text().replace("max_restarts: 0", "max_restarts: 1"))
    run_dir = tmp_path / "run"
    run = start(run_dir, 12, "--cluster", str(profile), "--set", "checkpoint.every=2",
                "--set", "watchdog.heartbeat_s=1", "--set", "watchdog.lost_after_s=6")
    wait_until(lambda: steps_done(run_dir) >= 3, what="three steps")
    pid = rank_pid(run_dir, 3)
    os.kill(pid, signal.SIGSTOP)
    _, stderr = run.communicate(timeout=300)
    assert f"rank 3 (role actor_infer, host {os.uname().nodename}, pid {pid}) has sent no heartbeat" in stderr
    assert "its process is stopped (SIGSTOP?)" in stderr
    assert "Python stacks of rank 1, as asked by the controller" in stderr
    assert "restart 1 of 1 from the newest checkpoint" in stderr
    assert run.returncode == 0, stderr
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 13))


def test_a_call_that_never_returns_is_caught_by_its_deadline(tmp_path):
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=50", *FAST,
                   "--set", "watchdog.call_timeout_min_s=2", "--set", "watchdog.call_timeout_max_s=20",
                   env={"HPCRL_INJECT_FAULT": "1:train_step:3:hang"}, timeout=200)
    assert result.returncode == 96
    assert "rank 1 (role actor_train,reference" in result.stderr and "has not answered train_step after" in result.stderr
    assert "10 x the slowest so far" in result.stderr, "the deadline comes from the observed train steps"
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_every_checkpoint_corrupt_refuses_to_start_over_unless_asked_and_keeps_the_evidence(tmp_path):
    args = ["run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), *FAST, "--set", "checkpoint.every=2"]
    assert hpcrl(*args, "--set", "train.steps=4", timeout=300).returncode == 0
    for state in (tmp_path / "checkpoints").glob("step-*/state.h5"):
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    # not even a restart after a failure starts over: damaged checkpoints are for a person to look at
    refused = hpcrl(*args, "--set", "train.steps=6", env={"HPCRL_AUTOMATIC_RESTART": "1"}, timeout=300)
    assert refused.returncode == 97
    assert "holds a run (metrics of 4 step(s); checkpoints step-2.corrupt, step-4.corrupt)" in refused.stderr
    assert "Give --restart" in refused.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4], "nothing was overwritten"
    again = hpcrl(*args, "--set", "train.steps=2", "--restart", timeout=300)
    assert again.returncode == 0, again.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.superseded.jsonl")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-2.corrupt",
                                                                            "step-4.corrupt"]
    # a valid checkpoint whose controller state another hpcrl wrote: refused before any rank loads it
    import h5py

    from hpcrl.checkpoint.manifest import sha256_file

    state, manifest = tmp_path / "checkpoints/step-2/state.h5", tmp_path / "checkpoints/step-2/manifest.json"
    with h5py.File(state, "r+") as f:
        f.attrs["format_version"] = 99
    fields = json.loads(manifest.read_text())
    fields["files"]["state.h5"]["sha256"] = sha256_file(state).sha256
    manifest.write_text(json.dumps(fields))
    other = hpcrl(*args, "--set", "train.steps=4", timeout=300)
    assert other.returncode == 97, other.stderr
    assert "format_version 99 is not" in other.stderr and "move" in other.stderr and "aside" in other.stderr


def test_a_deleted_metrics_file_is_rebuilt_and_a_changed_job_needs_its_key_allowed(tmp_path):
    args = ["run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), *FAST, "--set", "checkpoint.every=2"]
    assert hpcrl(*args, "--set", "train.steps=2", timeout=300).returncode == 0
    (tmp_path / "metrics.jsonl").unlink()
    rebuilt = hpcrl(*args, "--set", "train.steps=3", timeout=300)
    assert rebuilt.returncode == 0 and "2 step(s) were missing; rebuilt from the checkpoint" in rebuilt.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    changed = hpcrl(*args, "--set", "train.steps=4", "--set", "algorithm.kl_loss.coef=0.5", timeout=300)
    assert changed.returncode == 97
    assert "changed algorithm.kl_loss.coef: 0.001 -> 0.5" in changed.stderr
    assert "resume anyway with --allow-config-change algorithm.kl_loss.coef" in changed.stderr
    allowed = hpcrl(*args, "--set", "train.steps=4", "--set", "algorithm.kl_loss.coef=0.5",
                    "--allow-config-change", "algorithm.kl_loss.coef", timeout=300)
    assert allowed.returncode == 0 and "resuming anyway (--allow-config-change)" in allowed.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("overrides, message", [
    (["seed=18446744073709551616"], "seed: expected a non-negative integer below 9223372036854775808"),
    (["train.lr=inf"], "train.lr: expected a positive number (finite), got 'inf'"),
    (["algorithm.entropy_coef=nan"], "algorithm.entropy_coef: expected a number (finite)"),
    (["train.prompts_per_step=3", "algorithm.group_size=3"],
     "train.prompts_per_step x algorithm.group_size = 9 samples per step do not split into "
     "roles.actor_train.parallel.dp = 2 replicas x train.minibatches = 2"),
])
def test_inputs_that_would_fail_steps_into_the_run_are_refused_by_the_plan(overrides, message):
    result = hpcrl("plan", "jobs/tiny_grpo.yaml", *[x for o in overrides for x in ("--set", o)], timeout=60)
    assert result.returncode == 2 and f"jobs/tiny_grpo.yaml: {message}" in result.stderr, result.stderr


def test_a_duplicate_yaml_key_and_an_unwritable_run_directory_are_named(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text((REPO / "jobs" / "tiny_grpo.yaml").read_text() + "seed: 7\n")
    result = hpcrl("plan", str(job), timeout=60)
    assert result.returncode == 2 and f"{job}: seed: given twice (lines 4 and" in result.stderr
    unwritable = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", "/proc/hpcrl-run", timeout=60)
    assert unwritable.returncode == 97 and "/proc/hpcrl-run: cannot create the run directory" in unwritable.stderr
    assert "Traceback" not in unwritable.stderr


def test_status_reports_a_corrupt_line_in_the_middle_of_the_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    result = hpcrl("status", str(tmp_path), timeout=60)
    assert f"warning: {tmp_path}/metrics.jsonl:2: not a JSON record" in result.stdout


def test_only_unmapped_mpi_segments_are_removed(tmp_path):
    """MPICH's segments, and a weight bucket a killed colocated vLLM rank had staged; nothing else."""
    mapped, left = tmp_path / "mpich_shm_mapped_0", tmp_path / "mpich_shm_left_0"
    staged, other = tmp_path / "hpcrl-weights-x1.safetensors", tmp_path / "someone-elses"
    for path in (mapped, left, staged, other):
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (time.time() - 10, time.time() - 10))
    holder = subprocess.Popen([sys.executable, "-c", f"import mmap, sys, time; f = open({str(mapped)!r}, 'r+b'); "
                               "m = mmap.mmap(f.fileno(), 4096); print('mapped', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert sorted(stale_segments(tmp_path)) == sorted([left, staged])
    finally:
        holder.kill()
