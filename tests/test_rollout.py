"""The rollout scheduler: lifecycle, the staleness bound, dynamic sampling, and K=0 == synchronous."""
from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean

import numpy as np
import pytest
import torch
from conftest import REPO, hpcrl, random_files

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer, DomainSampler, load_prompts
from hpcrl.metrics import read_metrics
from hpcrl.ragged import Ragged
from hpcrl.rollout.lifecycle import Group, LifecycleError, SampleState
from hpcrl.rollout.scheduler import Round, RolloutScheduler, StalenessError
from hpcrl.runtime.scoring import Scorer


def job(*overrides: str):
    return load_job(REPO / "jobs" / "tiny_grpo.yaml",
                    ["train.prompts_per_step=2", "algorithm.group_size=2", "train.steps=10", *overrides])


def scheduler(*overrides: str) -> RolloutScheduler:
    config = job(*overrides)
    return RolloutScheduler(config, DomainSampler(load_prompts(config, CharTokenizer())[0], seed=1),
                            CharTokenizer().encode)


def finish(s: RolloutScheduler, round_: Round, rewards: list[float]) -> list[Group]:
    """Every response of the round ends with [5, 2]; the finished groups get `rewards` (in order)."""
    n = len(round_.samples)
    done = s.finish_round(round_, Ragged.from_rows([[5, 2]] * n, np.int32),
                          Ragged.from_rows([[-1.0, -0.5]] * n, np.float32), np.ones(n, dtype=bool))
    s.rewarded(done, np.array(rewards[:len(done) * 2]))
    return groups_of(round_)


def groups_of(round_: Round) -> list[Group]:
    return list({id(g): g for g, _ in round_.samples}.values())


def test_lifecycle_allows_only_forward_moves():
    group = Group(0, 1, np.array([1], np.int32), "7", 2, "addition")
    group.start(0)
    group.move(SampleState.REWARDED)
    group.move(SampleState.CONSUMED)
    with pytest.raises(LifecycleError, match="consumed -> generating"):
        group.move(SampleState.GENERATING)
    with pytest.raises(LifecycleError, match="queued -> rewarded"):
        Group(1, 1, np.array([1], np.int32), "7", 2, "addition").move(SampleState.REWARDED)


def test_production_waits_for_weights_within_the_bound():
    s = scheduler("rollout.max_staleness=0")
    first = s.next_round(rollout_version=0)
    groups = groups_of(first)
    assert (first.batch, first.index, len(groups)) == (1, 0, 2)
    assert all(g.state is SampleState.GENERATING for g in groups)
    assert s.next_round(rollout_version=0) is None, "batch 1 has all its groups on their way"
    finish(s, first, [1.0, 0.0, 0.5, 0.0])
    s.take(1)
    assert s.next_round(rollout_version=0) is None, "with K=0 batch 2 needs the weights of step 1"
    assert s.next_round(rollout_version=1).batch == 2


def test_a_cut_round_continues_its_unfinished_responses_first_and_keeps_the_oldest_version():
    s = scheduler("rollout.max_staleness=1", "rollout.max_new_tokens=5", "train.steps=1")   # no batch 2 to start
    first = s.next_round(rollout_version=0)
    rows = first.prompts(lambda g: 5)
    assert rows["budgets"].tolist() == [5] * 4
    done = s.finish_round(first, Ragged.from_rows([[5, 2], [6], [7, 7], [2]], np.int32),
                          Ragged.from_rows([[-1.0, -0.5], [-2.0], [-0.1, -0.2], [-0.3]], np.float32),
                          np.array([True, False, False, True]))
    assert done == [], "no group has all its responses ended"
    second = s.next_round(rollout_version=1)
    assert [(g.group_id, i) for g, i in second.samples] == [(0, 1), (1, 0)], "only the unfinished ones"
    rows = second.prompts(lambda g: 5)
    prompt = groups_of(first)[0].prompt_ids.tolist()
    assert rows["prompt_ids"][0].tolist() == prompt + [6] and rows["budgets"].tolist() == [4, 3]
    done = s.finish_round(second, Ragged.from_rows([[2], [8, 2]], np.int32),
                          Ragged.from_rows([[-0.7], [-0.8, -0.9]], np.float32), np.array([True, True]))
    assert [g.group_id for g in done] == [0, 1]
    assert done[0].response_ids[1].tolist() == [6, 2] and done[0].behaviour_logprobs[1].tolist() == \
        pytest.approx([-2.0, -0.7])
    assert all(g.version == 0 for g in done), "a response begun with version 0 counts as version 0"
    assert done[0].token_versions[1].tolist() == [0, 1], "each token keeps the version that sampled it"
    assert done[0].token_versions[0].tolist() == [0, 0]


def test_production_balances_consumption_and_never_redoes_a_taken_batch():
    """K=2: version 0 may produce batches 1 to 3. The first round starts batch 1 and, in the slots
    its responses leave free, batch 2 (per-sample hand-out), and ends once batch 1's rows have."""
    s = scheduler("rollout.max_staleness=2")
    first = s.next_round(0)
    assert first.batch == 1 and [g.batch for g in groups_of(first)] == [1, 1, 2, 2]
    assert first.prompts(lambda g: 3)["needed"].tolist() == [True] * 4 + [False] * 4
    finish(s, first, [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.5, 0.0])
    assert s.next_round(0) is None, "batches 1 and 2 are ready and untaken: rollout waits for training"
    s.take(1)                                   # training on batch 1 (policy 0 -> 1) starts
    third = s.next_round(0)
    assert third.batch == 3 and "needed" not in third.prompts(lambda g: 3), "batch 3 alone, generated while step 1 trains"
    assert s.take(2)[1]["staleness_max"] == 1
    with pytest.raises(RuntimeError, match="out of turn"):
        s.take(2)


def test_a_batch_is_settled_once_its_responses_end_unless_rewards_decide_its_groups():
    """The controller sends a batch's log-prob calls when `settled` gives its groups, before their
    scores: they must be the groups `take` then gives, in its order; never the wrong ones."""
    s = scheduler("rollout.max_staleness=1", "rollout.max_new_tokens=5", "train.steps=2")
    first = s.next_round(0)   # batch 1, and batch 2 in the slots its rows leave free
    cut = np.array([True, True, True, True, True, False, True, True])   # one of batch 2's responses runs on
    done = s.finish_round(first, Ragged.from_rows([[5, 2]] * 8, np.int32),
                          Ragged.from_rows([[-1.0, -0.5]] * 8, np.float32), cut)
    assert s.settled(2) is None, "not the next batch"
    settled = s.settled(1)
    assert [g.group_id for g in settled] == [0, 1] and all(g.state is SampleState.GENERATING for g in settled)
    s.rewarded(done, np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.0]))
    assert s.take(1)[0] == settled
    assert s.settled(2) is None, "a response of batch 2 has not ended"
    second = s.next_round(1)
    s.finish_round(second, Ragged.from_rows([[2]], np.int32), Ragged.from_rows([[-0.3]], np.float32), np.ones(1, bool))
    assert [g.group_id for g in s.settled(2)] == [2, 3]
    dynamic = scheduler("algorithm.dynamic_sampling=true")
    round_ = dynamic.next_round(0)
    dynamic.finish_round(round_, Ragged.from_rows([[5, 2]] * 4, np.int32), Ragged.from_rows([[-1.0, -0.5]] * 4,
                         np.float32), np.ones(4, bool))
    assert dynamic.settled(1) is None, "dynamic sampling picks the batch's groups by their rewards"


def test_take_checks_every_sample_against_the_bound():
    s = scheduler("rollout.max_staleness=1")
    first = s.next_round(0)
    finish(s, first, [1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 0.5, 0.0])
    taken, stats = s.take(1)
    assert [g.state for g in taken] == [SampleState.CONSUMED] * 2 and stats["staleness_max"] == 0
    assert stats["queue_depth"] == 4 and s.buffer()["batch"].tolist() == [2] * 4, "batch 2 is waiting"
    groups_of(first)[2].version = -1  # pretend it was generated two versions before step 2's policy
    with pytest.raises(StalenessError, match="2 versions behind"):
        s.take(2)


def test_dynamic_sampling_never_trains_on_a_zero_variance_group():
    s = scheduler("algorithm.dynamic_sampling=true")
    groups = finish(s, s.next_round(0), [1.0, 1.0, 0.0, 1.0])     # the first group has equal rewards
    assert groups[0].state is SampleState.FILTERED and not s.ready(1)
    again = s.next_round(0)
    refill = groups_of(again)
    assert again.index == 1 and s.attempts[1] == 2 and len(refill) == 2, "a refill round is a full round"
    finish(s, again, [0.0, 0.5, 1.0, 0.0])
    assert refill[1].state is SampleState.ABORTED, "the batch was full without it"
    taken, _ = s.take(1)
    assert [g.group_id for g in taken] == [groups[1].group_id, refill[0].group_id]
    assert all(len(set(g.rewards)) > 1 for g in taken)


def test_dynamic_sampling_judges_a_group_on_its_answers_not_on_the_length_penalty_dapo_adds():
    """DAPO keeps a group when 0 < #correct < G: a group whose answers are all wrong, where one
    response ran into the overlong buffer, has rewards that differ only by the penalty; GRPO would
    turn that spread into full-size advantages of a pure length signal."""
    tokenizer = CharTokenizer()
    s = scheduler("algorithm.name=dapo", "rollout.max_new_tokens=10")
    round_ = s.next_round(0)
    first, second = groups_of(round_)
    short, long = tokenizer.encode("+", add_bos=False), tokenizer.encode("+" * 9, add_bos=False)   # wrong, cut
    rows = [short, long, tokenizer.encode(second.answer, add_bos=False) + [tokenizer.eos_token_id], long]
    responses = Ragged.from_rows(rows, np.int32)
    done = s.finish_round(round_, responses, Ragged.from_rows([[-0.5] * len(r) for r in rows], np.float32),
                          np.ones(4, bool))
    scorer = Scorer(s.job, tokenizer, None, None)
    pending = scorer.start(Ragged.from_rows([g.prompt_ids for g in done for _ in range(2)], np.int32), responses,
                           [g.answer for g in done for _ in range(2)], [g.domain for g in done for _ in range(2)])
    rewards, codes, outcomes = scorer.finish(pending, responses)
    assert rewards[0] != rewards[1] and outcomes[0] == outcomes[1], "the penalty alone separates the first group"
    s.rewarded(done, rewards, codes, outcomes)
    assert (first.state, second.state) == (SampleState.FILTERED, SampleState.REWARDED)
    assert second.rewards.tolist() == rewards[2:].tolist(), "the kept group trains on the shaped rewards"


def test_dynamic_sampling_out_of_refills_trains_the_short_batch_split_evenly_over_the_trainer():
    """4 groups of 2 per step over dp 2 x 2 minibatches: a short batch holds an even number of
    groups (4 samples). After the first round and one refill 3 groups have varied rewards: the
    step trains on 2, and says so."""
    s = scheduler("algorithm.dynamic_sampling=true", "rollout.max_refills=1", "train.prompts_per_step=4")
    first = finish(s, s.next_round(0), [1.0, 0.0] + [1.0] * 6)          # one group survives
    assert not s.ready(1)
    refill = finish(s, s.next_round(0), [0.0, 1.0, 1.0, 0.0] + [1.0] * 4)   # two more
    assert s.ready(1) and s.next_round(0) is None, "out of refills: no third round"
    taken, stats = s.take(1)
    assert [g.group_id for g in taken] == [first[0].group_id, refill[0].group_id] and stats["batch_groups"] == 2
    assert refill[1].state is SampleState.ABORTED, "an odd group would leave one replica a sample short"


def test_dynamic_sampling_gives_up_with_a_clear_error_when_nothing_can_be_trained():
    s = scheduler("algorithm.dynamic_sampling=true", "rollout.max_refills=1")
    for _ in range(2):
        finish(s, s.next_round(0), [1.0] * 4)
    with pytest.raises(RuntimeError, match="0 groups with varied rewards after 2 rounds.*rollout.max_refills"):
        s.next_round(0)


def test_the_buffer_round_trips_through_a_checkpoint():
    s = scheduler("rollout.max_staleness=1", "algorithm.dynamic_sampling=false", "train.steps=2")
    first = s.next_round(0)   # batches 1 and 2; one response of batch 2 is cut, still running at the save
    groups = groups_of(first)
    done = s.finish_round(first, Ragged.from_rows([[5, 2]] * 4 + [[5, 2], [6], [7, 2], [2]], np.int32),
                          Ragged.from_rows([[-1.0, -0.5]] * 4 + [[-1.0, -0.5], [-2.0], [-0.1, -0.2], [-0.3]],
                                           np.float32), np.array([True] * 5 + [False, True, True]),
                          routed_experts=Ragged.from_rows([[row, 3] * 2 for row in range(8)], np.uint8))
    assert done == [groups[0], groups[1], groups[3]]
    s.rewarded(done, np.array([1.0, 0.0, 0.5, 0.0, 0.5, 0.0]), outcomes=np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0]))
    s.take(1)
    restored = scheduler("rollout.max_staleness=1", "algorithm.dynamic_sampling=false", "train.steps=2")
    restored.restore(1, s.buffer(), s.next_group_id, dict(s.attempts), dict(s.rounds))

    def state(g: Group):
        return (g.group_id, g.state, g.version, g.answer, g.prompt_ids.tolist(), [r.tolist() for r in g.response_ids],
                [lp.tolist() for lp in g.behaviour_logprobs], [v.tolist() for v in g.token_versions],
                g.finished.tolist(), None if g.rewards is None else g.rewards.tolist(),
                None if g.outcomes is None else g.outcomes.tolist(), [r.tolist() for r in g.routed_experts])

    assert [state(g) for g in restored.groups.values()] == [state(g) for g in s.groups.values()]
    assert restored.rounds == s.rounds and restored.next_group_id == s.next_group_id
    assert [(g.group_id, i) for g, i in restored.next_round(1).samples] == [(2, 1)], "the cut response goes on"
    assert groups[0].state is SampleState.CONSUMED


FAST = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false"]


@pytest.mark.parametrize("correction", ["tis", "ppo"])
def test_async_run_never_exceeds_the_staleness_bound(tmp_path, correction):
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path), "--set", "train.steps=8",
                   "--set", "rollout.max_staleness=2", "--set", f"rollout.is_correction={correction}",
                   *FAST, timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 9))
    # The controller checks every consumed sample (StalenessError otherwise); the log agrees.
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert any(m["staleness_max"] > 0 for m in metrics), "rollout really ran ahead of training"
    assert all(sum(v for k, v in m.items() if k.startswith("staleness_") and k != "staleness_max") == 32
               for m in metrics)
    # The trainer recomputes the old log-probs only where something reads them: tis takes the ratio
    # against the trainer's policy on stale samples; ppo against the sampler's, which on fresh ones
    # is the trainer's own (rollout.recompute_logprobs auto)
    recomputed = ["rollout_logprob_gap_max" in m for m in metrics]
    assert recomputed == ([m["staleness_max"] > 0 for m in metrics] if correction == "tis" else [False] * 8)


def reference_synchronous_run(config, steps: int, directory: Path) -> list[float]:
    """The synchronous pipeline written out plainly in one process: generate, score, the reference's
    logprobs, advantages, train, copy the weights. The old log-probs are the sampler's (the native
    sampler runs the trainer's modules on its fp32 weights: rollout.recompute_logprobs auto).
    Returns reward_mean per step and the final digest."""
    from hpcrl.engines.lr_schedule import learning_rate
    from hpcrl.engines.model_files import load_full
    from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
    from hpcrl.engines.torch_trainer import Samples, TorchTrainer
    from hpcrl.rewards import reward_specs, score_batch
    from hpcrl.runtime.advantages import token_advantages
    from hpcrl.runtime.roles import sample_generator
    from hpcrl.engines.digests import weights_digest

    torch.set_num_threads(1)
    tok = CharTokenizer()
    files = random_files(config, tok, directory)
    actor = TorchTrainer(files, config, tok.pad_token_id, None)
    ref = TorchTrainer(files, config, tok.pad_token_id, None, trainable=False)
    rollout = NativeSampler(load_full(files, config.model.dtype), tok.stop_token_ids, tok.pad_token_id)
    r = config.rollout
    params = SamplingParams(r.max_new_tokens, r.temperature, r.top_p, r.top_k)
    sampler = DomainSampler(load_prompts(config, tok)[0], config.seed)
    size, rewards_per_step = config.algorithm.group_size, []
    for step in range(1, steps + 1):
        prompts = sampler.next_batch(config.train.prompts_per_step)
        prompt_ids = Ragged.from_rows([tok.encode(p.text) for p in prompts for _ in range(size)], np.int32)
        answers = [p.answer for p in prompts for _ in range(size)]
        generation = rollout.generate(prompt_ids, params, sample_generator(config.seed, step, 0))
        responses, old = generation.response_ids, generation.logprobs
        rewards, _ = score_batch(tok, responses, answers, [p.domain for p in prompts for _ in range(size)],
                                 reward_specs(config))
        reference = ref.logprobs(prompt_ids, responses)
        advantages = token_advantages(config.algorithm, rewards, np.arange(len(rewards)) // size, old, reference,
                                      None, config.algorithm.kl_in_reward.coef).columns["advantages"]
        actor.train_step(Samples(prompt_ids, responses, {"old_logprobs": old, "ref_logprobs": reference,
                                                        "advantages": advantages}),
                          learning_rate(config.train, step))
        rollout.load_weights(list(actor.named_weights()))
        rewards_per_step.append(fmean(rewards))
    return rewards_per_step, weights_digest(actor.named_weights())


def test_k0_reproduces_the_synchronous_pipeline_exactly(tmp_path):
    overrides = ["train.steps=4", "rollout.max_staleness=0", "roles.actor_train.parallel.dp=1",
                 "train.prompts_per_step=8", "algorithm.group_size=4", "log.tensorboard=false",
                 "log.check_weights=true"]
    result = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(tmp_path),
                   *[x for o in overrides for x in ("--set", o)], timeout=300)
    assert result.returncode == 0, result.stderr
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    rewards, digest = reference_synchronous_run(load_job(REPO / "jobs" / "tiny_grpo.yaml", overrides), 4,
                                                tmp_path / "reference")
    assert [m["reward_mean"] for m in metrics] == rewards
    assert metrics[-1]["digest_actor_train"] == [digest]


def test_stale_samples_are_corrected_as_rollout_is_correction_says():
    from hpcrl.runtime.off_policy import off_policy_columns
    old = Ragged.from_rows([[-0.1, -2.0], [-1.0]], np.float32)
    behaviour = Ragged.from_rows([[-0.2, -0.5], [-4.0]], np.float32)
    stale = np.ones(3, dtype=bool)
    # ppo: the loss's ratio is taken against the policy that sampled; no separate weight.
    ppo = off_policy_columns(job("rollout.is_correction=ppo").rollout, old, behaviour, stale)
    assert list(ppo) == ["old_logprobs"] and ppo["old_logprobs"].equals(behaviour)
    # tis: the ratio stays against the recomputed policy; each token gets min(pi_old / pi_behaviour, cap).
    weights = off_policy_columns(job("rollout.is_correction=tis", "rollout.is_cap=5").rollout, old, behaviour, stale)
    assert list(weights) == ["importance_weights"]
    assert weights["importance_weights"].lengths.tolist() == [2, 1]
    assert weights["importance_weights"][0].tolist() == pytest.approx([math.exp(0.1), math.exp(-1.5)], rel=1e-6)
    assert weights["importance_weights"][1].tolist() == pytest.approx([5.0])
    assert off_policy_columns(job().rollout, old, behaviour, np.zeros(3, dtype=bool)) == {}, "all fresh: on-policy"


def test_an_env_trajectorys_observation_tokens_take_no_part_in_its_importance_weight():
    """seq-tis multiplies the ratios of the policy's own tokens: an observation token's behaviour
    log-prob is a placeholder 0 against a real recomputed one, and counted it drove the weight to ~0."""
    from hpcrl.runtime.off_policy import off_policy_columns
    old = Ragged.from_rows([[-0.2, -3.0, -4.0, -0.5]], np.float32)       # tokens 1-2: an observation
    behaviour = Ragged.from_rows([[-0.2, 0.0, 0.0, -0.5]], np.float32)   # the actions sampled as recomputed
    loss_mask = Ragged.from_rows([[1.0, 0.0, 0.0, 1.0]], np.float32)
    stale = np.ones(4, dtype=bool)
    weights = off_policy_columns(job("rollout.is_correction=seq-tis").rollout, old, behaviour, stale, loss_mask)
    assert weights["importance_weights"][0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0])


def test_a_partial_rollout_response_is_corrected_token_by_token_by_the_versions_that_sampled_it():
    """A response begun by version 0 and continued by version 1, trained by version 1: its first
    tokens are corrected by version 0's log-probs, the rest are on-policy (weight 1, ratio against
    the trainer's own log-probs)."""
    from hpcrl.runtime.off_policy import off_policy_columns
    old = Ragged.from_rows([[-0.1, -2.0, -0.3, -0.4]], np.float32)
    behaviour = Ragged.from_rows([[-0.2, -0.5, -0.9, -0.1]], np.float32)    # the last two: noise of another engine
    versions = np.array([0, 0, 1, 1])
    stale = versions < 1
    weights = off_policy_columns(job("rollout.is_correction=tis").rollout, old, behaviour, stale)
    assert weights["importance_weights"][0].tolist() == pytest.approx([math.exp(0.1), math.exp(-1.5), 1.0, 1.0])
    ppo = off_policy_columns(job("rollout.is_correction=ppo").rollout, old, behaviour, stale)
    assert ppo["old_logprobs"][0].tolist() == pytest.approx([-0.2, -0.5, -0.3, -0.4])


def test_with_stop_at_answer_length_a_repeat_response_may_run_to_its_answer_and_eos_and_no_further():
    """The long-tail job's stop rule: each row's budget is its answer's tokens plus <eos> (capped by
    rollout.max_new_tokens), less what a continued response already has; off, every row gets the cap."""
    def first_round(*overrides: str):
        config = load_job(REPO / "jobs" / "tiny_longtail.yaml", ["train.prompts_per_step=16", *overrides])
        s = RolloutScheduler(config, DomainSampler(load_prompts(config, CharTokenizer())[0], seed=1),
                             CharTokenizer().encode)
        found = s.next_round(rollout_version=0)
        return s, found, found.prompts(s.response_limit)["budgets"].tolist()

    s, found, budgets = first_round("task.stop_at_answer_length=true", "rollout.max_new_tokens=20")
    answers = [g.answer for g, _ in found.samples]
    assert budgets == [min(20, len(a) + 1) for a in answers]
    assert len(set(budgets)) > 2 and 20 in budgets, "answers of several lengths, some past the cap"
    short = next(i for i, b in enumerate(budgets) if b < 20 and b > 2)
    n = len(found.samples)
    s.finish_round(found, Ragged.from_rows([[5]] * n, np.int32), Ragged.from_rows([[-1.0]] * n, np.float32),
                   np.arange(n) != short)
    continued = s.next_round(rollout_version=0)
    assert continued.prompts(s.response_limit)["budgets"].tolist() == [budgets[short] - 1]
    assert set(first_round("task.stop_at_answer_length=false", "rollout.max_new_tokens=20")[2]) == {20}
