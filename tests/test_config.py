"""Job and profile validation: every mistake names the file, the key path and what is allowed."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import REPO, hpcrl

from hpcrl.config import ConfigError, load_job, load_profile
from hpcrl.config.overrides import apply_overrides, parse_override

GOOD = """\
name: t
task: {name: addition}
roles:
  actor_train: {parallel: {dp: 2}}
  actor_infer: {}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_job(path, overrides)
    return str(info.value)


def test_good_job_loads_with_defaults(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.roles.actor_train.parallel.dp == 2
    assert job.roles.actor_train.parallel.tp == 1
    assert job.engine("actor_train") == "torch" and job.engine("actor_infer") == "native"
    assert job.stages("actor_train") == ("logprobs", "train")


def test_unknown_key_is_named_with_a_suggestion_and_line(tmp_path):
    path = write(tmp_path, GOOD + "trian: {steps: 3}\n")
    message = error_of(path)
    assert f"{path}: trian: unknown key; did you mean 'train'?" in message
    assert "Allowed here: algorithm, checkpoint" in message
    assert "(line 6)" in message


def test_unknown_nested_key(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("actor_infer: {}", "actor_infer: {enigne: native}")))
    assert "roles.actor_infer.enigne: unknown key; did you mean 'engine'?" in message


def test_wrong_type_names_the_key_path_and_expected_type(tmp_path):
    path = write(tmp_path, GOOD.replace("{dp: 2}", "{tp: two}"))
    assert f"{path}: roles.actor_train.parallel.tp: expected a positive integer, got 'two' (line 4)" in error_of(path)


def test_missing_required_field(tmp_path):
    path = write(tmp_path, "name: t\ntask: {name: addition}\n")
    assert f"{path}: roles: required field is missing" in error_of(path)


def test_every_problem_is_reported_at_once(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("name: t", "name: 't;rm -rf /'") + "seed: -1\n"))
    assert "name: " in message and "seed: expected a non-negative integer, got -1" in message


def test_task_or_dataset_exactly_one(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("task: {name: addition}\n", "")))
    assert "give exactly one of 'task'" in message


def test_engine_must_fit_the_role(tmp_path):
    message = error_of(write(tmp_path, GOOD.replace("actor_infer: {}", "actor_infer: {engine: megatron}")))
    assert "roles.actor_infer.engine: 'megatron' is not one of native, vllm" in message


def test_zero_stage_belongs_to_the_data_parallel_deepspeed_engine(tmp_path):
    path = write(tmp_path, GOOD)
    message = error_of(path, ["roles.actor_train.zero_stage=3"])
    assert "roles.actor_train.zero_stage: only the deepspeed engine shards with ZeRO" in message
    message = error_of(path, ["roles.actor_train.engine=deepspeed", "roles.actor_train.parallel.tp=2"])
    assert "roles.actor_train.parallel.tp: tp = 2, but the deepspeed engine is data parallel only" in message
    assert "roles.actor_train.zero_stage" in error_of(path, ["roles.actor_train.engine=deepspeed",
                                                             "roles.actor_train.zero_stage=4"])
    job = load_job(path, ["roles.actor_train.engine=deepspeed"])
    assert (job.zero_stage("actor_train"), job.zero_stage("actor_infer")) == (2, 0)
    assert "roles.actor_train.fsdp: FSDP2 is how the torch engine shards" in error_of(
        path, ["roles.actor_train.engine=deepspeed", "roles.actor_train.fsdp=true"])
    assert load_job(path, ["roles.actor_train.fsdp=true"]).zero_stage("actor_train") == 3


def test_overrides_are_typed_and_validated(tmp_path):
    path = write(tmp_path, GOOD)
    assert load_job(path, ["train.steps=7", "rollout.temperature=0.5"]).train.steps == 7
    assert "train.steps: expected a positive integer, got 'many'" in error_of(path, ["train.steps=many"])
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override("train.steps")
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}


def test_profile_validation(tmp_path):
    assert load_profile().name == "local"
    path = write(tmp_path, "name: x\nscheduler: slurm\nnodes: 1\ndevices_per_node: 4\ndevice: tpu\n"
                 "device_memory_gb: 8\n", "p.yaml")
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert "device: expected one of 'cpu', 'cuda', got 'tpu'" in str(info.value)


def test_shipped_jobs_and_profiles_load():
    for job in (REPO / "jobs").glob("*.yaml"):
        load_job(job)
    for profile in (REPO / "clusters").glob("*.yaml"):
        load_profile(profile)


def test_bad_job_fails_before_any_rank_starts(tmp_path):
    path = write(tmp_path, GOOD.replace("{dp: 2}", "{tp: two}"))
    result = hpcrl("run", str(path), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert result.returncode == 2
    assert "roles.actor_train.parallel.tp: expected a positive integer, got 'two'" in result.stderr
    assert not (tmp_path / "run").exists(), "no rank may start (nothing written) for an invalid job"


# ---- algorithm presets ------------------------------------------------------------------------

def test_a_preset_fills_what_the_job_leaves_out_and_the_job_wins(tmp_path):
    path = write(tmp_path, GOOD)
    gspo = load_job(path, ["algorithm.name=gspo"]).algorithm
    assert (gspo.policy_loss, gspo.clip_low, gspo.clip_high, gspo.loss_agg) == ("gspo", 3e-4, 4e-4,
                                                                               "seq-mean-token-mean")
    dapo = load_job(path, ["algorithm.name=dapo"]).algorithm
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling, dapo.overlong_shaping) == (
        0.2, 0.28, "token-mean", True, True)
    assert dapo.overlong_buffer(1000) == 200   # a fifth of rollout.max_new_tokens, unless set
    dr_grpo = load_job(path, ["algorithm.name=dr_grpo"]).algorithm
    assert (dr_grpo.normalize_std, dr_grpo.loss_agg) == (False, "seq-mean-token-sum-norm")
    assert load_job(path, ["algorithm.name=gspo", "algorithm.clip_high=1e-3"]).algorithm.clip_high == 1e-3
    assert load_job(path, ["algorithm.name=dapo", "algorithm.dynamic_sampling=false"]).algorithm.dynamic_sampling \
        is False


def test_each_preset_puts_its_kl_in_one_place_and_only_with_a_reference(tmp_path):
    path = write(tmp_path, GOOD + "  reference: {colocate_with: actor_train}\n")
    for name, where in (("grpo", "kl_loss"), ("reinforce_pp", "kl_in_reward"), ("rloo", "kl_in_reward")):
        algo = load_job(path, [f"algorithm.name={name}"]).algorithm
        other = "kl_in_reward" if where == "kl_loss" else "kl_loss"
        assert getattr(algo, where).coef > 0 and getattr(algo, other).coef == 0, name
    reinforce = load_job(path, ["algorithm.name=reinforce_pp"]).algorithm
    assert reinforce.kl_in_reward.estimator == "k1"
    # without a reference role a preset's KL is off; a job's own is refused
    alone = load_job(write(tmp_path, GOOD, "alone.yaml"), ["algorithm.name=grpo"]).algorithm
    assert alone.kl_loss.coef == 0
    message = error_of(write(tmp_path, GOOD, "alone.yaml"), ["algorithm.kl_in_reward.coef=0.1"])
    assert "algorithm.kl_in_reward.coef: 0.1 measures the KL to the reference policy" in message


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=gspo", "algorithm.dual_clip_c=3"],
     "algorithm: dual_clip_c applies to policy_loss ppo_clip, not 'gspo'"),
    (["algorithm.name=rloo", "algorithm.normalize_std=false"],
     "algorithm: normalize_std applies to advantage grpo or gigpo, not 'rloo'"),
    (["algorithm.lam=0.9"], "algorithm: lam applies to advantage gae, not 'grpo'"),
    (["algorithm.kl_coef=0.1"], "algorithm: kl_coef: the KL now goes in one of two places"),
    (["algorithm.dual_clip_c=1"], "dual_clip_c: 1.0 must exceed 1"),
    (["algorithm.name=grpo", "roles.critic.engine=torch"], "roles.critic: only algorithm.advantage gae uses a critic"),
    (["rollout.batching=lockstep", "roles.actor_infer.engine=vllm"],
     "rollout.batching: lockstep is the native sampler's baseline mode, and roles.actor_infer.engine is 'vllm'"),
    (["algorithm.advantage=gigpo"], "algorithm.advantage: gigpo compares the turns of env trajectories that acted "
                                    "from the same state; a job without an env section"),
    (["algorithm.step_advantage_weight=0.5"], "step_advantage_weight applies to advantage gigpo, not 'grpo'"),
])
def test_an_option_that_does_not_apply_is_refused_by_key(tmp_path, overrides, message):
    assert message in error_of(write(tmp_path, GOOD), overrides)


@pytest.mark.parametrize("overrides, message", [
    (["roles.actor_infer.engine=vllm"], "roles.actor_infer.engine: 'vllm': multi-turn rollout (env) runs on the "
                                        "native sampler"),
    (["algorithm.name=ppo", "roles.critic={engine: torch, colocate_with: actor_train}"],
     "algorithm.advantage: gae over multi-turn trajectories"),
    (["rollout.max_round_s=5"], "rollout.max_round_s: env rounds play every trajectory to its end"),
    (["eval.every=10"], "eval.every: evaluation replays prompts, and an env job has none"),
    (["env.chat=true"], "env.chat: the built-in character tokenizer has no chat template; set model.tokenizer"),
    (["env.max_tokens=1", "rollout.max_new_tokens=2"],
     "env.max_tokens: 1 is less than one turn's rollout.max_new_tokens = 2"),
    (["task={name: addition}"], "give exactly one of 'task' (a built-in task), 'datasets' (prompt files) or 'env'"),
])
def test_what_multi_turn_rollout_cannot_run_is_refused_by_key(overrides, message):
    assert message in error_of(REPO / "jobs" / "tiny_frozenlake.yaml", overrides)
