"""Agentic RL through `hpcrl run`: an env job's trajectories are played by the rollout rank's env
processes, trained with their observation tokens masked, checkpointed with the buffer of played
trajectories and resumed bit for bit; envs that raise or hang fail their trajectories, counted,
while the run goes on."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, hpcrl

from hpcrl.metrics import read_metrics

SMALL = ["--set", "train.prompts_per_step=4", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false",
         "--set", "log.check_weights=true", "--set", "env.workers=8"]


def test_an_env_job_trains_on_masked_trajectories_and_resumes_its_buffer_bit_for_bit(tmp_path):
    """max_staleness 1: the checkpoint after step 2 holds batch 3's trajectories, played ahead (with
    their turns' rewards, which GiGPO's step advantages discount); a run resumed from it trains step 3
    on them exactly as the uninterrupted run did."""
    straight = tmp_path / "straight"
    args = ["run", "jobs/tiny_frozenlake.yaml", *SMALL, "--set", "rollout.max_staleness=1",
            "--set", "algorithm.name=gigpo", "--set", "rollout.recompute_logprobs=always",
            "--set", "checkpoint.every=2", "--set", "train.steps=3"]
    result = hpcrl(*args, "--run-dir", str(straight), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(straight / "metrics.jsonl")
    for m in metrics:
        assert 0 <= m["success_rate"] <= 1 and m["trajectories_failed"] == 0
        assert 1 <= m["turns"] <= 8 and 1 <= m["tokens_per_turn"] <= 2
        # a response holds its actions and the observations after them: ~22 tokens a turn, not ~2
        assert m["response_len"] > 5 * m["turns"]
        assert m["rollout_logprob_gap_max"] < 1e-4, "the trainer agrees on the generated tokens only"
    assert metrics[-1]["staleness_1"] > 0, "batch 3 was played ahead, with version 1"

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-3")
    (resumed / "metrics.jsonl").write_text("".join(
        line + "\n" for line in (straight / "metrics.jsonl").read_text().splitlines()[:2]))
    result = hpcrl(*args, "--run-dir", str(resumed), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stderr + result.stdout
    again = read_metrics(resumed / "metrics.jsonl")
    assert [m["step"] for m in again] == [1, 2, 3]
    assert again[-1]["digest_actor_train"] == metrics[-1]["digest_actor_train"]
    assert again[-1]["success_rate"] == metrics[-1]["success_rate"]


HOSTS = {"rollout rank": [], "env rank": ["roles.env={parallel: {dp: 1}}"],
         # one env rank answering two rollout ranks (rollout in the trainer's processes)
         "env rank of two": ["roles.env={parallel: {dp: 1}}", "roles.actor_infer.colocate_with=actor_train",
                             "roles.actor_infer.parallel.dp=2"]}


@pytest.mark.parametrize("hosts", HOSTS)
def test_envs_that_raise_or_hang_fail_their_trajectories_and_the_run_goes_on(tmp_path, hosts):
    """The envs run as processes of the rollout rank, or of an env rank of their own (roles.env),
    which kills and replaces them there and answers its rollout ranks' calls over MPI."""
    run_dir, pids = tmp_path / "run", tmp_path / "pids"
    pids.mkdir()
    workers = [x for o in HOSTS[hosts] for x in ("--set", o)]
    result = hpcrl("run", "jobs/tiny_frozenlake.yaml", *SMALL, *workers, "--run-dir", str(run_dir),
                   "--set", "train.steps=2", "--set", "env.name=tests.envs_for_tests:paced", "--set", "env.seeds=4",
                   "--set", f"env.options={{length: 2, delay_s: 0.0, raise_seed: 1, hang_seed: 2, pid_dir: {pids}}}",
                   "--set", "env.step_timeout_s=3", "--set", "env.max_turns=3", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = json.loads((run_dir / "ranks.json").read_text())
    role = "env" if hosts.startswith("env rank") else "actor_infer"
    # (every rank builds the env once for its tokenizer too, as a child of the launcher: not a rank's pid)
    hosting = {int(p.name) for p in pids.iterdir()} & {r["pid"] for r in ranks.values()}
    assert hosting == {r["pid"] for r in ranks.values() if r["roles"] == role}
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    # every seed is drawn once per 4 groups: each step has one raising and one hanging group of 4
    for m in metrics:
        assert m["envs_raised"] == 4 and m["envs_hung"] == 4 and m["trajectories_failed"] == 8, m
        assert m["turns_to_success"] == 2, "the paced env's episodes succeed at their second step"
        assert np.isfinite(m["loss"])


def test_a_run_killed_mid_trajectory_resumes_as_if_never_killed(tmp_path):
    """SIGKILL to the whole run while trajectories are being played (batch 4's round, K=1, after the
    step-2 checkpoint): the resumed run keeps the checkpoint's finished trajectories (batch 3, played
    ahead), plays the unfinished ones again from their seeds, and ends with the uninterrupted run's
    weights, every step logged once."""
    paced = ["--set", "env.name=tests.envs_for_tests:paced", "--set", "env.seeds=4",
             "--set", "env.options={length: 3, delay_s: 0.05}", "--set", "env.max_turns=3",
             "--set", "rollout.max_staleness=1", "--set", "checkpoint.every=2", "--set", "train.steps=5"]
    straight = tmp_path / "straight"
    result = hpcrl("run", "jobs/tiny_frozenlake.yaml", *SMALL, *paced, "--run-dir", str(straight), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]

    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", "jobs/tiny_frozenlake.yaml", *SMALL, *paced,
                                "--run-dir", str(killed)], cwd=REPO, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not ((killed / "metrics.jsonl").exists() and len((killed / "metrics.jsonl").read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and process.poll() is None, "the run did not reach step 3"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)   # batch 4's trajectories are in the middle of their turns
    process.wait()
    assert not (killed / "checkpoints" / "step-4").exists()
    result = hpcrl("run", "jobs/tiny_frozenlake.yaml", *SMALL, *paced, "--run-dir", str(killed), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stderr + result.stdout
    again, first = read_metrics(killed / "metrics.jsonl"), read_metrics(straight / "metrics.jsonl")
    assert [m["step"] for m in again] == [1, 2, 3, 4, 5]
    assert [m["reward_mean"] for m in again] == [m["reward_mean"] for m in first]
    assert again[-1]["digest_actor_train"] == first[-1]["digest_actor_train"]
