"""Multi-turn rollout over env processes: masks, behaviour log-probs, env-level asynchrony, failures
and redundancy, with the native sampler on a tiny random model."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import REPO

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.data.tokenizer import env_characters
from hpcrl.engines.hf_model import random_model
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.envs import EnvSpec
from hpcrl.envs.host import EnvPool
from hpcrl.rollout.multi_turn import MultiTurnRollout, Request, TurnFormat, trajectory_metrics


def rollout_for(spec: EnvSpec, slots: int, lockstep: bool = False, max_turns: int = 4, step_timeout_s: float = 20.0):
    env = spec.build()
    tokenizer = CharTokenizer(env_characters(env))
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml")
    model = random_model(job.model, tokenizer, 3)
    sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id, lockstep=lockstep)
    pool = EnvPool(spec, slots, step_timeout_s)
    turns = TurnFormat(tokenizer)
    return MultiTurnRollout(sampler, pool, env, turns, SamplingParams(4), max_turns=max_turns, turn_tokens=4,
                            max_tokens=64, lockstep=lockstep), tokenizer


def test_observations_are_masked_and_actions_keep_their_sampling_logprobs():
    """Replaying each trajectory's actions in a fresh env gives exactly its masked pieces: the loss
    mask is 0 on every observation token and 1 on every generated one, whose log-probs are kept."""
    spec = EnvSpec("frozenlake")
    rollout, tokenizer = rollout_for(spec, slots=4)
    requests = [Request(group=i // 2, env_seed=i // 2, sample_seed=100 + i) for i in range(8)]
    with rollout.pool:
        trajectories = rollout.run(requests)
    assert all(t.ended and t.failure is None for t in trajectories)
    assert sum(len(t.turn_tokens) for t in trajectories) > len(trajectories), "some went past one turn"
    replay = spec.build()
    for t in trajectories:
        ids, mask, logprobs, rewards = t.tokens()
        assert t.prompt_ids.tolist() == rollout.turns.first(replay, replay.reset(t.request.env_seed)).tolist()
        assert len(ids) == len(mask) == len(logprobs)
        assert (logprobs[mask] < 0).all() and (logprobs[~mask] == 0).all()
        # each turn's reward sits on the last token of its action, nowhere else
        action_ends = np.cumsum([len(p) for p in t.response_ids])[[i for i, m in enumerate(t.loss_mask) if m.all()]] - 1
        expected = np.zeros(len(ids), np.float32)
        expected[action_ends[:len(t.step_rewards)]] = t.step_rewards
        assert rewards.tolist() == expected.tolist() and rewards.sum() == t.reward
        pieces = iter(zip(t.response_ids, t.loss_mask))
        for turn, (action, action_mask) in enumerate(pieces):
            assert action_mask.all() and len(action) == t.turn_tokens[turn]
            result = replay.step(tokenizer.decode(action.tolist()))
            assert t.step_rewards[turn] == result.reward
            if result.done or turn + 1 == rollout.max_turns:
                assert t.success == bool(result.info.get("success")) and next(pieces, None) is None
                break
            observation, observation_mask = next(pieces)
            assert observation.tolist() == rollout.turns.next(result.observation, action).tolist()
            assert not observation_mask.any()


def test_env_level_asynchrony_gives_the_lockstep_trajectories():
    """Envs answer at their own pace (a step takes 0 to 0.45 s by seed): trajectories that progress
    on their own equal, token for token, those of lock-step waves, since every draw depends only on
    the trajectory's seed and turn."""
    spec = EnvSpec("envs_for_tests:paced", {"length": 3, "delay_s": 0.05})
    requests = [Request(group=i, env_seed=i, sample_seed=7 * i) for i in range(6)]
    results = []
    for lockstep in (False, True):
        rollout, _ = rollout_for(spec, slots=3, lockstep=lockstep)
        with rollout.pool:
            results.append(rollout.run(requests))
    for free, waves in zip(*results):
        assert [a.tolist() for a in free.response_ids] == [a.tolist() for a in waves.response_ids]
        assert np.allclose(free.tokens()[2], waves.tokens()[2], atol=1e-5)
        assert free.success and waves.success and free.reward == 1.0


def test_hung_and_raising_envs_fail_their_trajectories_and_the_rest_finish():
    spec = EnvSpec("envs_for_tests:paced", {"length": 2, "delay_s": 0.01})
    rollout, _ = rollout_for(spec, slots=3, step_timeout_s=2.0)
    requests = [Request(group=0, env_seed=seed, sample_seed=seed) for seed in (1, 99, 98, 2, 3)]
    with rollout.pool:
        trajectories = rollout.run(requests)
        failures = rollout.pool.failures
    by_seed = {t.request.env_seed: t for t in trajectories}
    assert by_seed[99].failure.startswith("hung: no answer within 2 s")
    assert by_seed[98].failure == "raised: RuntimeError: broken on purpose"
    assert all(by_seed[s].success and by_seed[s].failure is None for s in (1, 2, 3))
    metrics = trajectory_metrics(trajectories, failures)
    assert metrics["trajectories_failed"] == 2 and metrics["envs_hung"] == 1 and metrics["envs_raised"] == 1
    assert metrics["success_rate"] == 1.0 and metrics["turns"] == 2.0


def test_redundancy_keeps_the_first_finishers_and_aborts_the_rest():
    """Two groups of 4 trajectories, keep 2: the env's pace is set by the seed, so the two fastest
    of each group are kept and the two slowest aborted mid-episode."""
    spec = EnvSpec("envs_for_tests:paced", {"length": 3, "delay_s": 0.1})
    requests = [Request(group=g, env_seed=s, sample_seed=s) for g in (0, 1) for s in (g * 10 + 8, g * 10 + 1,
                                                                                      g * 10 + 6, g * 10 + 0)]
    rollout, _ = rollout_for(spec, slots=8)
    with rollout.pool:
        trajectories = rollout.run(requests, keep=2)
    kept = sorted(t.request.env_seed for t in trajectories if not t.aborted)
    aborted = [t for t in trajectories if t.aborted]
    assert kept == [0, 1, 10, 11]
    assert sorted(t.request.env_seed for t in aborted) == [6, 8, 16, 18]
    assert all(t.ended and not t.success for t in aborted)
    assert trajectory_metrics(trajectories, rollout.pool.failures)["trajectories_aborted"] == 4


def test_chat_turns_read_as_the_conversation_the_template_renders():
    """env.chat: a trajectory's tokens, decoded, are the chat template's rendering of its conversation
    (instructions as the system message, observations as user messages, actions as the assistant's),
    whether an action ended with <eos> or ran out of tokens."""
    import torch

    from hpcrl.data import HFTokenizer

    tokenizer = HFTokenizer(str(REPO / "data" / "rlvr" / "tokenizer"))
    spec = EnvSpec("frozenlake")
    model = random_model(load_job(REPO / "jobs" / "tiny_grpo.yaml").model, tokenizer, 3)
    eos = tokenizer.eos_token_id

    def likelier_eos(module, inputs, logits: torch.Tensor) -> torch.Tensor:
        logits[..., eos] += 5.0   # a random model over 602 tokens would almost never end a turn itself
        return logits

    model.lm_head.register_forward_hook(likelier_eos)
    turns = TurnFormat(tokenizer, chat=True)
    rollout = MultiTurnRollout(NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id), EnvPool(spec, 4, 20.0), spec.build(),
                               turns, SamplingParams(4), max_turns=4, turn_tokens=4, max_tokens=200)
    with rollout.pool:
        trajectories = rollout.run([Request(group=i, env_seed=i, sample_seed=i) for i in range(8)])
    hf, endings = tokenizer.to_hf(), set()
    for t in trajectories:
        replay = spec.build()
        messages = [{"role": "system", "content": f"{replay.system_prompt} {replay.action_format}"},
                    {"role": "user", "content": replay.reset(t.request.env_seed)}]
        actions = [piece for piece, mask in zip(t.response_ids, t.loss_mask) if mask.all()]
        for turn, action in enumerate(actions):
            endings.add(bool(action[-1] == eos))
            messages.append({"role": "assistant", "content": hf.decode(action, skip_special_tokens=False)
                             .removesuffix(tokenizer.token_text(eos))})
            result = replay.step(tokenizer.decode(action.tolist()))
            if turn + 1 < len(actions):
                messages.append({"role": "user", "content": result.observation})
        rendered = tokenizer.chat_text(messages, add_generation_prompt=False).removesuffix("\n")   # the last closing
        assert hf.decode(t.context(), skip_special_tokens=False).replace(tokenizer.token_text(eos), "") == "<bos>" + rendered
    assert endings == {True, False}, "both kinds of action ending were checked"
    assert sum(len(t.turn_tokens) for t in trajectories) > len(trajectories), "some went past one turn"



def test_plain_turns_start_with_bos_only_where_the_tokenizer_has_one(tmp_path):
    """env.chat: false with a tokenizer without `<bos>` (Qwen2.5, Qwen3): the first observation is
    the instructions and the observation, nothing in front."""
    from transformers import AutoTokenizer

    from hpcrl.data import HFTokenizer

    hf = AutoTokenizer.from_pretrained(REPO / "data" / "rlvr" / "format-model")
    hf.bos_token = None
    hf.save_pretrained(tmp_path)
    tokenizer, env = HFTokenizer(str(tmp_path)), EnvSpec("frozenlake").build()
    assert tokenizer.bos_token_id is None
    ids = TurnFormat(tokenizer, chat=False).first(env, "start")
    assert ids.tolist() == hf.encode(f"{env.system_prompt} {env.action_format} start ", add_special_tokens=False)

@pytest.mark.parametrize("lockstep", [False, True])
def test_a_kept_kv_cache_gives_the_trajectories_of_rereading_the_context_and_feeds_each_token_once(lockstep):
    """Between a trajectory's turns its keys and values stay in the sampler: the same tokens and
    log-probs as re-reading the whole conversation every turn, while the model reads far fewer
    tokens (each turn's new ones only)."""
    spec = EnvSpec("envs_for_tests:paced", {"length": 4, "delay_s": 0.01})
    requests = [Request(group=i // 2, env_seed=i, sample_seed=11 * i) for i in range(6)]
    results, fed = {}, {}
    for keep in (True, False):
        rollout, _ = rollout_for(spec, slots=3, lockstep=lockstep, max_turns=5)
        rollout.keep_cache = keep
        counter = [0]
        rollout.sampler.model.model.embed_tokens.register_forward_pre_hook(
            lambda module, args: counter.__setitem__(0, counter[0] + args[0].numel()))
        with rollout.pool:
            results[keep] = rollout.run(requests)
        fed[keep] = counter[0]
    assert sum(len(t.turn_tokens) for t in results[True]) > 2 * len(requests), "several turns each"
    for kept, reread in zip(results[True], results[False]):
        assert [a.tolist() for a in kept.response_ids] == [a.tolist() for a in reread.response_ids]
        assert np.allclose(kept.tokens()[2], reread.tokens()[2], atol=1e-5)
    assert fed[True] < 0.6 * fed[False], fed
