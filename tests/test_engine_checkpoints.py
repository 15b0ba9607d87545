"""Every sharding training engine checkpoints and resumes inside the runtime, bit for bit.

A rank is killed in step 3; the run restarts from step 2's checkpoint (the engine's own model and
optimizer state) and must end with the weights and rewards of a run that was never interrupted.
The torch engine with DDP has the same test in test_recovery.py. The engines run on CPU over gloo.
Megatron trains a mixture-of-experts model with expert parallelism (ep = 2 over its 2 ranks): its
files hold each EP rank's experts, and the dense and the expert optimizer state resume alike.
PPO's critic warm-up makes checkpoints of an actor whose optimizer has never stepped: they must
save, resume, and leave its first update as it would be without them.
"""
from __future__ import annotations

import importlib.util

import pytest
from conftest import REPO, hpcrl

from hpcrl.metrics import read_metrics

ENGINES = {  # name -> (the module its extra installs, the job overrides)
    "torch-fsdp2": ("torch", ["roles.actor_train.fsdp=true"]),
    "megatron-moe-ep2": ("megatron", ["roles.actor_train.engine=megatron", "roles.reference.engine=megatron",
                                      "roles.actor_train.parallel.ep=2", "model.arch=qwen2_moe", "model.num_experts=4",
                                      "model.moe_intermediate_size=32"]),
    "deepspeed-zero2": ("deepspeed", ["roles.actor_train.engine=deepspeed", "roles.actor_train.zero_stage=2"]),
    "deepspeed-zero3": ("deepspeed", ["roles.actor_train.engine=deepspeed", "roles.actor_train.zero_stage=3"]),
}
SMALL = ["train.steps=4", "train.prompts_per_step=4", "algorithm.group_size=4", "log.tensorboard=false",
         "log.check_weights=true", "checkpoint.every=2"]
KILL_IN_STEP_3 = {"HPCRL_INJECT_FAULT": "2:train_step:3:exit"}   # rank 2 exits in its 3rd train_step call
# steps 1 and 2 train the critic alone; step 3 is the actor's first update
WARMUP = ["algorithm.name=ppo", "algorithm.critic_warmup_steps=2", "roles.critic.engine=torch",
          "roles.critic.colocate_with=actor_train", "train.steps=3"]


def run(run_dir, overrides: list[str], *extra: str, **kwargs):
    sets = [x for o in SMALL + overrides for x in ("--set", o)]
    return hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), *sets, *extra, timeout=400, **kwargs)


def skip_without(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install hpcrl[{module}])")


def one_restart(tmp_path) -> list[str]:
    """The local cluster with one automatic restart, as `hpcrl run` arguments."""
    profile = tmp_path / "local-restarts.yaml"
    profile.write_text((REPO / "clusters" / "local.yaml").read_text().replace("max_restarts: 0", "max_restarts: 1"))
    return ["--cluster", str(profile)]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_rank_resumes_from_the_engines_checkpoint_bit_for_bit(tmp_path, engine):
    module, overrides = ENGINES[engine]
    skip_without(module)
    straight = run(tmp_path / "straight", overrides)
    assert straight.returncode == 0, straight.stderr[-4000:]
    killed = run(tmp_path / "killed", overrides, *one_restart(tmp_path), env=KILL_IN_STEP_3)
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "restart 1 of 1" in killed.stderr and "step-2 (step 2)" in killed.stderr
    resumed, uninterrupted = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("killed", "straight"))
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert [m["reward_mean"] for m in resumed] == [m["reward_mean"] for m in uninterrupted]
    assert resumed[-1]["digest_actor_train"] == uninterrupted[-1]["digest_actor_train"]
    assert len(set(resumed[-1]["digest_actor_train"] + resumed[-1]["digest_actor_infer"]) - {None}) == 1


def test_a_megatron_checkpoint_inside_the_critic_warmup_changes_nothing_the_actor_learns(tmp_path):
    """Steps 1 and 2 save the actor's never-stepped optimizer (megatron-core has no state yet), the
    rank dies in step 3 (call 3 of train_step: the critic's are 1 and 2) and resumes from step 2: the
    actor's first update must match that of a run whose first checkpoint comes after it. The torch
    engines' case: test_checkpoint.py::test_saving_a_never_stepped_optimizer_changes_nothing_it_learns."""
    skip_without("megatron")
    overrides = ["roles.actor_train.engine=megatron", "roles.reference.engine=megatron"]
    straight = run(tmp_path / "straight", overrides + WARMUP + ["checkpoint.every=3"])
    assert straight.returncode == 0, straight.stderr[-4000:]
    killed = run(tmp_path / "killed", overrides + WARMUP + ["checkpoint.every=1"], *one_restart(tmp_path),
                 env=KILL_IN_STEP_3)
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "restart 1 of 1" in killed.stderr and "step-2 (step 2)" in killed.stderr
    resumed, uninterrupted = (read_metrics(tmp_path / d / "metrics.jsonl")[-1] for d in ("killed", "straight"))
    for key in ("step", "loss", "grad_norm", "digest_actor_train"):
        assert resumed[key] == uninterrupted[key], key
