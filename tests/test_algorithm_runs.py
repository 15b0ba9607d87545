"""Every algorithm preset end to end through `hpcrl run`, and the wiring around the losses.

- each preset trains the tiny job (the real MPI world), with its KL where the preset puts it and
  nowhere else: the trainer reports a KL loss only for the presets that use one;
- PPO's critic trains beside the actor and resumes from a checkpoint exactly where it was;
- the train/inference mismatch correction acts at staleness 0 when asked, against a rollout whose
  behaviour log-probabilities are shifted on purpose (HPCRL_INJECT_BEHAVIOUR_SHIFT), and not otherwise.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import hpcrl

from hpcrl.config import load_job
from hpcrl.config.algorithms import PRESETS
from hpcrl.metrics import read_metrics
from hpcrl.ragged import Ragged

TINY = "jobs/tiny_grpo.yaml"
FAST = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false"]
CRITIC = ["--set", "roles.critic.engine=torch", "--set", "roles.critic.colocate_with=actor_train"]
PPO = ["--set", "algorithm.name=ppo", *CRITIC, "--set", "train.lr_schedule=constant"]   # lr not tied to train.steps
SHIFT = 0.5
PROMPT_PRESETS = [n for n in PRESETS if n not in ("ppo", "gigpo")]   # ppo needs a critic, gigpo an env's turns


def train(run_dir, steps: int, *extra: str, env: dict | None = None) -> list[dict]:
    result = hpcrl("run", TINY, "--run-dir", str(run_dir), "--set", f"train.steps={steps}", *FAST, *extra,
                   env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.parametrize("name", PROMPT_PRESETS)
def test_every_preset_trains_the_tiny_job_with_its_kl_in_one_place(tmp_path, name):
    metrics = train(tmp_path, 2, "--set", f"algorithm.name={name}")
    algo = load_job(TINY, [f"algorithm.name={name}"]).algorithm
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(m[k]) for k in ("loss", "reward_mean", "entropy")), m
        assert ("kl_loss" in m) == (algo.kl_loss.coef > 0), (name, m)   # the trainer's KL term
        assert m["kl_in_reward_coef"] == algo.kl_in_reward.coef            # the reward's
        assert not (algo.kl_loss.coef > 0 and algo.kl_in_reward.coef > 0), f"{name} counts the KL twice"


def test_ppo_trains_a_critic_and_resumes_it_where_it_was(tmp_path):
    straight = train(tmp_path / "straight", 3, *PPO)
    for m in straight:
        assert {"value_loss", "vf_clipfrac", "value_mean", "critic_grad_norm"} <= m.keys(), m
        assert "kl_loss" not in m and m["kl_in_reward_coef"] > 0   # PPO's KL is in the reward
    # the value head starts at 0 (every value 0): values that moved are the critic's training
    assert straight[-1]["value_mean"] != 0.0 and straight[-1]["critic_grad_norm"] > 0
    resumed_dir = tmp_path / "resumed"
    train(resumed_dir, 2, *PPO, "--set", "checkpoint.every=2")
    assert (resumed_dir / "checkpoints" / "step-2" / "critic").is_dir()
    resumed = train(resumed_dir, 3, *PPO, "--set", "checkpoint.every=2")
    for key in ("value_loss", "value_mean", "loss", "reward_mean"):
        assert resumed[-1][key] == straight[-1][key], key   # the critic's weights and Adam state came back


def test_the_critic_warms_up_before_the_actor_trains(tmp_path):
    metrics = train(tmp_path, 2, *PPO, "--set", "algorithm.critic_warmup_steps=1")
    assert "value_loss" in metrics[0] and "loss" not in metrics[0], "step 1 trains the critic alone"
    assert "loss" in metrics[1]


def test_the_mismatch_correction_weights_fresh_samples_when_asked(tmp_path):
    shifted = {"HPCRL_INJECT_BEHAVIOUR_SHIFT": str(SHIFT)}
    on = train(tmp_path / "on", 2, "--set", "rollout.mismatch_correction=true", "--set", "rollout.is_correction=tis",
               env=shifted)
    for m in on:
        assert m["staleness_max"] == 0, "fresh samples only"
        assert m["rollout_logprob_gap_max"] == pytest.approx(SHIFT, abs=1e-3)
        # pi_old / pi_behaviour = exp(-shift) on every token, under the cap of 10
        assert m["is_weight_mean"] == pytest.approx(math.exp(-SHIFT), rel=1e-3)
    # unset: the native sampler is the trainer's own code, so fresh samples are not corrected (their
    # log-probs recomputed, as asked, show the shift)
    auto = train(tmp_path / "auto", 1, "--set", "rollout.recompute_logprobs=always", env=shifted)
    assert "is_weight_mean" not in auto[0] and auto[0]["rollout_logprob_gap_max"] == pytest.approx(SHIFT, abs=1e-3)


# ---- the same wiring without a world ------------------------------------------------------------

def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, 8)
    rows = [rng.normal(-1.0, 0.3, n).astype(np.float32) for n in lengths]
    old = Ragged.from_rows(rows, np.float32)
    ref = old.with_values(old.values - rng.uniform(0.0, 0.5, len(old.values)).astype(np.float32))
    rewards = rng.integers(0, 2, 8).astype(np.float64)
    return old, ref, rewards, np.repeat(np.arange(2), 4)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_the_kl_in_the_reward_takes_each_responses_summed_kl_from_its_reward(advantage):
    """Sequence-level estimators see a response's reward less its summed KL (k1 here: old - ref),
    as verl's token-level reward summed; the token-level one's first token carries every later
    token's penalty (gamma 1) and the reward. Both from formulas written out here."""
    from hpcrl.runtime.advantages import token_advantages

    algo = load_job(TINY, [f"algorithm.advantage={advantage}", "algorithm.kl_in_reward.estimator=k1"]).algorithm
    old, ref, rewards, groups = _batch(3)
    found = token_advantages(algo, rewards, groups, old, ref, None, 0.1)
    kl = [o.astype(np.float64) - r for o, r in zip(old, ref)]
    reward = rewards - 0.1 * np.array([k.sum() for k in kl])
    assert found.sequence_kl == pytest.approx(np.mean([k.sum() for k in kl]), rel=1e-5)
    advantages = found.columns["advantages"]
    for group in (0, 1):
        rows = np.flatnonzero(groups == group)
        mine = reward[rows]
        if advantage == "grpo":
            expected = (mine - mine.mean()) / (mine.std(ddof=1) + 1e-6)
        elif advantage == "rloo":
            expected = mine - (mine.sum() - mine) / (len(mine) - 1)
        else:
            continue
        for row, value in zip(rows, expected):
            np.testing.assert_allclose(advantages[row], value, rtol=1e-5, atol=1e-6)
    if advantage == "reinforce_pp":   # returns, before its batch whitening: their order is the reward's
        firsts = np.array([a[0] for a in advantages])
        assert np.array_equal(np.argsort(firsts, kind="stable"), np.argsort(reward, kind="stable"))


@pytest.mark.parametrize("name", PROMPT_PRESETS)
def test_the_reward_carries_the_kl_only_for_presets_that_put_it_there(name):
    from hpcrl.runtime.advantages import token_advantages

    algo = load_job(TINY, [f"algorithm.name={name}"]).algorithm
    old, ref, rewards, groups = _batch()
    with_ref = token_advantages(algo, rewards, groups, old, ref, None, algo.kl_in_reward.coef)
    without = token_advantages(algo, rewards, groups, old, None, None, algo.kl_in_reward.coef)
    moved = not np.allclose(with_ref.columns["advantages"].values, without.columns["advantages"].values, atol=1e-7)
    assert moved == (algo.kl_in_reward.coef > 0), name
    assert with_ref.sequence_kl > 0



@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
def test_the_logged_kl_uses_the_estimator_of_the_kl_the_preset_applies(name):
    """RLOO and REINFORCE++ put a k1 KL in the reward and none in the loss: their `kl` metric is
    k1's, not the unused loss's k3; GRPO's KL loss logs its k3."""
    from hpcrl.runtime.advantages import logged_kl_estimator

    algo = load_job(TINY, [f"algorithm.name={name}"]).algorithm
    assert logged_kl_estimator(algo) == {"grpo": "k3", "rloo": "k1", "reinforce_pp": "k1"}[name]


@pytest.mark.parametrize("name", ["reinforce_pp", "grpo"])
def test_observation_tokens_carry_no_kl_and_no_reward_into_the_advantages(name):
    """An env's trajectory: what the reference thinks of the observation tokens (loss mask 0) moves
    neither the KL in the reward nor the advantages of the generated tokens; the reward sits on the
    last generated token even when an observation ends the response."""
    from hpcrl.runtime.advantages import mean_kl, token_advantages

    algo = load_job(TINY, [f"algorithm.name={name}", "algorithm.kl_in_reward.coef=0.1",
                           "algorithm.kl_loss.coef=0"]).algorithm
    old, ref, rewards, groups = _batch()
    mask = old.with_values((np.arange(len(old.values)) % 3 != 1).astype(np.float32))
    mask.values[old.offsets[1:] - 1] = 0   # every response ends with an observation token
    observed = ~mask.values.astype(bool)
    other_ref = ref.with_values(np.where(observed, ref.values - 3.0, ref.values).astype(np.float32))
    runs = [token_advantages(algo, rewards, groups, old, r, None, 0.1, mask) for r in (ref, other_ref)]
    generated = ~observed
    assert np.array_equal(runs[0].columns["advantages"].values[generated],
                          runs[1].columns["advantages"].values[generated])
    assert runs[0].sequence_kl == runs[1].sequence_kl
    assert mean_kl(old, ref, "k1", mask) == mean_kl(old, other_ref, "k1", mask)
    if name == "reinforce_pp":   # the reward reaches the generated tokens despite the trailing observation
        alone = token_advantages(algo, rewards, groups, old, None, None, 0.0, mask).columns["advantages"]
        assert np.abs(alone.values[generated]).max() > 0


def test_the_objective_adds_a_kl_loss_only_when_the_preset_has_one():
    from hpcrl.engines.batch import length_mask, right_pad
    from hpcrl.engines.objective import policy_objective

    old, ref, _, _ = _batch()
    mask = length_mask(old.lengths)
    columns = {"old_logprobs": right_pad(old, 0.0, torch.float32), "ref_logprobs": right_pad(ref, 0.0, torch.float32),
               "advantages": torch.ones_like(mask)}
    for name in ("grpo", "reinforce_pp"):
        job = load_job(TINY, [f"algorithm.name={name}", "algorithm.entropy_coef=0"])
        logp = columns["old_logprobs"].clone().requires_grad_()
        _, metrics = policy_objective(logp, None, columns, mask, job, float(mask.sum()), len(mask))
        assert ("kl_loss" in metrics) == (name == "grpo"), name


def test_actor_reference_and_critic_all_on_deepspeed_share_their_ranks(tmp_path):
    """Three DeepSpeed roles colocated whole: one DeepSpeed world on the ranks, and the frozen
    reference kept whole (ZeRO-1/2 have no optimizer state of it to shard)."""
    pytest.importorskip("deepspeed")
    metrics = train(tmp_path, 2, "--set", "algorithm.name=ppo", "--set", "roles.critic.engine=deepspeed",
                    "--set", "roles.critic.zero_stage=3", "--set", "roles.critic.colocate_with=actor_train",
                    "--set", "roles.actor_train.engine=deepspeed", "--set", "roles.actor_train.zero_stage=3",
                    "--set", "roles.reference.engine=deepspeed")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["value_loss"] > 0 for m in metrics)
    assert metrics[-1]["sequence_kl"] > 0, "the reference stays the initial policy while the actor moves"


def test_gigpo_finds_the_turns_and_states_in_the_tokens_and_rewards_each_turns_actions():
    """Turns are the runs of generated tokens; a turn's state is the group's prompt (first turn) or the
    observation before it, equal only within a group. Each turn's advantage lands on its actions."""
    from hpcrl.runtime.advantages import token_advantages
    from hpcrl.runtime.turns import Turns

    prompts = Ragged.from_rows([np.array([1, 5])] * 3, np.int32)
    # sample 0 sees the observation (9, 9) twice: turns 1 and 2 act from one state; samples 0 and 1
    # start from the same prompt in group 0; sample 2 has sample 1's tokens but is group 1's
    responses = Ragged.from_rows([np.array([7, 9, 9, 8, 9, 9, 7]), np.array([8, 9, 9, 8]),
                                  np.array([8, 9, 9, 8])], np.int32)
    masks = Ragged.from_rows([np.array([1, 0, 0, 1, 0, 0, 1]), np.array([1, 0, 0, 1]), np.array([1, 0, 0, 1])],
                             np.float32)
    groups = np.array([0, 0, 1])
    turns = Turns.of(prompts, responses, masks, torch.as_tensor(groups))
    assert turns.mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0]]
    s = turns.states
    assert s[0, 1] == s[0, 2] == s[1, 1] and s[0, 0] == s[1, 0]
    assert len({int(s[0, 0]), int(s[0, 1]), int(s[2, 0]), int(s[2, 1])}) == 4
    assert turns.token_turn.tolist() == [[0, -1, -1, 1, -1, -1, 2], [0, -1, -1, 1, -1, -1, -1],
                                         [0, -1, -1, 1, -1, -1, -1]]
    # an env whose observation is not its state: sample 0's turns 1 and 2 saw (9, 9) after other
    # histories, so they are other states; samples 0 and 1 share turn 1's history (7 vs 8: no)
    history = Turns.of(prompts, responses, masks, torch.as_tensor(groups), history=True).states
    assert history[0, 0] == history[1, 0] and len({int(history[0, 1]), int(history[0, 2]), int(history[1, 1])}) == 3
    same_start = Ragged.from_rows([np.array([7, 9, 9, 8]), np.array([7, 9, 9, 7])], np.int32)
    shared = Turns.of(prompts.slice(0, 2), same_start, masks.slice(1, 3), torch.as_tensor([0, 0]), history=True)
    assert shared.states[0, 1] == shared.states[1, 1], "the same history is the same state"

    algo = load_job("jobs/tiny_frozenlake.yaml", ["algorithm.name=gigpo", "algorithm.kl_loss.coef=0"]).algorithm
    turn_rewards = Ragged.from_rows([np.array([0, 0, 0, 0, 0, 0, 1]), np.zeros(4), np.array([0, 0, 0, 1])],
                                    np.float32)
    old = responses.with_values(np.full(len(responses.values), -1.0, np.float32))
    rewards = np.array([1.0, 0.0, 1.0])
    found = token_advantages(algo, rewards, groups, old, None, None, 0.0, masks, turn_rewards, prompts, responses)
    advantages = found.columns["advantages"]
    for row in range(3):
        assert (advantages[row][np.asarray(masks[row]) == 0] == 0).all(), "observations get no advantage"
    # group 0, gamma 0.95: episode 1 vs 0 -> +-1/sqrt2. Returns: sample 0 (0.9025, 0.95, 1), sample 1 (0, 0).
    # The prompt's turns compare 0.9025 with 0: +-1/sqrt2. The state (9, 9)'s three turns 0.95, 1, 0:
    # mean 0.65, unbiased std sqrt(0.3175) -> 0.5324, 0.6211, -1.1536. Sample 2 is alone in group 1: 0.
    h = 1 / np.sqrt(2)
    std = np.sqrt(0.3175)
    assert np.allclose(advantages[0][[0, 3, 6]], [2 * h, h + 0.3 / std, h + 0.35 / std], atol=1e-4)
    assert np.allclose(advantages[1][[0, 3]], [-2 * h, -h - 0.65 / std], atol=1e-4)
    assert np.allclose(advantages[2], 0.0)
