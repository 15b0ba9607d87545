"""hpcrl.placement: Megatron rank groups, the device map of the shipped jobs, and every rejection."""
from __future__ import annotations

import ast
import copy
import importlib.metadata
import json
import math
import subprocess
import sys
from itertools import product

import pytest

from hpcrl.config import ClusterProfile, JobConfig, REPO_ROOT, load_job, load_profile, validate
from hpcrl.placement import PlacementError, Plan, compile_plan, format_plan
from hpcrl.placement.memory import ModelShape, count_parameters, device_bytes
from hpcrl.placement.rank_groups import ORDER, RankGenerator, megatron_groups

TINY_JOB = REPO_ROOT / "jobs" / "tiny_grpo.yaml"
BIG_JOB = REPO_ROOT / "jobs" / "qwen2.5-7b-grpo.yaml"
BIG_CLUSTER = REPO_ROOT / "clusters" / "example-4x8-h100.yaml"


def singletons(n):
    return [[i] for i in range(n)]


# Megatron's groups for order "tp-cp-ep-dp-pp", written out (and checked against megatron-core 0.16.1).
# (tp, pp, cp, ep, dp) -> groups of local ranks.
DENSE_TABLE = {
    (2, 2, 1, 1, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                      "cp": singletons(8), "ep": singletons(8), "dp": [[0, 2], [1, 3], [4, 6], [5, 7]]},
    (4, 2, 1, 1, 2): {"tp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
                      "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
                      "cp": singletons(16), "ep": singletons(16),
                      "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]},
    (2, 1, 2, 1, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": singletons(8),
                      "cp": [[0, 2], [1, 3], [4, 6], [5, 7]], "ep": singletons(8), "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
    (1, 4, 1, 1, 2): {"tp": singletons(8), "pp": [[0, 2, 4, 6], [1, 3, 5, 7]], "cp": singletons(8),
                      "ep": singletons(8), "dp": [[0, 1], [2, 3], [4, 5], [6, 7]]},
    (1, 1, 1, 1, 2): {"tp": singletons(2), "pp": singletons(2), "cp": singletons(2), "ep": singletons(2),
                      "dp": [[0, 1]]},
    # expert parallel: ep groups from the expert generator (etp = tp, edp = world / (tp*ep*pp), cp folded in)
    (1, 1, 1, 2, 4): {"tp": singletons(4), "pp": singletons(4), "cp": singletons(4), "ep": [[0, 1], [2, 3]],
                      "dp": [[0, 1, 2, 3]]},
    (2, 1, 1, 2, 4): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": singletons(8), "cp": singletons(8),
                      "ep": [[0, 2], [1, 3], [4, 6], [5, 7]], "dp": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    (1, 2, 2, 2, 2): {"tp": singletons(8), "pp": [[0, 4], [1, 5], [2, 6], [3, 7]], "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                      "ep": [[0, 1], [2, 3], [4, 5], [6, 7]], "dp": [[0, 2], [1, 3], [4, 6], [5, 7]]},
}


@pytest.mark.parametrize("sizes", list(DENSE_TABLE))
def test_groups_match_the_written_out_megatron_table(sizes):
    tp, pp, cp, ep, dp = sizes
    assert megatron_groups(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp) == DENSE_TABLE[sizes]


def test_rank_generator_combined_tokens():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order=ORDER)
    assert gen.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert gen.get_ranks("tp-dp-pp") == [list(range(8))]
    assert RankGenerator(tp=2, ep=1, dp=2, pp=1, cp=1, order="tp-dp", rank_offset=3).get_ranks("dp") == [[3, 5], [4, 6]]
    with pytest.raises(ValueError, match="does not name it"):
        RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-dp")


def _real_megatron_rank_generator():
    """megatron-core's own RankGenerator, taken from its installed parallel_state.py by source.

    Importing megatron.core costs ~10 s (torch and much more), so the two pure-Python definitions
    are extracted and executed as they are, which still compares against the real code."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megatron-core is not installed (pip install megatron-core==0.16.1)")
    source = dist.locate_file("megatron/core/parallel_state.py").read_text()
    wanted = {"generate_masked_orthogonal_rank_groups", "RankGenerator"}
    nodes = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted]
    assert {n.name for n in nodes} == wanted
    namespace = {"List": list, "Optional": None}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "parallel_state.py", "exec"), namespace)
    return namespace["RankGenerator"]


def test_groups_match_real_megatron_core():
    MegatronRankGenerator = _real_megatron_rank_generator()
    checked = 0
    for tp, pp, cp, ep, dp in product((1, 2, 4), (1, 2, 3), (1, 2), (1, 2, 4), (1, 2, 4, 6)):
        if dp % ep:
            continue
        world = tp * pp * cp * dp
        dense = MegatronRankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
        expert = MegatronRankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=ORDER)
        ours = megatron_groups(tp=tp, pp=pp, cp=cp, ep=ep, dp=dp)
        for kind in ("tp", "pp", "cp", "dp"):
            assert ours[kind] == dense.get_ranks(kind), (kind, tp, pp, cp, ep, dp)
        assert ours["ep"] == expert.get_ranks("ep"), ("ep", tp, pp, cp, ep, dp)
        ours_gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp)
        for token in ("tp-pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-cp-dp-pp"):
            assert ours_gen.get_ranks(token) == dense.get_ranks(token), (token, tp, pp, cp, dp)
        checked += 1
    for sizes, expected in DENSE_TABLE.items():
        tp, pp, cp, ep, dp = sizes
        world = tp * pp * cp * dp
        assert MegatronRankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER).get_ranks("dp") == expected["dp"]
        assert MegatronRankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1,
                                     order=ORDER).get_ranks("ep") == expected["ep"]
    assert checked > 100


# ---------------------------------------------------------------- jobs and profiles

def job_dict(model: dict | None = None, **roles) -> dict:
    """A tiny job whose roles are given as raw mappings (24 x 8 samples a step: any dp up to 4 splits them)."""
    return {"name": "t", "task": {"name": "addition"}, "train": {"prompts_per_step": 24}, "roles": roles,
            **({"model": model} if model else {})}


def job(model: dict | None = None, **roles) -> JobConfig:
    return validate(JobConfig, job_dict(model, **roles), "test")


def cluster(nodes=1, devices=4, memory=80.0, device="cpu") -> ClusterProfile:
    return validate(ClusterProfile, {"name": "c", "scheduler": "local", "nodes": nodes, "devices_per_node": devices,
                                     "device": device, "device_memory_gb": memory}, "test")


def big(overrides: list[str] | None = None) -> Plan:
    return compile_plan(load_job(BIG_JOB, overrides), load_profile(BIG_CLUSTER))


def test_tiny_job_plan():
    plan = compile_plan(load_job(TINY_JOB), load_profile())
    assert plan.world_size == 4
    assert (plan.nodes, plan.devices_per_node) == (1, 4)
    train, infer, ref = plan.roles["actor_train"], plan.roles["actor_infer"], plan.roles["reference"]
    assert list(plan.roles) == ["actor_train", "actor_infer", "reference"]
    assert (train.slots, train.ranks, train.nodes) == ((0, 1), (1, 2), (0,))
    assert (ref.slots, ref.ranks) == ((0, 1), (1, 2))
    assert ref.parallel == train.parallel == {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 2}  # inherited
    assert (infer.slots, infer.ranks) == ((2,), (3,))
    assert train.groups == {"tp": [[0], [1]], "pp": [[0], [1]], "cp": [[0], [1]], "ep": [[0], [1]], "dp": [[0, 1]]}
    assert train.rank_groups["dp"] == [[1, 2]]
    assert [plan.rank_of_slot(s) for s in (0, 1, 2)] == [1, 2, 3]
    assert plan.slot_of_rank(3) == 2
    assert plan.roles_of_rank(1) == ["actor_train", "reference"] and plan.roles_of_rank(0) == []
    with pytest.raises(KeyError, match="slot 3 is not used"):
        plan.rank_of_slot(3)

    stages = plan.to_json()["stages"]
    assert list(stages) == ["rollout", "reward", "logprobs", "train"]
    everyone = ["actor_train", "actor_infer", "reference"]
    stage = {"overlaps": [], "moves": True, "follows": []}
    assert stages["rollout"] == {**stage, "active": {"actor_infer": [2]}, "resident": everyone, "offload": []}
    # scoring runs on the controller: the devices keep what rollout left on them
    assert stages["reward"] == {**stage, "active": {}, "resident": everyone, "offload": [], "moves": False,
                                "follows": ["rollout"]}
    assert stages["logprobs"] == {**stage, "active": {"actor_train": [0, 1], "reference": [0, 1]},
                                  "resident": everyone, "offload": []}
    # the reference and the trainer fit on their devices together: nothing moves
    assert stages["train"] == {**stage, "active": {"actor_train": [0, 1]}, "resident": everyone, "offload": []}
    assert train.memory_gb["train"] > 0 and ref.memory_gb["train"] == ref.memory_gb["logprobs"] > 0
    assert infer.memory_gb["train"] == infer.memory_gb["rollout"] > 0  # alone on its slot: stays resident


def test_idle_roles_leave_a_device_only_when_its_roles_do_not_fit_there_together():
    """Rollout in the trainer's processes: trainer, reference and rollout share slots 0-1. On a
    device that holds all three nothing moves (a move is a copy each way and a stage round trip);
    on one that holds the trainer with either of the others but not all three, each stage change
    sends the idle ones to host memory (the trainer stays: rollout samples with its weights)."""
    job_config = load_job(TINY_JOB, COLOCATED_ROLLOUT)
    fits = compile_plan(job_config, load_profile())
    memory = {name: role.memory for name, role in fits.roles.items()}
    everyone = device_bytes(memory.values()) / 2**30
    pairs = max(device_bytes([memory["actor_train"], memory[other]]) for other in ("reference", "actor_infer")) / 2**30
    assert pairs < everyone
    for device_gb, moves in ((everyone * 1.01, {}), ((pairs + everyone) / 2, {"rollout": ("reference",),
                                                                              "logprobs": ("actor_infer",),
                                                                              "train": ("actor_infer", "reference")})):
        plan = compile_plan(job_config, load_profile().model_copy(update={"device_memory_gb": device_gb}))
        assert {name: stage.offload for name, stage in plan.stages.items() if stage.offload} == moves
        assert (plan.roles["reference"].memory_gb["rollout"] == 0) == bool(moves)


COLOCATED_ROLLOUT = ["roles.actor_infer.colocate_with=actor_train", "roles.actor_infer.parallel.dp=2"]


@pytest.mark.parametrize("overrides, shares", [
    (COLOCATED_ROLLOUT, True),
    ([], False),                                                      # rollout on a rank of its own
    (COLOCATED_ROLLOUT + ["rollout.share_trainer_weights=false"], False),
    (COLOCATED_ROLLOUT + ["model.dtype=bfloat16"], False),            # the trainer's weights are fp32 masters
    (COLOCATED_ROLLOUT + ["roles.actor_train.fsdp=true"], False),     # each rank holds a shard only
])
def test_native_rollout_samples_with_the_trainers_weights_only_where_they_are_the_synced_ones(overrides, shares):
    """Sharing drops rollout's copy of the weights from its memory, keeps the trainer resident
    during rollout (its parameters are being read) and says so in `hpcrl plan`."""
    plan = compile_plan(load_job(TINY_JOB, overrides), load_profile())
    assert plan.rollout_shares_weights == shares
    infer = plan.roles["actor_infer"]
    assert (dict(infer.memory.parts)["weights"] == 0) == shares
    assert ("sampling with actor_train's own weights" in format_plan(plan)) == shares
    if shares:
        assert "actor_train" in plan.stages["rollout"].resident and "actor_train" not in plan.stages["rollout"].offload


def test_json_shape():
    data = json.loads(json.dumps(compile_plan(load_job(TINY_JOB), load_profile()).to_json()))
    assert set(data) == {"world_size", "nodes", "devices_per_node", "roles", "stages", "checkpoint",
                         "rollout_shares_weights"}
    assert data["checkpoint"]["window_s"] is None and data["checkpoint"]["bytes"] > 0, "a local profile has no warning"
    assert (data["world_size"], data["nodes"], data["devices_per_node"]) == (4, 1, 4)
    role = data["roles"]["actor_train"]
    assert set(role) == {"slots", "ranks", "nodes", "parallel", "groups", "memory_gb"}
    assert set(role["groups"]) == {"tp", "pp", "cp", "ep", "dp"}
    assert set(role["memory_gb"]) == {"rollout", "reward", "logprobs", "train"}
    assert role["nodes"] == [0] and role["parallel"]["dp"] == 2
    assert set(data["stages"]["train"]) == {"active", "resident", "offload", "overlaps", "moves", "follows"}


def test_qwen_7b_example_plan():
    plan = big()
    assert plan.world_size == 33
    train, infer, ref = plan.roles["actor_train"], plan.roles["actor_infer"], plan.roles["reference"]
    assert train.slots == tuple(range(16)) and train.ranks == tuple(range(1, 17)) and train.nodes == (0, 1)
    assert infer.slots == tuple(range(16, 32)) and infer.ranks == tuple(range(17, 33)) and infer.nodes == (2, 3)
    assert ref.slots == train.slots and ref.parallel == train.parallel
    assert train.groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert train.groups["pp"] == [[i, i + 8] for i in range(8)]
    assert train.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert infer.groups["tp"] == [[16 + 2 * i, 17 + 2 * i] for i in range(8)]
    assert infer.rank_groups["tp"][0] == [17, 18]
    assert infer.groups["dp"] == [list(range(16, 32, 2)), list(range(17, 32, 2))]
    for role in plan.roles.values():  # every TP group inside one node
        assert all(len({s // 8 for s in g}) == 1 for g in role.groups["tp"])
    assert plan.stages["train"].offload == (), "the reference fits beside the trainer"
    assert plan.stages["rollout"].active == {"actor_infer": tuple(range(16, 32))}
    # 7.6B params over tp*pp = 8: Megatron bf16 weights 2 B/param, fp32 gradient buffer 4 B, fp32 master
    # weights + Adam 12 B over dp = 2; activations of one 4096-token micro-batch: 14 layers per stage x
    # 92416 B per token (2 * (2*3584 + (6*3584 + 3*512 + 4*18944) / 4) + 8*3584) x 2 micro-batches in
    # flight; megatron's attention scores: 7 heads per TP rank x 4096^2, 6 B each (fp32 softmax output and
    # its bf16 copy) kept by those 28 layers, and 8 B of one layer's backward; fp32 logits of 4096
    # positions x 152064/4 vocabulary and their gradient, and 3 fp32 tensors of the 1025 response positions.
    gb = {name: n / 2**30 for name, n in train.memory.parts}
    p = train.memory.params
    assert gb["weights"] == pytest.approx(2 * p / 8 / 2**30) and gb["grads"] == pytest.approx(4 * p / 8 / 2**30)
    assert gb["master+Adam"] == pytest.approx(12 * p / 16 / 2**30)
    assert gb["activations"] == pytest.approx(4096 * 14 * 92416 * 2 / 2**30)
    assert gb["attention scores"] == pytest.approx(7 * 4096 ** 2 * (14 * 2 * 6 + 8) / 2**30)
    assert gb["logits"] == pytest.approx((4096 * 2 + 1025 * 3) * 38016 * 4 / 2**30)
    assert 41.3 < train.memory_gb["train"] < 41.4
    # weights 1.8, activations 0.35, one layer's scores 1.5 (6 B kept and 8 B working), logits 1.0
    assert 4.6 < ref.memory_gb["logprobs"] == ref.memory_gb["train"] < 4.7
    # the two compute one after another: the trainer's working set beside both roles' weights and state
    assert max(plan.stages["logprobs"].slot_memory_gb.values()) == pytest.approx(
        (train.memory.total + ref.memory.part("weights")) / 2**30)
    # vLLM tp2: weights 7.1 GB + KV 64 seqs x 4096 tokens x 2*28*2*128*2 B = 7.0 GB, inside its pool of
    # rollout.gpu_memory_utilization 0.5 x 80 GB
    assert infer.memory.part("weights") + infer.memory.part("KV cache") == pytest.approx(14.09 * 2**30, rel=1e-3)
    assert infer.memory_gb["rollout"] == pytest.approx(40.0)


def test_qwen_7b_parameter_count_and_hf_config(tmp_path):
    shape = ModelShape.from_model(load_job(BIG_JOB).model)
    assert count_parameters(shape) == 7_615_616_512  # Qwen2.5-7B as published
    config = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
              "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064,
              "tie_word_embeddings": False, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_path = load_job(BIG_JOB, [f"model.path={tmp_path}"]).model
    assert count_parameters(ModelShape.from_model(from_path)) == 7_615_616_512
    assert ModelShape.from_model(from_path).max_position_embeddings == 4096  # the job's explicit cap
    tiny = ModelShape.from_model(load_job(TINY_JOB).model)
    # vocab 256 (unset), tied: 256*64 + 2 * (64*64+64 + 2*(64*32+32) + 64*64 + 3*64*128 + 2*64) + 64
    assert count_parameters(tiny) == 256 * 64 + 2 * (4160 + 2 * 2080 + 4096 + 24576 + 128) + 64
    assert count_parameters(tiny, head="value") == count_parameters(tiny) + 65


SHARED_NODES = ["roles.actor_train.placement.nodes=0-1", "roles.actor_infer.placement.nodes=0-1",
                "roles.actor_infer.parallel.dp=8"]


def test_explicit_nodes_time_share_with_offload():
    """vLLM's 0.75 of the GPU and the trainer do not fit together: each stage keeps its own roles."""
    plan = big([*SHARED_NODES, "rollout.max_staleness=0", "rollout.gpu_memory_utilization=0.75"])
    assert plan.world_size == 17
    assert plan.roles["actor_infer"].slots == plan.roles["actor_train"].slots == tuple(range(16))
    assert plan.stages["rollout"].offload == ("actor_train", "reference")
    assert plan.stages["logprobs"].offload == ("actor_infer",)
    assert plan.stages["train"].offload == ("actor_infer", "reference")
    assert plan.roles["actor_infer"].memory_gb["train"] == 0
    assert plan.residency == {"rollout": ("actor_infer",), "logprobs": ("actor_train", "reference"),
                              "train": ("actor_train",)}
    assert plan.stages["reward"].follows == ("rollout",) and plan.stages["reward"].resident == ("actor_infer",)


def test_async_rollout_beside_training_stays_resident_and_the_memory_check_adds_it_up():
    """With max_staleness >= 1 rollout generates while the trainer computes log-probs and trains: on
    shared devices nothing of either may leave, so the stages' memory adds up; the reference, which
    logprobs needs beside both, then has room in train too and stays. Over the device, the plan says
    why and what to change."""
    plan = big([*SHARED_NODES, "rollout.gpu_memory_utilization=0.4"])
    rollout, logprobs, train = (plan.stages[s] for s in ("rollout", "logprobs", "train"))
    assert not rollout.moves and rollout.overlaps == ("logprobs", "train") and rollout.offload == ()
    assert logprobs.overlaps == train.overlaps == ("rollout", "reward")
    assert logprobs.offload == () and train.offload == ()
    everyone = ("actor_train", "actor_infer", "reference")
    assert plan.residency == {"logprobs": everyone, "train": everyone}
    roles = plan.roles
    both = device_bytes(role.memory for role in roles.values())
    assert max(logprobs.slot_memory_gb.values()) == pytest.approx(both / 2**30)
    assert rollout.slot_memory_gb == logprobs.slot_memory_gb == train.slot_memory_gb
    assert roles["reference"].memory_gb["rollout"] == roles["reference"].memory_gb["train"] > 0
    text = format_plan(plan)
    assert "stage rollout (alongside logprobs or train: rollout.max_staleness >= 1)" in text
    assert "node 0  at+AI+ref " in text, "the reference stays on the devices"
    with pytest.raises(PlacementError, match=r"in stage rollout \(alongside logprobs\).*actor_infer runs "
                       r"alongside logprobs and cannot time-share these devices.*rollout.max_staleness: 0"):
        big([*SHARED_NODES, "rollout.gpu_memory_utilization=0.75"])
    assert big([*SHARED_NODES, "rollout.gpu_memory_utilization=0.75", "rollout.max_staleness=0"])


def test_a_role_idle_on_its_own_devices_is_named_in_the_stage_it_works_in():
    rejects("roles.actor_train.parallel: the memory estimate in stage logprobs is 187.10 GB on slot 0",
            load_job(BIG_JOB, ["rollout.max_staleness=0", "roles.actor_train.parallel.tp=1",
                               "roles.actor_train.parallel.pp=1", "roles.actor_train.parallel.dp=4"]),
            load_profile(BIG_CLUSTER))


def test_a_role_that_may_not_leave_its_devices_is_counted_in_every_stage():
    plan = big([*SHARED_NODES, "rollout.max_staleness=0", "rollout.gpu_memory_utilization=0.75",
                "roles.reference.offload=false"])
    assert "reference" in plan.stages["rollout"].resident and plan.stages["train"].offload == ("actor_infer",)
    assert plan.roles["reference"].memory_gb["rollout"] == plan.roles["reference"].memory_gb["logprobs"] > 0


def test_explicit_nodes_and_default_fill_skip_partial_tp_groups():
    plan = compile_plan(job(actor_train={"parallel": {"dp": 3}},
                            actor_infer={"engine": "vllm", "parallel": {"tp": 2, "dp": 2}},
                            reward={"placement": {"nodes": "2"}, "parallel": {"dp": 4}}), cluster(nodes=3, device="cuda"))
    assert plan.roles["reward"].slots == (8, 9, 10, 11)  # explicit roles are placed first
    assert plan.roles["actor_train"].slots == (0, 1, 2)
    assert plan.roles["actor_infer"].slots == (4, 5, 6, 7)  # slot 3 cannot hold a TP group of 2
    assert plan.world_size == 1 + 3 + 4 + 4 and plan.rank_of_slot(4) == 4
    assert plan.roles["reward"].memory_gb == {s: 0.0 for s in ("rollout", "reward", "logprobs", "train")}


def test_format_plan_tiny():
    text = format_plan(compile_plan(load_job(TINY_JOB), load_profile()))
    assert "world_size 4" in text
    assert ("stage train: active actor_train; resident actor_train, actor_infer, reference; in host memory -; "
            "offload at entry -; peak") in text
    assert "node 0  AT+ref  AT+ref  ai" in text
    assert "node 0  AT+REF  AT+REF  ai" in text
    assert "actor_train (torch): tp1 pp1 cp1 ep1 dp2 on node 0, slots 0-1, ranks 1-2" in text
    assert "dp  [1,2]" in text


def test_format_plan_big_and_cli(capsys):
    from hpcrl.placement.__main__ import main
    assert main([str(BIG_JOB), "--cluster", str(BIG_CLUSTER)]) == 0
    out = capsys.readouterr().out
    assert "node 3  AI   " in out and "tp  [1-4] [5-8] [9-12] [13-16]" in out
    assert main([str(BIG_JOB), "--cluster", str(BIG_CLUSTER), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 33
    assert main([str(TINY_JOB), "--set", "roles.actor_train.parallel.dp=4"]) == 2
    assert "needs tp*pp*cp*dp = 1 slots" in capsys.readouterr().err


def test_placement_does_not_import_torch():
    code = "import sys, hpcrl.placement, hpcrl.placement.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


# ---------------------------------------------------------------- rejections

def rejects(match: str, job_config: JobConfig, profile: ClusterProfile) -> str:
    with pytest.raises(PlacementError) as info:
        compile_plan(job_config, profile)
    message = str(info.value)
    assert match in message, message
    return message


def test_rejects_world_size_not_matching_explicit_nodes():
    rejects('roles.actor_train.parallel: tp*pp*cp*dp = 8 but placement.nodes "0" gives 4 slots',
            job(actor_train={"parallel": {"dp": 8}, "placement": {"nodes": "0"}}, actor_infer={}), cluster(nodes=3))


def test_rejects_explicit_nodes_held_in_the_same_stage():
    message = rejects('roles.actor_infer.parallel: tp*pp*cp*dp = 4 but placement.nodes "0" gives 0 slots '
                      "(4 of its 4 devices are held by actor_train, active in stage train too)",
                      job(actor_train={"parallel": {"dp": 4}, "placement": {"nodes": "0"}},
                          actor_infer={"parallel": {"dp": 4}, "placement": {"nodes": "0"}, "stages": ["rollout", "train"]}),
                      cluster(nodes=2))
    assert "colocate_with" in message


def test_rejects_colocated_world_size_mismatch():
    message = rejects("roles.reference.parallel: tp*pp*cp*dp = 1 but colocate_with: actor_train gives 2 slots",
                      job(actor_train={"parallel": {"dp": 2}}, actor_infer={},
                          reference={"parallel": {"dp": 1}, "colocate_with": "actor_train"}), cluster())
    assert "same world size" in message


def test_rejects_tp_larger_than_a_node():
    message = rejects("roles.actor_infer.parallel: tp = 8 but a node of cluster c has 4 devices",
                      job({"num_heads": 8}, actor_train={}, actor_infer={"engine": "vllm", "parallel": {"tp": 8}}),
                      cluster(nodes=2, device="cuda"))
    assert "cross nodes" in message


def test_rejects_tp_group_crossing_nodes():
    # actor_train fills slots 0-2, actor_infer gets 3 and 4 (tp 1: fine); reference (tp 2) on those crosses nodes
    message = rejects("roles.reference.parallel: the TP group on slots [3, 4] crosses nodes 0, 1",
                      job(actor_train={"parallel": {"dp": 3}}, actor_infer={"parallel": {"dp": 2}},
                          reference={"engine": "megatron", "parallel": {"tp": 2}, "colocate_with": "actor_infer"}),
                      cluster(nodes=2))
    assert "inside one node" in message


def test_vllm_must_fit_one_sequence_of_the_whole_context_beside_its_weights():
    """vLLM refuses to start when its pool cannot hold one sequence of the context it serves; the
    plan refused only weights that filled the pool."""
    fits = big(["rollout.gpu_memory_utilization=0.11"])
    assert fits.roles["actor_infer"].parallel["tp"] == 2
    message = rejects("rollout.gpu_memory_utilization: vLLM's share of a 80 GB device is 8.80 GB; the rollout weights "
                      "take 7.09 GB per device and one sequence of the 32768 positions of the context 0.88 GB",
                      load_job(BIG_JOB, ["rollout.gpu_memory_utilization=0.11", "model.max_position_embeddings=32768"]),
                      load_profile(BIG_CLUSTER))
    assert "cap the context with model.max_position_embeddings" in message


def test_the_plan_estimates_the_checkpoint_and_warns_when_it_outlasts_the_warning_window():
    seven_b = big().checkpoint
    assert 90e9 < seven_b.bytes < 110e9, "7.6B params x (2 + 8 + 4) bytes"
    assert seven_b.nodes == 2 and seven_b.window_s == 600 and not seven_b.too_slow
    # the 30B's ~400 GB take ~214 s: inside 300 s, but not after the step in flight has ended first
    thirty_b = compile_plan(load_job(REPO_ROOT / "jobs/qwen3-30b-a3b-grpo.yaml"),
                            load_profile(BIG_CLUSTER, ["slurm.signal=B:USR2@300"])).checkpoint
    assert 150 < thirty_b.seconds < 300 and thirty_b.too_slow
    slow = compile_plan(load_job(BIG_JOB), load_profile(BIG_CLUSTER, ["checkpoint_write_gbps=0.2"]))
    assert slow.checkpoint.too_slow
    text = format_plan(slow)
    assert "WARNING: the checkpoint may not be saved within the warning window" in text and "B:USR2@" in text


def test_rejects_a_step_that_does_not_split_over_the_trainer_replicas():
    rejects("train.prompts_per_step x algorithm.group_size = 36 samples per step do not split into "
            "roles.actor_train.parallel.dp = 4 replicas x train.minibatches = 2",
            validate(JobConfig, {**job_dict(actor_train={"parallel": {"dp": 4}}, actor_infer={}),
                                 "train": {"prompts_per_step": 9, "minibatches": 2},
                                 "algorithm": {"group_size": 4}}, "test"), cluster(nodes=2))


def test_rejects_two_roles_active_on_one_slot_in_a_stage():
    # actor_infer (rollout) on node 1; actor_train (train) on node 0; reference (rollout) on nodes 0-1 starts
    # at slot 0 (actor_train is not active in rollout) and so runs into actor_infer's slots in rollout.
    rejects("roles.reference.placement: reference and actor_infer are both active in stage rollout on slot 4 "
            "(node 1, device 0) but are not colocated",
            job(actor_train={"parallel": {"dp": 4}, "placement": {"nodes": "0"}, "stages": ["train"]},
                actor_infer={"parallel": {"dp": 4}, "placement": {"nodes": "1"}},
                reference={"parallel": {"dp": 8}, "placement": {"nodes": "0-1"}, "stages": ["rollout"]}),
            cluster(nodes=2))


def test_rejects_more_slots_than_the_cluster_has():
    message = rejects("roles.actor_infer.parallel: needs tp*pp*cp*dp = 1 slots",
                      load_job(TINY_JOB, ["roles.actor_train.parallel.dp=4"]), load_profile())
    assert "The job needs 5 device slots and cluster local has 4" in message
    assert "more nodes" in message
    message = rejects('roles.actor_infer.placement.nodes "4-5": cluster c has 4 node(s), 0-3',
                      job(actor_train={}, actor_infer={"placement": {"nodes": "4-5"}}), cluster(nodes=4))
    assert "more slots than the cluster has" in message


SEVEN_B = "jobs/qwen2.5-7b-grpo.yaml", "clusters/example-4x8-h100.yaml"
TINY = "jobs/tiny_grpo.yaml", "clusters/local.yaml"
FROZEN = "jobs/tiny_frozenlake.yaml", "clusters/local.yaml"
REFUSED = [  # what an engine would refuse at start-up, given to `hpcrl plan`: (job, cluster), --set, the key named
    (SEVEN_B, ["roles.actor_train.parallel.cp=2"], "roles.actor_train.parallel.cp: cp = 2, but context parallelism"),
    (SEVEN_B, ["roles.actor_train.parallel.ep=2"], "roles.actor_train.parallel.ep: ep = 2 splits the experts of a "
     "mixture-of-experts model, and this model is dense"),
    (SEVEN_B, ["model.num_kv_heads=7"],
     "roles.actor_train.parallel.tp: 7 KV heads (model.num_kv_heads) neither split over tp = 4 nor share out"),
    (SEVEN_B, ["model.num_heads=14", "model.num_kv_heads=2"],
     "roles.actor_train.parallel.tp: 14 attention heads (model.num_heads) do not split over tp = 4"),
    (SEVEN_B, ["model.vocab_size=152063"], "model.vocab_size: 152063 does not split evenly over roles.actor_train"),
    (SEVEN_B, ["model.num_layers=27"], "model.num_layers: 27 layers do not split evenly into roles.actor_train"),
    (SEVEN_B, ["train.minibatches=3"], "do not split into roles.actor_train.parallel.dp = 2 replicas x "
                                       "train.minibatches = 3"),
    (SEVEN_B, ["roles.actor_infer.parallel.pp=2", "roles.actor_infer.parallel.dp=4"],
     "roles.actor_infer.parallel.pp: pp = 2, but hpcrl runs vLLM with tensor parallelism only"),
    (TINY, ["roles.actor_infer.parallel.tp=2", "roles.actor_infer.parallel.dp=1"],
     "roles.actor_infer.parallel.tp: tp = 2, but the native sampler runs one whole copy"),
    (TINY, ["roles.actor_train.parallel.tp=2"], "roles.actor_train.parallel.tp: tp = 2, but the torch engine is "
                                                "data parallel only"),
    (TINY, ["roles.critic={}"], "roles.critic: only algorithm.advantage gae uses a critic"),
    (TINY, ["algorithm.name=ppo"], "algorithm.advantage: gae (algorithm.name 'ppo') needs a value model"),
    (TINY, ["algorithm.name=ppo", "roles.critic.engine=megatron"],
     "roles.critic.engine: megatron: hpcrl builds Megatron's GPTModel with a vocabulary head only"),
    (TINY, ["algorithm.name=gspo", "algorithm.dual_clip_c=3"], "dual_clip_c applies to policy_loss ppo_clip"),
    (TINY, ["roles.reference=null", "algorithm.kl_loss.coef=0.01"],
     "algorithm.kl_loss.coef: 0.01 measures the KL to the reference policy"),
    (TINY, ["roles.actor_infer.engine=vllm", "rollout.top_p=0.9", "rollout.temperature=0.7"],
     "rollout.top_p/top_k with rollout.temperature 0.7 and engine vllm"),
    (TINY, ["roles.env={}"], "roles.env: env workers host the envs of a job's env section, and this job has none"),
    (FROZEN, ["roles.env={colocate_with: actor_infer}"],
     "roles.env.colocate_with: an env rank answers its rollout ranks' env calls while they decode"),
    (FROZEN, ["roles.env={parallel: {dp: 1}}", "roles.actor_infer={engine: native, colocate_with: env}"],
     "roles.actor_infer.colocate_with: an env rank answers"),
    (FROZEN, ["roles.env={parallel: {dp: 2}}"], "roles.env.parallel: 2 env ranks for 1 rollout ranks"),
    (FROZEN, ["roles.env={parallel: {tp: 2}}", "roles.actor_infer.parallel.dp=2"],
     "roles.env.parallel.tp: tp = 2, but the text engine is data parallel only"),
    (TINY, ["rollout.max_new_tokens=64"], "rollout.max_new_tokens: 64 response tokens leave no room for a prompt in the "
                                          "model's context of 64 positions (model.max_position_embeddings)"),
    (TINY, ["task.eval_size=8"], "task.eval_size: unknown key. Allowed here: digits, max_count, modulus, name"),
    (TINY, ["model.arch=qwen2_moe", "model.num_experts=6", "roles.actor_train.engine=megatron",
            "roles.actor_train.parallel.ep=4", "roles.actor_train.parallel.dp=4"],
     "roles.actor_train.parallel.ep: 6 experts do not split over ep = 4"),
    (TINY, ["roles.actor_train.engine=deepspeed", "roles.actor_train.parallel.cp=2"],
     "roles.actor_train.parallel.cp: cp = 2, but the deepspeed engine is data parallel only"),
    (TINY, ["algorithm.moe_aux_loss_coef=0.01"], "algorithm.moe_aux_loss_coef: arch qwen2 has no router to balance"),
    (TINY, ["model.arch=qwen2_moe", "model.num_experts=4", "model.moe_intermediate_size=33",
            "roles.actor_train.engine=megatron", "roles.actor_train.parallel.tp=2", "roles.actor_train.parallel.dp=1"],
     "model: the MLP widths [128, 33, 128] (intermediate_size, and a MoE model's moe_intermediate_size"),
    (TINY, ["model.arch=mixtral", "model.num_experts=4", "algorithm.moe_aux_loss_coef=0.01",
            "roles.actor_train.engine=deepspeed"], "algorithm.moe_aux_loss_coef: the deepspeed engine adds no"),
    (TINY, ["model.arch=mixtral", "model.num_experts=4", "algorithm.moe_aux_loss_coef=0.01", "train.recompute=true",
            "roles.actor_train.engine=megatron"], "algorithm.moe_aux_loss_coef: megatron recomputes a layer's forward"),
    (TINY, ["model.arch=mixtral", "model.num_experts=4", "roles.actor_train.engine=megatron",
            "roles.actor_train.parallel.ep=4", "roles.actor_train.parallel.dp=2"],
     "roles.actor_train.parallel.ep: the expert-parallel ranks are data-parallel ranks of the dense layers "
     "(megatron-core folds ep into dp x cp = 2), and ep = 4 does not divide 2"),
    (TINY, ["model.num_experts=4"], "num_experts applies to mixture-of-experts archs (qwen2_moe, qwen3_moe, mixtral), "
                                    "not arch qwen2"),
    (TINY, ["model.arch=mixtral"], "num_experts: arch mixtral is a mixture of experts; give its number of experts"),
    (TINY, ["model.arch=mixtral", "model.num_experts=4", "model.shared_expert_intermediate_size=8"],
     "shared_expert_intermediate_size: arch mixtral has no shared expert"),
    (TINY, ["model.arch=qwen3_moe", "model.num_experts=2", "model.experts_per_token=3"],
     "experts_per_token 3 is more than num_experts 2"),
]


def test_env_ranks_are_counted_against_the_rollout_ranks_the_plan_resolves():
    """A colocated rollout without its own `parallel` takes its target's sizes: two rollout ranks,
    so two env ranks (one each) are a valid plan, on slots of their own."""
    job = load_job(REPO_ROOT / FROZEN[0], ["roles.actor_infer={engine: native, colocate_with: actor_train}",
                                           "roles.env={parallel: {dp: 2}}"])
    roles = compile_plan(job, load_profile()).roles
    assert len(roles["actor_infer"].slots) == len(roles["env"].slots) == 2
    assert not set(roles["env"].slots) & set(roles["actor_infer"].slots)


@pytest.mark.parametrize("files, overrides, message", REFUSED, ids=[m.split(":")[0] + f"[{i}]"
                                                                   for i, (_, _, m) in enumerate(REFUSED)])
def test_the_plan_refuses_what_an_engine_would_refuse_naming_the_key(files, overrides, message, capsys,
                                                                     monkeypatch, tmp_path):
    """`hpcrl plan`'s command line (in this process: a dozen interpreters would cost 20 s): exit 2 and
    the message; `hpcrl run` (local profile) and `hpcrl submit --dry-run` (Slurm) refuse the same way,
    before a run directory exists or a rank starts."""
    from hpcrl.cli import main

    monkeypatch.chdir(REPO_ROOT)
    job_file, cluster_file = files
    sets = [x for o in overrides for x in ("--set", o)]
    start = ["run", job_file] if cluster_file.endswith("local.yaml") else ["submit", job_file, "--dry-run"]
    for command in (["plan", job_file], start):
        code = main([*command, "--cluster", cluster_file, "--run-dir", str(tmp_path / "run"), *sets]
                    if command[0] != "plan" else [*command, "--cluster", cluster_file, *sets])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (command, err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arch, sizes", [("qwen2_moe", {"num_experts": 4, "moe_intermediate_size": 32}),
                                         ("qwen3_moe", {"num_experts": 8, "experts_per_token": 3}),
                                         ("mixtral", {"num_experts": 4})])
def test_moe_parameter_counts_are_the_hugging_face_models(arch, sizes, tmp_path):
    """Router, experts and (Qwen2-MoE) the gated shared expert, counted from the job's sizes and from
    a saved model's config.json (with dense layers from mlp_only_layers), equal transformers' own."""
    transformers = pytest.importorskip("transformers")
    import torch

    from hpcrl.engines.hf_model import hf_config, random_model

    class Chars:
        vocab_size, pad_token_id, bos_token_id, eos_token_id = 40, 0, 1, 2

    model = load_job(TINY_JOB, [f"model.arch={arch}", "model.tie_word_embeddings=false", "model.vocab_size=40",
                                *[f"model.{k}={v}" for k, v in sizes.items()]]).model
    built = random_model(model, Chars, seed=1)
    assert count_parameters(ModelShape.from_model(model)) == sum(p.numel() for p in built.parameters())
    config = hf_config(model, 40, 0, 1, 2)
    if arch != "mixtral":
        config.mlp_only_layers = [0]   # Qwen-MoE can keep some layers dense
    config.save_pretrained(tmp_path)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    from_path = load_job(TINY_JOB, [f"model.path={tmp_path}"]).model
    assert count_parameters(ModelShape.from_model(from_path)) == sum(p.numel() for p in saved.parameters())
    # a config.json that leaves the expert counts out means transformers' defaults for its model type
    fields = json.loads((tmp_path / "config.json").read_text())
    for key in ("num_experts", "num_local_experts", "moe_intermediate_size", "shared_expert_intermediate_size"):
        fields.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    with torch.device("meta"):
        defaulted = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert count_parameters(ModelShape.from_model(from_path)) == sum(p.numel() for p in defaulted.parameters())


def test_rejects_memory_over_the_device():
    message = rejects("roles.actor_train.parallel: the memory estimate in stage logprobs is 171.15 GB on slot 0",
                      load_job(BIG_JOB, ["roles.actor_train.parallel.tp=1", "roles.actor_train.parallel.pp=1",
                                         "roles.actor_train.parallel.dp=16"]), load_profile(BIG_CLUSTER))
    assert "over the device's 80 GB" in message and "reference 25.29 GB (weights 14.19 GB" in message


NATIVE_ROLLOUT = ["roles.actor_infer.engine=native", "roles.actor_infer.parallel.tp=1",
                  "roles.actor_infer.parallel.dp=16", "train.prompts_per_step=1024"]


def test_vllm_keeps_the_kv_cache_inside_its_pool_so_a_large_step_waits_rather_than_being_refused():
    """vLLM takes rollout.gpu_memory_utilization of the device and preempts sequences when its KV
    cache is full: 1024 prompts x 8 need 112 GB of KV cache per replica, and it holds its 40 GB."""
    for overrides in ([], ["rollout.max_num_seqs=256"]):
        infer = big(["train.prompts_per_step=1024", *overrides]).roles["actor_infer"].memory
        assert infer.total == int(0.5 * 80 * 2**30)
    assert infer.part("KV cache") == 256 * 4096 * 2 * 28 * 2 * 128 * 2   # 256 sequences at once, kv heads over tp 2


def test_rollout_max_num_seqs_bounds_the_native_samplers_kv_cache():
    message = rejects("roles.actor_infer.parallel: the memory estimate in stage rollout is 126.19 GB",
                      load_job(BIG_JOB, NATIVE_ROLLOUT), load_profile(BIG_CLUSTER))
    assert "KV cache 112.00 GB" in message and "raise dp of actor_infer (now dp 16)" in message
    assert "cap rollout.max_num_seqs" in message
    infer = big([*NATIVE_ROLLOUT, "rollout.max_num_seqs=64"]).roles["actor_infer"].memory
    assert infer.part("KV cache") == 64 * 4096 * 2 * 28 * 4 * 128 * 2


def test_the_fix_names_only_what_lowers_the_role_on_this_cluster():
    """tp is already a node's 8 GPUs and vLLM has no pp; dp shards Megatron's optimizer state; and
    no layout of the 72B trainer without recompute fits the 128 GPUs."""
    message = rejects("roles.actor_train.parallel: the memory estimate",
                      load_job(REPO_ROOT / "jobs" / "qwen2.5-72b-grpo.yaml", ["train.recompute=false"]),
                      load_profile(REPO_ROOT / "clusters" / "example-16x8-h100.yaml"))
    assert "Fix: raise pp or dp of actor_train (now pp 4, dp 4), or keep fewer activations (train.recompute" in message
    needs = message.split("no layout of actor_train fits on the cluster's 128 devices: alone it needs at least ")[1]
    assert int(needs.split()[0]) > 128
    message = rejects("roles.actor_infer.parallel: the memory estimate in stage rollout",
                      load_job(BIG_JOB, ["roles.actor_infer.colocate_with=actor_train", "roles.actor_infer.parallel.tp=4",
                                         "roles.actor_infer.parallel.dp=4", "rollout.gpu_memory_utilization=0.9",
                                         "rollout.max_staleness=0", "roles.actor_train.offload=false"]),
                      load_profile(BIG_CLUSTER))
    assert "Fix: lower rollout.gpu_memory_utilization (0.9" in message and " pp" not in message


def test_a_megatron_pipeline_trains_at_least_pp_micro_batches_whatever_micro_batch_size_says():
    """With pp 4 the runtime cuts a DP rank's 16-row minibatch into 4 micro-batches of 4 with
    train.micro_batch_size unset, as with 4: the plan counts the same 4 rows x 4 in flight."""
    from hpcrl.config.job import Parallel
    from hpcrl.placement.memory import estimate_role_memory

    job72 = REPO_ROOT / "jobs" / "qwen2.5-72b-grpo.yaml"
    shape, parallel = ModelShape.from_model(load_job(job72).model), Parallel(tp=8, pp=4, dp=4)
    unset, four = (estimate_role_memory("actor_train", load_job(job72, [f"train.micro_batch_size={size}"]), shape,
                                        parallel) for size in ("null", 4))
    assert unset.parts == four.parts


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_the_plans_micro_batches_are_the_megatron_runtimes(pp):
    import numpy as np

    from hpcrl.config.job import Parallel
    from hpcrl.engines.megatron.packing import equal_micro_batches
    from hpcrl.engines.micro_batches import micro_batching
    from hpcrl.placement.memory import micro_batches

    for prompts, micro, tokens in product((1, 3, 4, 12, 32), (None, 1, 3, 4), (None, 6000, 20000)):
        job_config = load_job(BIG_JOB, [f"train.prompts_per_step={prompts}", "train.minibatches=1",
                                        f"train.micro_batch_size={micro or 'null'}",
                                        f"train.max_tokens_per_micro_batch={tokens or 'null'}"])
        share = prompts * job_config.algorithm.group_size // 2
        groups = equal_micro_batches(micro_batching(job_config.train, joined=True), np.full(share, 3072),
                                     np.full(share, 1024), pp)
        assert micro_batches(job_config, Parallel(pp=pp, dp=2), 4096) == (len(groups[0]), len(groups))


LLAMA_31 = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
            "hidden_act": "silu", "rope_theta": 500000.0, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}


def test_a_model_path_the_megatron_engine_cannot_convert_is_refused_before_anything_starts(tmp_path):
    """Llama-3.1's rope scaling is what the megatron engine refuses when it builds, after the nodes
    have started; the plan reads config.json and refuses it first, with the engine that can run it."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31))
    overrides = [f"model.path={tmp_path}", "model.arch=llama"]
    message = rejects(f"model.path: {tmp_path / 'config.json'} has rope_type='llama3': only plain rotary "
                      "embeddings are converted", load_job(BIG_JOB, overrides), load_profile(BIG_CLUSTER))
    assert "megatron engine of roles.actor_train, roles.reference would refuse it" in message
    assert "give them engine torch" in message
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31, "rope_scaling": None}))
    assert big(overrides).roles["actor_train"].engine == "megatron"


def test_the_plan_and_the_megatron_engine_refuse_the_same_configs():
    """One table (engines/capabilities.megatron_model_refusals) on config.json's fields and on a
    transformers config's."""
    transformers = pytest.importorskip("transformers")
    from hpcrl.engines.capabilities import megatron_model_refusals

    for change in ({}, {"hidden_act": "gelu"}, {"attention_bias": True}, {"rope_scaling": None},
                   {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}):
        fields = {**LLAMA_31, **change}
        parsed = transformers.LlamaConfig(**fields).to_dict()
        assert megatron_model_refusals(fields) == megatron_model_refusals(parsed), change


def test_zero_divides_optimizer_gradients_and_weights_by_dp():
    from hpcrl.placement.memory import ModelShape, estimate_role_memory

    overrides = ["roles.actor_train.parallel.tp=1", "roles.actor_train.parallel.pp=1",
                 "roles.actor_train.parallel.dp=8", "roles.actor_train.engine=deepspeed"]
    totals = {}
    for stage in (1, 2, 3):
        job = load_job(BIG_JOB, [*overrides, f"roles.actor_train.zero_stage={stage}"])
        totals[stage] = estimate_role_memory("actor_train", job, ModelShape.from_model(job.model),
                                             job.roles.actor_train.parallel)
    # bf16: weights 2 B, gradients 2 B (4 B partitioned from ZeRO-2: summed and reduced in fp32), fp32 master
    # weights and Adam 12 B per parameter
    p = totals[1].params
    state = {stage: sum(e.part(k) for k in ("weights", "grads", "master+Adam")) for stage, e in totals.items()}
    assert state[1] == 2 * p + 2 * p + math.ceil(12 * p / 8)
    assert state[2] == 2 * p + math.ceil(4 * p / 8) + math.ceil(12 * p / 8)
    assert state[3] == math.ceil(2 * p / 8) + math.ceil(4 * p / 8) + math.ceil(12 * p / 8)
    assert len({e.part("activations") for e in totals.values()}) == 1, "ZeRO does not shard activations"


def test_rejects_bad_colocation():
    rejects("roles.reference.colocate_with: a role cannot colocate with itself",
            job(actor_train={}, actor_infer={}, reference={"colocate_with": "reference"}), cluster())
    rejects("roles.reference.colocate_with: 'critic' is not a role of this job",
            job(actor_train={}, actor_infer={}, reference={"colocate_with": "critic"}), cluster())
    rejects("roles.reference: give either placement or colocate_with, not both",
            job(actor_train={}, actor_infer={}, reference={"colocate_with": "actor_train", "placement": {"nodes": "0"}}),
            cluster())
    rejects("roles.actor_train.colocate_with: colocation cycle actor_train -> actor_infer -> actor_train",
            job(actor_train={"colocate_with": "actor_infer"}, actor_infer={"colocate_with": "actor_train"}), cluster())


def test_rejects_missing_model_path(tmp_path):
    rejects("model.path:", load_job(TINY_JOB, [f"model.path={tmp_path / 'nope'}"]), load_profile())


def test_inputs_are_not_changed():
    config = load_job(TINY_JOB)
    before = copy.deepcopy(config.model_dump())
    compile_plan(config, load_profile())
    assert config.model_dump() == before


def test_rejects_vllm_on_a_cpu_cluster():
    rejects("roles.actor_infer.engine: vllm runs on GPUs only, and cluster local has device: cpu",
            load_job(REPO_ROOT / "jobs" / "tiny_grpo.yaml", ["roles.actor_infer.engine=vllm"]),
            load_profile(REPO_ROOT / "clusters" / "local.yaml"))


def test_a_rollout_replica_is_its_tp_group_and_its_first_rank_leads():
    from hpcrl.runtime.layout import world_layout

    plan = compile_plan(load_job(BIG_JOB), load_profile(BIG_CLUSTER))
    infer = world_layout(plan).roles["actor_infer"]
    tp_groups = plan.roles["actor_infer"].rank_groups["tp"]
    assert len(tp_groups) == 8 and all(len(g) == 2 for g in tp_groups)
    for group in tp_groups:
        assert all(infer.replica_of(rank) == sorted(group) for rank in group)
    leaders = {infer.replica_of(rank)[0] for rank in infer.ranks}
    assert len(leaders) == 8, "one vLLM engine per rollout DP replica"


def test_the_72b_example_time_shares_all_128_gpus_stage_by_stage():
    plan = compile_plan(load_job(REPO_ROOT / "jobs" / "qwen2.5-72b-grpo.yaml"),
                        load_profile(REPO_ROOT / "clusters" / "example-16x8-h100.yaml"))
    assert plan.world_size == 129 and all(role.slots == tuple(range(128)) for role in plan.roles.values())
    assert plan.residency == {"rollout": ("actor_infer",), "logprobs": ("actor_train", "reference"),
                              "train": ("actor_train",)}
    peaks = {name: max(stage.slot_memory_gb.values()) for name, stage in plan.stages.items()}
    assert peaks["rollout"] == peaks["reward"] == pytest.approx(68.0), "vLLM's 0.85 share, alone on the GPUs"
    assert 32.1 < peaks["logprobs"] < 32.2 and 27.7 < peaks["train"] < 27.8
    text = format_plan(plan)
    assert ("stage rollout: active actor_infer; resident actor_infer; in host memory actor_train, reference; "
            "offload at entry actor_train, reference; peak 68.00 GB of 80 GB per device") in text
    assert "stage reward: active none (controller only); resident actor_infer;" in text
    assert "moves nothing at entry, resident as in rollout" in text


def test_the_30b_a3b_example_splits_its_experts_over_8_ep_ranks_of_each_16_way_replica_set():
    """Qwen3-30B-A3B on 4 x 8 H100: the trainer's ep groups are 8 consecutive DP ranks, and each GPU
    holds the dense parameters whole and 1/8 of the routed experts (28.99B of the 30.5B)."""
    job_config = load_job(REPO_ROOT / "jobs" / "qwen3-30b-a3b-grpo.yaml")
    plan = compile_plan(job_config, load_profile(REPO_ROOT / "clusters" / "example-4x8-h100.yaml"))
    trainer = plan.roles["actor_train"]
    assert trainer.rank_groups["ep"] == [list(range(1, 9)), list(range(9, 17))]
    assert trainer.rank_groups["dp"] == [list(range(1, 17))]
    shape = ModelShape.from_model(job_config.model)
    params = count_parameters(shape)
    experts = 48 * 128 * 3 * 2048 * 768
    assert 30.4e9 < params < 30.6e9 and shape.head_dim == 128
    assert trainer.memory.part("weights") == math.ceil((params - experts + experts / 8) * 2)
    assert trainer.memory.part("master+Adam") == math.ceil(params * 12 / 16)
    assert max(stage.slot_memory_gb[0] for stage in plan.stages.values()) < 80


def test_the_long_context_example_splits_each_32k_sequence_over_the_8_gpus_of_a_node():
    """Qwen2.5-7B with 32K-token sequences: cp groups are a node's 8 GPUs, FSDP2 shards over all 16
    (dp x cp); without cp one sequence's activations alone are refused (237 GB per GPU)."""
    job_config = load_job(REPO_ROOT / "jobs" / "qwen2.5-7b-longctx-grpo.yaml")
    cluster = load_profile(REPO_ROOT / "clusters" / "example-4x8-h100.yaml")
    plan = compile_plan(job_config, cluster)
    trainer = plan.roles["actor_train"]
    assert trainer.rank_groups["cp"] == [list(range(1, 9)), list(range(9, 17))]
    params = count_parameters(ModelShape.from_model(job_config.model))
    assert trainer.memory.part("Adam") == math.ceil(params * 8 / 16)
    assert max(stage.slot_memory_gb[0] for stage in plan.stages.values()) < 50
    without_cp = load_job(REPO_ROOT / "jobs" / "qwen2.5-7b-longctx-grpo.yaml",
                          ["roles.actor_train.parallel.cp=1", "roles.actor_train.parallel.dp=16"])
    assert "over the device's 80 GB" in rejects("roles.actor_train.parallel: the memory estimate", without_cp, cluster)


def test_what_waits_in_host_memory_must_fit_the_node():
    """72B colocated: during rollout a node keeps 8 GPUs' worth of trainer and reference state and a
    staged copy of a pipeline stage's weights in host memory: 226 GB, refused under slurm.mem 200G."""
    job_config = load_job(REPO_ROOT / "jobs" / "qwen2.5-72b-grpo.yaml")
    cluster = REPO_ROOT / "clusters" / "example-16x8-h100.yaml"
    plan = compile_plan(job_config, load_profile(cluster))
    trainer, reference = plan.roles["actor_train"].memory, plan.roles["reference"].memory
    staged = count_parameters(ModelShape.from_model(job_config.model)) * 2 / 4   # bf16, over pp 4
    assert plan.stages["rollout"].node_host_gb[0] == pytest.approx((8 * (trainer.state + reference.state) + staged) / 2**30)
    assert plan.stages["rollout"].node_host_gb[1] == pytest.approx(8 * (trainer.state + reference.state) / 2**30)
    assert "host memory 226.45 GB per node of 480 GB" in format_plan(plan)
    message = rejects("roles.actor_train.offload: in stage rollout node 0 holds 226.4 GB in host memory",
                      job_config, load_profile(cluster, ["slurm.mem=200G"]))
    assert "raise slurm.mem" in message
