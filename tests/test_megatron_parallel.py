"""The megatron engine for real: megatron-core GPTModel on CPU over gloo, 5 MPI ranks.

Rank 0 plays the controller (in no role, like the runtime's rank 0), ranks 1-2 (or 1-4) host the
Megatron role, so the groups are those of a sub-world. One MPI run goes through the layouts — TP=2,
PP=2 (tied embeddings), DP=2 with the distributed optimizer, and mixture-of-experts models with
expert parallelism: EP=2 (Qwen2-MoE, shared expert), TP=2 x EP=2 (Qwen3-MoE, q/k norms; sequence
parallel), EP=4 (Mixtral), EP=2 x PP=2, EP=2 over DP=4 (experts replicated over expert DP) — and in
each compares the engine with the HF model and the torch engine
on the same weights and data: log-probabilities (on the last pipeline stage), the weights gathered
back to HF names (TP 2 -> 1 and every EP rank's experts on each stage's leader, the stages
together), and two PPO optimizer steps (weights, and the gradient norm: a global figure also with DP).
Run as a script (by the fixture) it is the MPI program; rank 1 writes the findings as JSON.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import mpi_findings, run_mpi_program

# Checked without importing megatron-core here (10 s): only the MPI ranks need it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core is not installed (pip install hpcrl[megatron])")

WORLD = 5
LAYOUTS = {  # name -> (parallel sizes, arch, tied embeddings, the role's world ranks)
    "tp2": ({"tp": 2}, "qwen2", False, [1, 2]),
    "tp4": ({"tp": 4}, "qwen2", False, [1, 2, 3, 4]),   # 2 KV heads for 4 ranks: two share each query group
    "pp2": ({"pp": 2}, "llama", True, [1, 2]),
    "dp2": ({"dp": 2}, "qwen2", True, [1, 2]),
    "ep2": ({"ep": 2}, "qwen2_moe", False, [1, 2]),
    "tp2ep2": ({"tp": 2, "ep": 2}, "qwen3_moe", False, [1, 2, 3, 4]),
    "ep4": ({"ep": 4}, "mixtral", True, [1, 2, 3, 4]),
    "ep2pp2": ({"ep": 2, "pp": 2}, "qwen2_moe", False, [1, 2, 3, 4]),   # experts gathered per stage
    "ep2dp4": ({"ep": 2}, "qwen3_moe", True, [1, 2, 3, 4]),   # two expert-DP replicas of each expert
    "tp2moe": ({"tp": 2}, "qwen2_moe", False, [1, 2]),   # the load-balancing loss, over sequence-parallel ranks
}
MOE = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 16}


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    return mpi_findings(__file__, WORLD, tmp_path_factory.mktemp("megatron") / "findings.json", timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_role_groups_are_megatron_rank_generator_groups_of_the_sub_world(findings, layout):
    assert findings[layout]["groups_match_megatron"], findings[layout]["groups"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_equal_the_hf_model_on_the_same_weights(findings, layout):
    assert findings[layout]["logprob_max_diff"] < 1e-5


@pytest.mark.parametrize("layout", [name for name, spec in LAYOUTS.items() if "ep" in spec[0] or "moe" in name])
def test_replayed_routing_gives_the_torch_engines_log_probs(findings, layout):
    """Router replay through megatron-core's replay hook in its top-k (the positions of each EP, TP
    sequence-parallel and pipeline rank) gives the log-probs of the torch engine's replay through
    transformers' routers (1e-5), which the replayed experts moved away from the router's own."""
    assert findings[layout]["replay_logprob_max_diff"] < 1e-5
    assert findings[layout]["replay_moved"] > 1e-3


def test_gpt_model_logits_equal_hf_logits(findings):
    assert findings["dp2"]["logits_max_diff"] < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_named_weights_gather_shards_into_the_hf_tensors_bit_for_bit(findings, layout):
    assert findings[layout]["named_weights_bitwise"], findings[layout]["named_weights_mismatch"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ppo_steps_match_the_torch_engine(findings, layout):
    found = findings[layout]
    assert found["trained_weights_max_diff"] < 2e-5, found
    assert found["weights_changed"] > 1e-4
    assert abs(found["metrics"]["grad_norm"] - found["reference_metrics"]["grad_norm"]) < 1e-5, found
    # the replicas' shares average to the whole minibatch's loss (every TP rank of a replica reports it)
    assert abs(sum(found["losses"]) / len(found["losses"]) - found["reference_metrics"]["loss"]) < 1e-5, found
    if LAYOUTS[layout][1] in ("qwen2_moe", "qwen3_moe", "mixtral"):   # the routing, counted over every rank
        for key in ("moe_load_max", "moe_load_min") + (("moe_aux_loss",) if layout == "tp2moe" else ()):
            assert abs(found["metrics"][key] - found["reference_metrics"][key]) < 1e-6, (key, found)
    if layout in ("tp2", "tp4", "pp2", "tp2moe"):  # with DP each replica reports its own shard's loss
        for key in ("loss", "entropy", "kl_loss", "clipfrac", "grad_norm"):
            assert abs(found["metrics"][key] - found["reference_metrics"][key]) < 1e-4, (key, found)


def test_ep_ranks_that_cut_their_shards_differently_run_as_many_micro_batches_as_each_other(findings):
    """Without the agreement one rank would wait in an all-to-all its EP peer never starts."""
    assert len(set(findings["ep4"]["micro_batches"])) == 1 and findings["ep4"]["micro_batches"][0] > 1


def test_vocab_parallel_logprobs_entropy_and_their_gradients_equal_the_full_vocabulary(findings):
    assert findings["tp2"]["vocab_parallel_max_diff"] < 1e-5


def test_offload_frees_storage_and_reload_restores_weights_and_optimizer_state(findings):
    assert findings["dp2"]["offload_freed"] and findings["dp2"]["reload_bitwise"]


# ---- the MPI program ---------------------------------------------------------------------------------------------


def _job(arch: str, tied: bool, data_parallel: bool = True):
    """With a MoE model over DP ranks, a token cap that cuts the DP shards into different numbers of
    micro-batches (the EP ranks must still run as many as each other: their all-to-alls pair
    them); without DP, one micro-batch and the load-balancing loss (a micro-batch's, as the torch
    engine's one micro-batch of the whole batch has it)."""
    from hpcrl.config.job import JobConfig

    experts = {**MOE, **({"shared_expert_intermediate_size": 24} if arch == "qwen2_moe" else {})} \
        if arch in ("qwen2_moe", "qwen3_moe", "mixtral") else {}
    return JobConfig.model_validate({
        "name": "megatron-test", "task": {"name": "addition"},
        "model": {"arch": arch, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "intermediate_size": 48, "tie_word_embeddings": tied, **experts},
        "algorithm": {"kl_loss": {"coef": 0.05}, "entropy_coef": 0.01, "router_replay": bool(experts),
                      **({"moe_aux_loss_coef": 0.5} if experts and not data_parallel else {})},
        "train": {"ppo_epochs": 2, "minibatches": 1, "lr": 1e-3, "grad_clip": 1.0,
                  **({"max_tokens_per_micro_batch": 12} if experts and data_parallel else {})},
        "rollout": {"temperature": 0.9},
        "roles": {"actor_train": {"engine": "megatron"}, "actor_infer": {},
                  "reference": {"engine": "megatron", "colocate_with": "actor_train"}},   # the KL loss's
    })


def _samples(tokenizer, reference, generator):
    import numpy as np
    import torch

    from hpcrl.engines.torch_trainer import Samples
    from hpcrl.ragged import Ragged

    prompts = Ragged.from_rows([[1] + torch.randint(3, tokenizer.vocab_size, (int(n),), generator=generator).tolist()
                                for n in torch.randint(1, 6, (8,), generator=generator)], np.int32)
    responses = Ragged.from_rows([torch.randint(2, tokenizer.vocab_size, (int(n),), generator=generator).tolist()
                                  for n in torch.randint(1, 5, (8,), generator=generator)], np.int32)
    old = reference.logprobs(prompts, responses)
    advantages = np.repeat(torch.randn(len(old), generator=generator).numpy(), old.lengths)
    columns = {"old_logprobs": old, "ref_logprobs": old.with_values(old.values - 0.1),
               "advantages": old.with_values(advantages)}
    return Samples(prompts, responses, columns)


def _shard(samples, index: int, parts: int):
    from hpcrl.engines.torch_trainer import Samples

    n = len(samples.prompt_ids)
    cut = (n * index // parts, n * (index + 1) // parts)
    return Samples(samples.prompt_ids.slice(*cut), samples.response_ids.slice(*cut),
                   {k: v.slice(*cut) for k, v in samples.columns.items()})


def _max_diff(a, b) -> float:
    return float(abs(a.values - b.values).max()) if len(a.values) else 0.0


def _vocab_parallel_check(tp_group) -> float:
    """Max difference of log p, entropy and the gradient of a mix of both, sharded vs whole vocabulary."""
    import torch
    import torch.distributed as dist

    from hpcrl.engines.megatron.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(3, 5, 8, generator=g), torch.randint(0, 8, (3, 5), generator=g)
    weights = torch.randn(2, 3, 5, generator=g)
    whole = logits.clone().requires_grad_()
    logp_all = torch.log_softmax(whole, -1)
    logp, entropy = logp_all.gather(-1, targets[..., None])[..., 0], -(logp_all.exp() * logp_all).sum(-1)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    rank, width = dist.get_rank(tp_group), 8 // dist.get_world_size(tp_group)
    shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    got_logp, got_entropy = vocab_parallel_logprobs(shard, targets, tp_group, with_entropy=True)
    ((got_logp * weights[0]).sum() + (got_entropy * weights[1]).sum()).backward()
    return max(float((got_logp - logp).abs().max()), float((got_entropy - entropy).abs().max()),
               float((shard.grad - whole.grad[..., rank * width:(rank + 1) * width]).abs().max()))


def _layout(name: str, parallel: dict, arch: str, tied: bool, role_ranks: list[int], rank: int) -> dict | None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcrl.data import CharTokenizer
    from hpcrl.engines.megatron.groups import new_role_groups, role_rank_groups

    groups = role_rank_groups(parallel, role_ranks)
    mine = new_role_groups(groups, rank)  # collective: the controller rank takes part too
    if rank not in role_ranks:
        return None
    from megatron.core.parallel_state import RankGenerator

    import tempfile
    from pathlib import Path

    from conftest import random_files

    from hpcrl.engines.megatron.engine import MegatronTrainer
    from hpcrl.engines.model_files import load_full
    from hpcrl.engines.offload import model_state_tensors
    from hpcrl.engines.torch_trainer import TorchTrainer
    from hpcrl.ragged import Ragged

    sizes = {k: parallel.get(k, 1) for k in ("tp", "pp", "cp", "ep")}
    dp = len(role_ranks) // (sizes["tp"] * sizes["pp"])
    generator = RankGenerator(tp=sizes["tp"], ep=1, dp=dp, pp=sizes["pp"], cp=1, order="tp-cp-ep-dp-pp",
                              rank_offset=role_ranks[0])
    experts = RankGenerator(tp=sizes["tp"], ep=sizes["ep"], dp=dp // sizes["ep"], pp=sizes["pp"], cp=1,
                            order="tp-cp-ep-dp-pp", rank_offset=role_ranks[0])
    found: dict = {"groups": groups, "groups_match_megatron": all(
        groups[kind] == generator.get_ranks(token) for kind, token in
        (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("cp", "cp"), ("mp", "tp-pp"), ("dp_cp", "dp-cp")))
        and all(groups[kind] == experts.get_ranks(token) for kind, token in
                (("ep", "ep"), ("expt_dp", "dp"), ("expt_tp", "tp"), ("tp_ep", "tp-ep")))}

    job = _job(arch, tied, data_parallel=dp > 1)
    tokenizer = CharTokenizer()
    files = random_files(job, tokenizer, Path(tempfile.mkdtemp(prefix=f"hpcrl-test-rank{rank}-")))
    hf = load_full(files, job.model.dtype)
    reference = TorchTrainer(files, job, tokenizer.pad_token_id, None)
    samples = _samples(tokenizer, reference, torch.Generator().manual_seed(7))
    engine = MegatronTrainer(files, job, tokenizer.pad_token_id, mine)
    dp_rank = engine.pgc.dp.rank()

    logprobs = engine.logprobs(samples.prompt_ids, samples.response_ids)
    if logprobs is not None:  # on the last pipeline stage
        found["logprob_max_diff"] = _max_diff(logprobs, samples.columns["old_logprobs"])
    if job.algorithm.router_replay:   # random experts replayed at every position, as the torch engine replays them
        fed = samples.prompt_ids.lengths + samples.response_ids.lengths - 1
        experts = torch.rand(int(fed.sum()), 2, 4, generator=torch.Generator().manual_seed(5)).argsort(dim=-1)
        routing = Ragged(experts[..., :2].numpy().astype(np.uint8).reshape(-1), np.concatenate([[0], np.cumsum(fed * 4)]))
        replayed = engine.logprobs(samples.prompt_ids, samples.response_ids, routing)
        if replayed is not None:
            torch_replayed = reference.logprobs(samples.prompt_ids, samples.response_ids, routing)
            found["replay_logprob_max_diff"] = _max_diff(replayed, torch_replayed)
            found["replay_moved"] = _max_diff(torch_replayed, samples.columns["old_logprobs"])
    if name == "tp2":
        found["vocab_parallel_max_diff"] = _vocab_parallel_check(engine.pgc.tp)
    if name == "dp2":  # each rank holds the whole model: compare raw logits too
        ids = torch.tensor([samples.prompt_ids[0].tolist() + samples.response_ids[0].tolist()])
        positions = torch.arange(ids.shape[1])[None]
        from hpcrl.engines.megatron.cpu_shim import cuda_on_cpu
        from hpcrl.engines.megatron.packing import causal_mask

        with torch.no_grad(), cuda_on_cpu():   # a direct call into megatron-core, as the engine's own
            logits = engine.model(ids, positions, causal_mask(ids.shape[1], "cpu"))
            found["logits_max_diff"] = float((logits - hf(input_ids=ids).logits).abs().max())

    # Each pipeline stage's leader gathers its own stage; main() puts the stages of replica 0 together.
    gathered = dict(engine.named_weights())
    expected = dict(reference.named_weights())
    found["expected_names"] = sorted(expected)
    if gathered and dp_rank == 0:
        found["named_weights"] = sorted(gathered)
        found["named_weights_mismatch"] = [n for n in gathered if not torch.equal(gathered[n], expected[n])]

    before = {n: t.clone() for n, t in expected.items()}
    metrics = engine.train_step(_shard(samples, dp_rank, dp), job.train.lr)
    if metrics:  # on the last pipeline stage
        found["metrics"] = metrics
        found["micro_batches"] = [metrics["micro_batches"]]
        found["losses"] = [metrics["loss"]]   # each DP replica's estimate of the whole minibatch's loss
    found["reference_metrics"] = reference.train_step(samples, job.train.lr)
    trained = dict(engine.named_weights())
    if trained and dp_rank == 0:
        after = dict(reference.named_weights())
        found["trained_weights_max_diff"] = max(float((trained[n] - after[n]).abs().max()) for n in trained)
        found["weights_changed"] = max(float((after[n] - before[n]).abs().max()) for n in after)

    if name == "dp2":
        tensors = model_state_tensors(engine.model.parameters())
        for opt in engine._optimizers():
            tensors += model_state_tensors((), opt.optimizer)
        snapshot = [t.clone() for t in tensors]
        engine.offload()
        found["offload_freed"] = all(t.untyped_storage().nbytes() == 0 for t in tensors)
        engine.reload()
        found["reload_bitwise"] = all(torch.equal(a, b) for a, b in zip(tensors, snapshot))
    dist.barrier(group=engine.pgc.intra_dist_opt)
    return found


def _merge(per_rank: list[dict]) -> dict:
    """One layout's findings from every role rank: what a rank alone knows (the last stage's
    log-probs and metrics, each stage's gathered weights) joined with the first rank's."""
    merged: dict = {}
    for found in per_rank:
        for key, value in found.items():
            if key in ("named_weights", "named_weights_mismatch", "micro_batches", "losses"):
                merged[key] = merged.get(key, []) + value
            elif key == "trained_weights_max_diff":
                merged[key] = max(merged.get(key, 0.0), value)
            else:
                merged.setdefault(key, value)
    merged["named_weights_bitwise"] = (sorted(merged["named_weights"]) == merged["expected_names"]
                                       and not merged["named_weights_mismatch"])
    return merged


def main(out: Path) -> None:
    run_mpi_program(lambda rank: {name: _layout(name, *spec, rank=rank) for name, spec in LAYOUTS.items()},
                    lambda everyone: {name: _merge([r[name] for r in everyone if r[name] is not None])
                                      for name in LAYOUTS}, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
