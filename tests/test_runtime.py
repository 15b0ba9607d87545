"""The MPI runtime for real: `hpcrl run` starts 1 controller + 2 DP trainer ranks + 1 rollout rank."""
from __future__ import annotations

import time

import pytest
from conftest import hpcrl

from hpcrl.metrics import read_metrics

FAST = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), "--set", "train.steps=3",
                   "--set", "log.check_weights=true", *FAST, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, read_metrics(run_dir / "metrics.jsonl")


def test_dp_ranks_hold_identical_weights_after_every_step(short_run):
    _, metrics = short_run
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert len(m["digest_actor_train"]) == 2, "actor_train runs on 2 DP ranks"
        assert len(set(m["digest_actor_train"])) == 1
    assert len({m["digest_actor_train"][0] for m in metrics}) == 3, "the weights change every step"


def test_rollout_generates_with_the_trained_weights(short_run):
    _, metrics = short_run
    for m in metrics:
        assert m["digest_actor_infer"] == [m["digest_actor_train"][0]]
    # The behaviour log-probs of step N+1 (rollout rank) equal the trainer's for the same tokens:
    # only possible if the rollout rank got the weights trained at step N.
    assert all(m["rollout_logprob_gap_max"] < 1e-4 for m in metrics)


def test_metrics_have_the_documented_fields(short_run):
    run_dir, metrics = short_run
    for key in ("step", "reward_mean", "kl", "loss", "time_rollout_s", "time_train_s", "time_sync_s",
                "samples_per_s"):
        assert key in metrics[0], key
    assert metrics[0]["samples_per_s"] > 0 and (run_dir / "plan.json").exists()


def test_a_failing_worker_aborts_the_world_and_rank0_prints_the_cause(tmp_path):
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=50", *FAST,
                   env={"HPCRL_INJECT_FAULT": "2:train_step:2"}, timeout=120)
    ended = time.time()
    assert result.returncode != 0
    assert "rank 2 (role actor_train, in train_step) failed" in result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: injected fault: call 2 of train_step on rank 2" in result.stderr
    steps = [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == [1], "the world stopped in step 2"
    # Step 1 was the last thing written; the fault came right after it in step 2.
    assert ended - (tmp_path / "metrics.jsonl").stat().st_mtime < 30


def test_a_rank_that_dies_without_a_word_still_ends_the_world(tmp_path):
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=50", *FAST,
                   env={"HPCRL_INJECT_FAULT": "3:generate:2:exit"}, timeout=120)
    assert result.returncode != 0
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1


def test_the_megatron_engine_trains_inside_the_runtime(tmp_path):
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=2",
                   "--set", "roles.actor_train.engine=megatron", "--set", "checkpoint.every=0", *FAST, timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    # the rollout rank samples with the weights gathered from the Megatron shards (HF names)
    assert all(m["rollout_logprob_gap_max"] < 1e-4 for m in metrics)
