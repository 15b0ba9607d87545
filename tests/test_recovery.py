"""Fault recovery through `hpcrl run`: signals, resume, DP-size change, corrupt checkpoints, restarts."""
from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, hpcrl

from hpcrl.metrics import read_metrics

SMALL = ["--set", "train.prompts_per_step=4", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false",
         "--set", "log.check_weights=true", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"]


def run_args(run_dir, steps: int, *extra: str) -> list[str]:
    return ["run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), "--set", f"train.steps={steps}", *SMALL, *extra]


def final_digest(run_dir) -> str:
    return read_metrics(run_dir / "metrics.jsonl")[-1]["digest_actor_train"][0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    result = hpcrl(*run_args(run_dir, 8), timeout=300)
    assert result.returncode == 0, result.stderr
    return run_dir


def wait_for_steps(path, count: int, process: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {count}")


def test_sigusr1_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, uninterrupted):
    stop_after = random.Random().randint(1, 6)
    process = subprocess.Popen([sys.executable, "-m", "hpcrl", *run_args(tmp_path, 8)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(tmp_path / "metrics.jsonl", stop_after, process)
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 99, stderr
    assert "SIGUSR1 to hpcrl run received: checkpoint saved at step" in stderr + _
    resumed = hpcrl(*run_args(tmp_path, 8), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stderr
    steps = [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, 9)), f"every step exactly once (stopped after step {stop_after})"
    assert final_digest(tmp_path) == final_digest(uninterrupted)
    straight = read_metrics(uninterrupted / "metrics.jsonl")
    assert [m["reward_mean"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [m["reward_mean"] for m in straight]


def test_resume_on_a_different_dp_size_continues_from_the_same_step(tmp_path):
    first = hpcrl(*run_args(tmp_path, 2), timeout=300)
    assert first.returncode == 0, first.stderr
    second = hpcrl(*run_args(tmp_path, 4, "--set", "roles.actor_train.parallel.dp=1"), timeout=300)
    assert second.returncode == 0, second.stderr
    assert "step-2 (step 2)" in second.stderr
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [len(m["digest_actor_train"]) for m in metrics] == [2, 2, 1, 1]


def test_a_corrupt_checkpoint_is_reported_and_skipped(tmp_path):
    assert hpcrl(*run_args(tmp_path, 4), timeout=300).returncode == 0
    newest = tmp_path / "checkpoints" / "step-4"
    victim = max((p for p in newest.rglob("*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    resumed = hpcrl(*run_args(tmp_path, 5), timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-4" in resumed.stderr and "SHA-256 mismatch (corrupt); skipped" in resumed.stderr
    assert "resuming from" in resumed.stderr and "step-2 (step 2)" in resumed.stderr
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert "train.steps 4 -> 5 under lr_schedule cosine, which decays over train.steps: step 3 trains at lr" \
        in resumed.stderr, "the extended run's lr jump is said"


@pytest.mark.parametrize("failed_in_step", [3, 2])
def test_a_dead_rank_restarts_from_the_last_checkpoint_when_the_profile_allows(tmp_path, failed_in_step):
    """After step 2's checkpoint the restart resumes from it; before any checkpoint (in step 2, after step 1's metrics) it
    starts over from step 0 instead of refusing, and the failed attempt's metrics are kept aside."""
    profile = tmp_path / "local-restarts.yaml"
    profile.write_text((REPO / "clusters" / "local.yaml").read_text().replace("max_restarts: 0", "max_restarts: 1"))
    result = hpcrl(*run_args(tmp_path / "run", 4), "--cluster", str(profile),
                   env={"HPCRL_INJECT_FAULT": f"2:train_step:{failed_in_step}:exit"}, timeout=400)
    assert result.returncode == 0, result.stderr
    assert "restart 1 of 1" in result.stderr
    assert ("step-2 (step 2)" in result.stderr) == (failed_in_step == 3)
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
