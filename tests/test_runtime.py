"""The MPI runtime for real: `hpcrl run` starts 1 controller + 2 DP trainer ranks + 1 rollout rank."""
from __future__ import annotations

import json
import time

import pytest
import yaml
from conftest import hpcrl

from hpcrl.config import REPO_ROOT, load_job, load_profile
from hpcrl.metrics import read_metrics
from hpcrl.placement import compile_plan
from hpcrl.placement.memory import device_bytes

FAST = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    # two-digit sums, in a context of 8 positions: only the single-digit ones leave room for 3 new tokens
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), "--set", "train.steps=3",
                   "--set", "log.check_weights=true", "--set", "task.digits=2", "--set", "model.max_position_embeddings=8",
                   "--set", "rollout.recompute_logprobs=always", *FAST, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir, read_metrics(run_dir / "metrics.jsonl"), result.stderr


def test_dp_ranks_hold_identical_weights_after_every_step(short_run):
    _, metrics, _ = short_run
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert len(m["digest_actor_train"]) == 2, "actor_train runs on 2 DP ranks"
        assert len(set(m["digest_actor_train"])) == 1
    assert len({m["digest_actor_train"][0] for m in metrics}) == 3, "the weights change every step"


def test_every_ranks_start_up_is_written_down_phase_by_phase(short_run):
    """RUN_DIR/startup.json: when each rank passed each phase of its start-up, since mpiexec
    started (bench/startup.py prints it)."""
    run_dir, _, _ = short_run
    table = json.loads((run_dir / "startup.json").read_text())
    assert sorted(table) == ["0", "1", "2", "3"]
    assert table["0"]["roles"] == "controller" and table["3"]["roles"] == "actor_infer"
    for rank in table.values():
        times = [p["at_s"] for p in rank["phases"]]
        assert times == sorted(times) and 0 <= times[0] and times[-1] < 120
        assert {"MPI", "torch imported", "initial weights"} <= {p["phase"] for p in rank["phases"]}
    assert table["0"]["phases"][-1]["phase"] == "first weight sync"
    assert {"actor_train built", "reference built"} <= {p["phase"] for p in table["1"]["phases"]}


def test_rollout_generates_with_the_trained_weights(short_run):
    _, metrics, _ = short_run
    for m in metrics:
        assert m["digest_actor_infer"] == [m["digest_actor_train"][0]]
    # The behaviour log-probs of step N+1 (rollout rank) equal the trainer's for the same tokens:
    # only possible if the rollout rank got the weights trained at step N.
    assert all(m["rollout_logprob_gap_max"] < 1e-4 for m in metrics)


def test_prompts_that_leave_no_room_for_a_response_are_left_out_and_counted(short_run):
    _, _, stderr = short_run
    assert ("hpcrl: domain addition: 9900 of 10000 prompts are longer than the 8 positions of the model's context "
            "(model.max_position_embeddings) less rollout.max_new_tokens = 3: left out") in stderr


def test_metrics_have_the_documented_fields(short_run):
    run_dir, metrics, _ = short_run
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


MEGATRON = ["--set", "roles.actor_train.engine=megatron", "--set", "roles.reference.engine=megatron",
            "--set", "log.check_weights=true", "--set", "checkpoint.every=0"]
COLOCATED = ["--set", "roles.actor_infer.colocate_with=actor_train", "--set", "roles.actor_infer.parallel.dp=4"]
LAYOUTS = {  # name -> (overrides, trainer replicas, rollout ranks that load weights)
    "tp2-dp2-colocated": (["--set", "roles.actor_train.parallel.tp=2", *COLOCATED], 2, 4),
    "tp2-pp2-colocated": (["--set", "roles.actor_train.parallel.tp=2", "--set", "roles.actor_train.parallel.pp=2",
                           "--set", "roles.actor_train.parallel.dp=1", *COLOCATED], 1, 4),
    "tp2-separate": (["--set", "roles.actor_train.parallel.tp=2", "--set", "roles.actor_train.parallel.dp=1"], 1, 1),
    "pp2-separate": (["--set", "roles.actor_train.parallel.pp=2", "--set", "roles.actor_train.parallel.dp=1"], 1, 1),
    # a MoE model's experts split over 2 EP ranks that are also TP ranks (sequence parallel): one
    # whole replica, gathered from both EP ranks, reaches the 4 colocated rollout ranks
    "tp2-ep2-moe-colocated": (["--set", "roles.actor_train.parallel.tp=2", "--set", "roles.actor_train.parallel.ep=2",
                               "--set", "model.arch=qwen2_moe", "--set", "model.num_experts=4", *COLOCATED], 1, 4),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rollout_rank_generates_with_the_weights_of_a_tp_pp_megatron_trainer(tmp_path, layout):
    """Each pipeline stage's leader sends its own layers; colocated rollout ranks beside TP and PP
    followers get them too; the digests of every trainer replica and rollout rank agree."""
    pytest.importorskip("megatron.core", reason="the megatron extra is not installed")
    overrides, replicas, loaders = LAYOUTS[layout]
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=3",
                   *FAST, *MEGATRON, *overrides, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["staleness_max"] == 0
        # fresh samples: the rollout ranks' log-probs are the trainer's, token for token
        assert m["rollout_logprob_gap_max"] < 1e-5, m["rollout_logprob_gap_max"]
        assert len(m["digest_actor_train"]) == replicas and len(m["digest_actor_infer"]) == loaders
        assert set(m["digest_actor_infer"]) == set(m["digest_actor_train"]), "every rank holds the trained weights"
    assert len({m["digest_actor_train"][0] for m in metrics}) == 3, "the weights change every step"


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_a_context_parallel_trainer_trains_inside_the_runtime_with_rollouts_log_probs(tmp_path, fsdp):
    """torch engine, cp=2 x dp=2 (reference and rollout colocated, on copies of the weights): each
    replica's 2 cp ranks get its share of the batch, and fresh samples' log-probs on the 4 rollout
    ranks are the trainer's."""
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=3", *FAST,
                   "--set", "roles.actor_train.parallel.cp=2", "--set", f"roles.actor_train.fsdp={str(fsdp).lower()}",
                   "--set", f"roles.reference.fsdp={str(fsdp).lower()}", "--set", "log.check_weights=true",
                   "--set", "rollout.recompute_logprobs=always",
                   "--set", "checkpoint.every=0", *COLOCATED, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert m["rollout_logprob_gap_max"] < 1e-5, m["rollout_logprob_gap_max"]
        assert len(m["digest_actor_train"]) == 2 and len(m["digest_actor_infer"]) == 4 and set(m["digest_actor_infer"]) == set(m["digest_actor_train"])
    assert len({m["digest_actor_train"][0] for m in metrics}) == 3, "the weights change every step"


def test_a_round_longer_than_the_sync_timeout_does_not_stall_the_sync_or_the_trainer(tmp_path):
    """With a slow sampler every generation round lasts longer than the sync group's timeout, and a
    train step takes about a second (40 PPO epochs). The sync starts only between rounds, so no
    collective waits for a round; the trainer stages its weights and trains the next batch while
    rollout generates, so a step takes a round, not a round plus a train step."""
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=5",
                   "--set", "rollout.max_staleness=1", "--set", "rollout.sync_timeout_s=1",
                   "--set", "rollout.partial_rollout=false",   # rounds run to their end: see the next test
                   "--set", "train.ppo_epochs=40", *FAST, env={"HPCRL_INJECT_DECODE_DELAY_S": "0.6"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    # A round's time is counted in the step during which it finishes, which depends on how the two
    # sides overlap; over the run, every round of every batch has finished and been counted.
    rounds = sum(m["rollout_rounds"] for m in metrics)
    round_s = sum(m["time_rollout_s"] for m in metrics) / rounds
    assert round_s > 1.5, "each round (3 tokens x 0.6 s) outlasts the 1 s timeout"
    assert max(m["staleness_max"] for m in metrics) == 1, "rollout generated while the trainer trained"
    for m in metrics[1:-1]:  # step 1 waits for the first batch; after step 5 there is no round to overlap
        assert m["time_sync_s"] < 0.5 and m["time_stage_s"] < 0.5, "neither side of the sync waited for the other"
        # Serially the trainer would idle for a whole round per step; here only for what the round lasts
        # longer than a train step (a step in which no round ended counts no rollout time: compare
        # with the average round). The margin is half a train step, whatever the machine's speed: a
        # fixed share of the round failed where training ran faster than the round by more than 40%.
        assert m["train_idle_frac"] * m["time_step_s"] < round_s - 0.5 * m["time_train_s"], m


def test_the_first_round_starts_the_next_batch_in_the_slots_the_first_leaves_free(tmp_path):
    """Per-sample hand-out (K=1, long-tailed responses): the first round starts batch 1 and batch 2
    (version 0 may produce both) and ends as soon as batch 1's last response has, so step 1 trains
    while batch 2's long responses go on. Step 2 trains on samples of version 0 only, which are
    corrected; every fresh token's log-prob is the trainer's (a token's version is right)."""
    result = hpcrl("run", "jobs/tiny_longtail.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=4",
                   "--set", "rollout.max_staleness=1", "--set", "rollout.recompute_logprobs=always", *FAST, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[0]["staleness_max"] == 0 and metrics[0]["stale_token_frac"] == 0
    assert metrics[1]["staleness_1"] == metrics[1]["samples"] and metrics[1]["stale_token_frac"] == 1.0
    assert all(m["staleness_max"] <= 1 for m in metrics)
    assert all(m["rollout_logprob_gap_max"] < 1e-4 for m in metrics), "a token marked fresh was not"


def test_rounds_cut_by_max_round_s_continue_their_responses_in_the_next_round(tmp_path):
    """Partial rollout: a round stops after `rollout.max_round_s`; the unfinished responses keep
    their tokens and log-probs and go on in the next round, and training still sees fresh samples
    whose behaviour log-probs are the trainer's."""
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=2",
                   "--set", "rollout.max_round_s=0.5", "--set", "rollout.recompute_logprobs=always", *FAST,
                   env={"HPCRL_INJECT_DECODE_DELAY_S": "0.3"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["rollout_rounds"] >= 2 for m in metrics), "every batch took more than one round"
    assert any(m["response_len"] > 2 for m in metrics), "responses grew past what one round could give"
    assert all(m["rollout_logprob_gap_max"] < 1e-4 for m in metrics)


def _without_times(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k not in
             ("samples_per_s", "rollout_idle_frac", "train_idle_frac", "stage_moves")} for m in metrics]


def test_rollout_on_the_trainers_own_weights_samples_and_trains_as_with_a_synced_copy(tmp_path):
    """Native rollout on the trainer's ranks (fp32, synchronous) samples with the trainer's own
    parameters: nothing is staged or pushed, the trainer stays resident through rollout, the old
    log-probs are the rollout's (not recomputed), and the run matches the one with a synced copy
    whose log-probs the trainer recomputes (rollout.recompute_logprobs: always): the same samples
    and rewards, losses equal up to the recomputation's rounding."""
    colocated = [*FAST, "--set", "train.steps=3", "--set", "checkpoint.every=0",
                 "--set", "roles.actor_infer.colocate_with=actor_train", "--set", "roles.actor_infer.parallel.dp=2"]
    runs = {}
    for shared in (True, False):
        run_dir = tmp_path / f"shared-{shared}"
        result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), *colocated,
                       "--set", f"rollout.share_trainer_weights={str(shared).lower()}",
                       "--set", f"rollout.recompute_logprobs={'auto' if shared else 'always'}", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[shared] = (json.loads((run_dir / "plan.json").read_text()), read_metrics(run_dir / "metrics.jsonl"))
    (plan, shared), (copied_plan, copied) = runs[True], runs[False]
    assert plan["rollout_shares_weights"] and not copied_plan["rollout_shares_weights"]
    assert "actor_train" in plan["stages"]["rollout"]["resident"]
    assert all("rollout_logprob_gap_max" not in m for m in shared), "the old log-probs were not recomputed"
    assert all(m["rollout_logprob_gap_max"] < 1e-5 for m in copied)
    # after step 1 (which counts the checked sync at start): no staging or push round trip
    assert all(m["time_stage_s"] == m["time_sync_s"] == 0 for m in shared[1:])
    assert all(m["time_stage_s"] > 0 and m["time_sync_s"] > 0 for m in copied[1:])
    for m, c in zip(_without_times(shared), _without_times(copied)):
        assert m["reward_mean"] == c["reward_mean"] and m["response_len"] == c["response_len"], m["step"]
        for key in ("loss", "kl", "entropy"):
            assert m[key] == pytest.approx(c[key], rel=1e-4, abs=1e-6), (m["step"], key)


def _small_devices(path, roles) -> str:
    """A local profile whose devices hold what a stage needs with the trainer (the trainer and the
    reference, or the trainer and rollout), not every role at once."""
    need = max(device_bytes([roles["actor_train"].memory, roles[other].memory]) for other in ("reference", "actor_infer"))
    path.write_text(yaml.safe_dump({**yaml.safe_load((REPO_ROOT / "clusters" / "local.yaml").read_text()),
                                    "name": "small", "device_memory_gb": need * 1.01 / 2**30}))
    return str(path)


def test_colocated_roles_move_off_their_devices_as_the_plan_says_and_the_run_is_bit_for_bit_the_same(tmp_path):
    """Trainer, reference and rollout on the same two CPU slots, on devices too small for the three
    together: entering each stage, the controller offloads what the plan offloads there and reloads
    what the stage needs, in the plan's stage order; the offloaded state really leaves (a separate
    host copy, its storage freed), and the run equals the same run with every role kept resident
    (roles.<name>.offload: false, on devices that hold them), metric for metric."""
    sets = [*FAST, "--set", "train.steps=3", "--set", "checkpoint.every=2", "--set", "rollout.share_trainer_weights=false",
            "--set", "roles.actor_infer.colocate_with=actor_train", "--set", "roles.actor_infer.parallel.dp=2"]
    roles = compile_plan(load_job("jobs/tiny_grpo.yaml", [sets[i + 1] for i in range(0, len(sets), 2)]),
                         load_profile()).roles
    small = _small_devices(tmp_path / "small.yaml", roles)
    runs = {}
    for offload in (True, False):
        run_dir = tmp_path / f"offload-{offload}"
        flags = [x for role in ("actor_train", "reference", "actor_infer")
                 for x in ("--set", f"roles.{role}.offload={str(offload).lower()}")]
        cluster = ["--cluster", str(small)] if offload else []
        result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), *sets, *flags, *cluster, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[offload] = (json.loads((run_dir / "plan.json").read_text()), read_metrics(run_dir / "metrics.jsonl"))
    plan, metrics = runs[True]
    stages = plan["stages"]
    assert stages["rollout"]["offload"] == ["actor_train", "reference"]
    assert stages["logprobs"]["offload"] == ["actor_infer"]
    assert stages["train"]["offload"] == ["actor_infer", "reference"]
    resident = set()   # every role that moves is parked in host memory once built
    for m in metrics:
        moves = [move.split(":") for move in m["stage_moves"]]
        order = [stage for i, (stage, _, _) in enumerate(moves) if i == 0 or moves[i - 1][0] != stage]
        if m["step"] > 1:   # before step 1 the first sync brings the trainer, then rollout, back
            assert order == ["rollout", "logprobs", "train"], order
        for i, (stage, action, role) in enumerate(moves):
            assert (role in resident) == (action == "offload"), (m["step"], stage, action, role)
            resident ^= {role}
            if i + 1 == len(moves) or moves[i + 1][0] != stage:   # the stage's moves are done
                assert resident == set(stages[stage]["resident"]), (m["step"], stage, resident)
        assert m["time_offload_s"] > 0
    assert [len(m["stage_moves"]) for m in metrics[1:]] == [6, 6], "3 roles leave and come back every step"
    kept_plan, kept = runs[False]
    assert all(not stage["offload"] for stage in kept_plan["stages"].values())
    assert all("stage_moves" not in m for m in kept)
    assert _without_times(metrics) == _without_times(kept)
    # rollout on the trainer's own weights: its round goes out behind the train call, and the
    # reference's moves with it; the same samples as with a copy of the weights
    shared_dir = tmp_path / "shared-small"
    shared = [x if x != "rollout.share_trainer_weights=false" else "rollout.share_trainer_weights=true" for x in sets]
    shared_roles = compile_plan(load_job("jobs/tiny_grpo.yaml", [shared[i + 1] for i in range(0, len(shared), 2)]),
                                load_profile()).roles
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(shared_dir), *shared, "--cluster",
                   str(_small_devices(tmp_path / "small-shared.yaml", shared_roles)), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    shared_plan = json.loads((shared_dir / "plan.json").read_text())
    assert shared_plan["rollout_shares_weights"] and shared_plan["stages"]["rollout"]["offload"] == ["reference"]
    shared_metrics = read_metrics(shared_dir / "metrics.jsonl")
    assert all("reference" in " ".join(m["stage_moves"]) for m in shared_metrics[1:])
    assert [m["reward_mean"] for m in shared_metrics] == [m["reward_mean"] for m in kept]
