"""Router replay (algorithm.router_replay): the native sampler records the experts every position it
feeds went to, and the torch engine routes the same positions to them when it recomputes log-probs
and trains, with its own router's gates. Checked against transformers' own routing of the whole
sequence (an independent forward), in fp32 where rollout and trainer agree token for token.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import hpcrl, random_files

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.engines import router_replay
from hpcrl.engines.batch import pack
from hpcrl.engines.model_files import load_full
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.engines.torch_trainer import Samples, TorchTrainer
from hpcrl.metrics import read_metrics
from hpcrl.ragged import Ragged

TOKENIZER = CharTokenizer()
ARCHS = {"qwen2_moe": ["model.shared_expert_intermediate_size=32"], "qwen3_moe": [], "mixtral": []}
# one minibatch, one epoch: the train step's forward runs the weights that sampled
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_intermediate_size=32",
       "train.minibatches=1", "train.ppo_epochs=1", "algorithm.router_replay=true"]


def _job(arch: str = "qwen3_moe", *extra: str):
    return load_job("jobs/tiny_grpo.yaml", [f"model.arch={arch}", *ARCHS[arch], *MOE, *extra])


def _prompts(count: int = 9) -> Ragged:
    rng = np.random.default_rng(3)
    return Ragged.from_rows([rng.integers(3, TOKENIZER.vocab_size, n) for n in rng.integers(2, 10, count)], np.int32)


def _own_routing(model, prompts: Ragged, responses: Ragged) -> torch.Tensor:
    """[N, P + R, layers, k] experts of transformers' forward over the whole batch (pack's layout)."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in router_replay.routers(model)]
    batch = pack(prompts, responses, TOKENIZER.pad_token_id)
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    for hook in hooks:
        hook.remove()
    return torch.stack(seen, dim=1).reshape(*batch["input_ids"].shape, len(seen), -1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batching", ["continuous", "lockstep", "cut"])
def test_the_sampler_records_the_experts_of_every_position_a_trainer_feeds(tmp_path, arch, batching):
    """Prompt and response tokens but the last, each with the experts transformers routes it to in a
    forward over the whole sequence: with sequences joining and leaving the batch (3 slots for 9
    prompts), in lock-step (finished rows decode filler), and cut short by a stop (partial rollout)."""
    job = _job(arch)
    model = load_full(random_files(job, TOKENIZER, tmp_path), torch.float32)
    sampler = NativeSampler(model, TOKENIZER.stop_token_ids, TOKENIZER.pad_token_id, max_seqs=3,
                            lockstep=batching == "lockstep", record_routing=True)
    steps = iter(range(10 ** 6))
    stop = (lambda finished: next(steps) >= 7) if batching == "cut" else None
    prompts = _prompts()
    out = sampler.generate(prompts, SamplingParams(12), torch.Generator().manual_seed(2), stop=stop)
    assert (batching == "cut") == (not out.finished.all())
    own = _own_routing(model, prompts, out.response_ids)
    layers, k = own.shape[2:]
    started = out.response_ids.lengths > 0   # a row cut before its prefill has nothing recorded (nor sampled)
    assert batching == "cut" or started.all()
    fed = np.where(started, prompts.lengths + out.response_ids.lengths - 1, 0)
    assert np.array_equal(out.routed_experts.lengths, fed * layers * k)
    replayed = router_replay.padded_routing(out.routed_experts, prompts.lengths, out.response_ids.lengths, layers, k)
    recorded = replayed[:, :, 0, 0] >= 0
    assert int(recorded.sum()) == int(fed.sum())
    assert torch.equal(replayed[recorded].sort(-1).values, own[recorded].sort(-1).values)


def test_the_trainer_routes_as_told_with_its_own_gates_and_counts_what_replay_changed(tmp_path):
    """Replaying its own routing changes nothing, bit for bit; replaying other experts routes every
    recorded position there (a response's last token keeps its own), moves the log-probs, trains the
    router through the gates, and `router_flip_frac` counts the real tokens' routings replay changed."""
    job = _job("qwen3_moe", "model.num_layers=1")   # a later layer's own routing depends on the replayed ones before
    files = random_files(job, TOKENIZER, tmp_path)
    trainer = TorchTrainer(files, job, TOKENIZER.pad_token_id, None)
    prompts = _prompts(6)
    rng = np.random.default_rng(0)
    responses = Ragged.from_rows([rng.integers(3, TOKENIZER.vocab_size, n) for n in (4, 1, 6, 3, 5, 2)], np.int32)
    own = _own_routing(trainer.module, prompts, responses)
    layers, k = own.shape[2:]
    real = pack(prompts, responses, TOKENIZER.pad_token_id)["attention_mask"].bool()
    last = real.clone()   # the response's last token: not fed by rollout, so not recorded
    last[torch.arange(len(prompts)), real.shape[1] - real.flip(1).int().argmax(1) - 1] = False

    def rows(routing: torch.Tensor) -> Ragged:
        return Ragged.from_arrays([routing[i][last[i]].numpy().astype(np.uint8).reshape(-1)
                                   for i in range(len(prompts))], np.uint8)

    plain = trainer.logprobs(prompts, responses)
    same = trainer.logprobs(prompts, responses, rows(own))
    assert np.array_equal(plain.values, same.values)
    chosen = torch.zeros(*own.shape[:-1], 4, dtype=torch.long).scatter_(-1, own, 1)
    other = chosen.argsort(dim=-1, stable=True)[..., :2]   # every token's two experts replaced by the other two
    seen = []
    hooks = [r.register_forward_hook(lambda m, i, out: seen.append(out[2])) for r in router_replay.routers(trainer.module)]
    batch, _ = trainer._micro_batch(Samples(prompts, responses, {}, rows(other)), np.arange(len(prompts)))
    with torch.no_grad():   # the engine's forward of one micro-batch, rows in order
        trainer._forward(batch, with_entropy=False)
    for hook in hooks:
        hook.remove()
    routed = torch.stack(seen, dim=1).reshape(own.shape)
    moved = trainer.logprobs(prompts, responses, rows(other))
    assert torch.equal(routed[last], other[last]) and torch.equal(routed[~last & real], own[~last & real])
    assert np.abs(moved.values - plain.values).max() > 1e-3

    zeros = responses.with_values(np.zeros(len(responses.values), np.float32))
    columns = {"old_logprobs": moved, "advantages": zeros.with_values(rng.standard_normal(len(zeros.values))
                                                                      .astype(np.float32))}
    router = router_replay.routers(trainer.module)[0].weight
    before = router.detach().clone()
    metrics = trainer.train_step(Samples(prompts, responses, columns, rows(other)), job.train.lr)
    assert metrics["router_flip_frac"] == 1.0
    assert not torch.equal(router, before), "the gates are the router's: it trains"
    metrics = TorchTrainer(files, job, TOKENIZER.pad_token_id, None).train_step(
        Samples(prompts, responses, {**columns, "old_logprobs": plain}, rows(own)), job.train.lr)
    assert metrics["router_flip_frac"] == 0.0


def test_a_replica_without_rows_replies_with_an_empty_routing_column(tmp_path):
    """A round with fewer rows than rollout replicas leaves one with none: its reply must still have
    the column, or joining the replicas' replies (keyed by the first) drops every replica's routing."""
    job = _job()
    model = load_full(random_files(job, TOKENIZER, tmp_path), torch.float32)
    sampler = NativeSampler(model, TOKENIZER.stop_token_ids, TOKENIZER.pad_token_id, record_routing=True)
    out = sampler.generate(Ragged.empty(0, np.int32), SamplingParams(4), torch.Generator().manual_seed(0))
    assert out.routed_experts is not None and len(out.routed_experts) == 0 and out.routed_experts.dtype == np.uint8


def test_a_routing_row_that_does_not_fit_its_sample_is_refused():
    """Whole positions of layers x top-k, at most the prompt and response but the last token."""
    prompts, responses = np.array([3, 2]), np.array([2, 1])
    fits = Ragged.from_rows([[1, 2, 3, 0] * 4, [0, 1, 2, 3] * 2], np.uint8)   # 2 layers x top-2
    padded = router_replay.padded_routing(fits, prompts, responses, 2, 2)
    assert padded.shape == (2, 5, 2, 2) and padded.dtype == torch.int16
    assert padded[0, 0, 0].tolist() == [1, 2] and (padded[1, :1] == -1).all() and padded[1, 1, 1].tolist() == [2, 3]
    for wrong in ([[1, 2, 3] * 3, [0] * 8], [[1, 2, 3, 0] * 5, [0] * 8]):   # not whole positions; one too many
        with pytest.raises(ValueError, match="router replay: sample 0's routing"):
            router_replay.padded_routing(Ragged.from_rows(wrong, np.uint8), prompts, responses, 2, 2)


@pytest.mark.parametrize("keep_cache", [True, False])
def test_a_trajectorys_routing_covers_its_whole_conversation_across_kept_caches(keep_cache):
    """Multi-turn rollout: each turn prefills only its new tokens on the trajectory's kept cache, whose
    routing is kept with it, so the trajectory's routing is still its whole context's (up to its last
    action's last token), as transformers routes the context read at once."""
    from hpcrl.data.tokenizer import env_characters
    from hpcrl.engines.hf_model import random_model
    from hpcrl.envs import EnvSpec
    from hpcrl.envs.host import EnvPool
    from hpcrl.rollout.multi_turn import MultiTurnRollout, Request, TurnFormat

    spec = EnvSpec("envs_for_tests:paced", {"length": 4, "delay_s": 0.01})
    tokenizer = CharTokenizer(env_characters(spec.build()))
    model = random_model(_job().model, tokenizer, 3)
    sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id, record_routing=True)
    rollout = MultiTurnRollout(sampler, EnvPool(spec, 3, 20.0), spec.build(), TurnFormat(tokenizer), SamplingParams(4),
                               max_turns=5, turn_tokens=4, max_tokens=64)
    rollout.keep_cache = keep_cache
    with rollout.pool:
        trajectories = rollout.run([Request(group=i // 2, env_seed=i, sample_seed=11 * i) for i in range(6)])
    assert sum(len(t.turn_tokens) for t in trajectories) > 2 * len(trajectories), "several turns each"
    for t in trajectories:
        context = t.context()
        last_action = len(t.prompt_ids) + sum(len(p) for p in t.response_ids[:max(
            i for i, m in enumerate(t.loss_mask) if m.all()) + 1])
        assert len(t.routing) == last_action - 1
        own = _own_routing(model, Ragged.from_rows([context], np.int32), Ragged.from_rows([[]], np.int32))
        assert torch.equal(torch.from_numpy(t.routing.astype(np.int64)).sort(-1).values,
                           own[0, :len(t.routing)].sort(-1).values)


@pytest.mark.parametrize("overrides, message", [
    (["model.arch=qwen2"], "arch qwen2 has no router to replay"),
    (["model.arch=qwen3_moe", "model.num_experts=4", "roles.actor_train.engine=megatron", "train.recompute=true",
      "roles.actor_train.parallel.pp=2"], "with train.recompute and pipeline stages"),
    (["model.arch=qwen3_moe", "model.num_experts=4", "roles.actor_train.engine=deepspeed"],
     "roles.actor_train.engine is deepspeed"),
])
def test_a_job_router_replay_cannot_run_is_refused_with_the_reason(overrides, message):
    with pytest.raises(ValueError, match=f"algorithm.router_replay: .*{message}"):
        load_job("jobs/tiny_grpo.yaml", [*overrides, "algorithm.router_replay=true"])


RUNS = {"torch": ("tiny_grpo", []),
        "megatron-ep2": ("tiny_grpo", ["roles.actor_train.engine=megatron", "roles.reference.engine=megatron",
                                       "roles.actor_train.parallel.ep=2"]),
        "torch-frozenlake": ("tiny_frozenlake", [])}   # multi-turn: routing kept across a trajectory's turns


@pytest.mark.parametrize("run", RUNS)
def test_grpo_with_router_replay_runs_and_in_fp32_rollout_and_trainer_route_alike(tmp_path, run):
    """Rollout on its own rank records, the controller carries the routing to both trainer ranks, and
    the train step replays it: in fp32 no routing differs (the trainer's weights are rollout's), and
    the recomputed log-probs are rollout's. On megatron the experts are split over the two ranks."""
    if run.startswith("megatron") and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (pip install hpcrl[megatron])")
    run_dir = tmp_path / "run"
    job, extra = RUNS[run]
    overrides = ["model.arch=qwen3_moe", *MOE, "train.steps=2", "log.tensorboard=false",
                 "rollout.recompute_logprobs=always", *extra]
    trained = hpcrl("run", f"jobs/{job}.yaml", "--run-dir", str(run_dir),
                    *[x for o in overrides for x in ("--set", o)], timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all("router_flip_frac" in m for m in metrics), "the train steps replayed recorded routing"
    assert all(m["router_flip_frac"] < 0.01 and m["rollout_logprob_gap_max"] < 1e-5 for m in metrics), metrics
