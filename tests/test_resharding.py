"""HF <-> Megatron layouts and the weight-sync gather, in one process and over 4 real MPI ranks.

The in-process tests convert tiny HF Qwen2/LLaMA models and shard them by hand; the MPI program
(this file run under mpiexec by the fixture) gathers TP shards to each pipeline stage's leader over
gloo with small buckets — TP 2, PP 2 and both at once, with two DP replicas gathering side by side —
and checks every HF tensor bit for bit. (test_megatron_parallel.py does the same from a real
megatron-core GPTModel.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import mpi_findings

from hpcrl.engines.resharding import (
    GPTShape,
    hf_to_mcore,
    layer_offset,
    mcore_state_to_hf,
    merge_tp,
    named_buckets,
    plan_buckets,
    read_stage_tensor,
    renumber,
    split_tp,
    stage_state,
)

SHAPE = GPTShape(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, tied=False)
SIZES = dict(hidden=32, ffn=48, vocab=24)


def hf_state(shape: GPTShape, hidden: int, ffn: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen2-style HF state dict of random tensors (names and shapes as transformers makes them)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not shape.tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.q_proj.bias": (q,),
                       p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                       p + "self_attn.o_proj.weight": (hidden, q), p + "mlp.gate_proj.weight": (ffn, hidden),
                       p + "mlp.up_proj.weight": (ffn, hidden), p + "mlp.down_proj.weight": (hidden, ffn)})
    return {name: torch.randn(s, generator=g) for name, s in shapes.items()}


def round_trip(hf: dict, shape: GPTShape) -> dict:
    return dict(mcore_state_to_hf(hf_to_mcore(hf, shape).items(), shape))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (4, 2)])
def test_each_rank_reads_just_its_slices_from_the_safetensors_files(tmp_path, tp, pp, tied):
    """What a Megatron rank reads with safetensors' get_slice is what slicing the whole converted
    model gives it, tensor for tensor; and it never reads a whole sharded tensor. At tp 4 the
    model's 2 KV heads are fewer than the ranks: two ranks share each query group's fused rows."""
    from safetensors.torch import save_file

    from hpcrl.engines.model_files import ModelFiles

    shape = GPTShape(SHAPE.num_layers, SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim, tied)
    hf = hf_state(shape, **SIZES)
    save_file(hf, tmp_path / "model.safetensors")
    files = ModelFiles(tmp_path)
    reads = []
    original = files.read

    def counted(name, dim=None, start=0, stop=None, dtype=None):
        reads.append((name, dim))
        return original(name, dim, start, stop, dtype)

    files.read = counted
    full = hf_to_mcore(hf, shape)
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            expected = stage_state(full, shape, tp, tp_rank, pp, pp_rank)
            for name, tensor in expected.items():
                got = read_stage_tensor(files, name, shape, SIZES, tp, tp_rank, pp, pp_rank, torch.float32)
                assert torch.equal(got, tensor), (tp, tp_rank, pp, pp_rank, name)
    if tp > 1:
        whole = {name for name, dim in reads if dim is None}
        assert all(n.endswith(("norm.weight", "layernorm.weight")) for n in whole), whole


@pytest.mark.parametrize("arch, tied", [("qwen2", False), ("llama", True)])
def test_a_real_hf_model_converts_to_megatron_and_back_bit_for_bit(arch, tied):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                        intermediate_size=48, vocab_size=24, tie_word_embeddings=tied)
    hf = {n: p.detach() for n, p in model_cls(config).named_parameters()}
    back = round_trip(hf, GPTShape.from_hf(config))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_the_helper_state_has_the_names_and_shapes_of_a_real_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                         intermediate_size=48, vocab_size=24, tie_word_embeddings=False)
    real = {n: tuple(p.shape) for n, p in Qwen2ForCausalLM(config).named_parameters()}
    assert {n: tuple(t.shape) for n, t in hf_state(SHAPE, **SIZES).items()} == real


def test_fused_qkv_holds_each_query_group_then_its_key_and_value_head():
    shape = GPTShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=1, tied=True)
    hf = {"model.layers.0.self_attn.q_proj.bias": torch.tensor([1.0, 2, 3, 4]),
          "model.layers.0.self_attn.k_proj.bias": torch.tensor([10.0, 20]),
          "model.layers.0.self_attn.v_proj.bias": torch.tensor([100.0, 200])}
    fused = hf_to_mcore(hf, shape)["decoder.layers.0.self_attention.linear_qkv.bias"]
    assert fused.tolist() == [1, 2, 10, 100, 3, 4, 20, 200]


def test_tp_shards_split_the_parallel_dimension_and_fc1_keeps_gate_and_up_per_shard():
    full = hf_to_mcore(hf_state(SHAPE, **SIZES), SHAPE)
    for name, tensor in full.items():
        shards = split_tp(name, tensor, 2)
        assert torch.equal(merge_tp(name, shards), tensor), name
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    assert torch.equal(split_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 2)[1],
                       torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert split_tp("decoder.layers.0.self_attention.linear_proj.weight",
                    full["decoder.layers.0.self_attention.linear_proj.weight"], 2)[0].shape == (32, 16)


@pytest.mark.parametrize("tied", [False, True])
def test_pp_stages_hold_their_layers_renumbered_from_zero(tied):
    shape = GPTShape(**{**SHAPE.__dict__, "tied": tied})
    full = hf_to_mcore(hf_state(shape, **SIZES), shape)
    stages = [stage_state(full, shape, 1, 0, 2, s) for s in range(2)]
    assert "embedding.word_embeddings.weight" in stages[0] and "decoder.final_layernorm.weight" in stages[1]
    assert ("output_layer.weight" in stages[1]) and "output_layer.weight" not in stages[0]
    rebuilt = {renumber(n, layer_offset(4, 2, s)): t for s in range(2) for n, t in stages[s].items()}
    if tied:  # the last stage's copy of the embedding is no HF weight
        assert torch.equal(rebuilt.pop("output_layer.weight"), full["embedding.word_embeddings.weight"])
    assert rebuilt.keys() == full.keys() and all(torch.equal(rebuilt[n], full[n]) for n in full)
    with pytest.raises(ValueError, match="does not split evenly"):
        layer_offset(4, 3, 1)


def test_buckets_are_bounded_runs_of_one_dtype():
    meta = [("a", (4,), torch.float32), ("b", (4,), torch.float32), ("c", (10,), torch.float32),
            ("d", (2,), torch.bfloat16)]
    assert [[n for n, _, _ in b] for b in plan_buckets(meta, bucket_bytes=32)] == [["a", "b"], ["c"], ["d"]]


# ---- 4 MPI ranks --------------------------------------------------------------------------------------------------

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # name -> (tp, pp); dp = 4 / (tp * pp)


@pytest.fixture(scope="module")
def gathered(tmp_path_factory) -> dict:
    return mpi_findings(__file__, 4, tmp_path_factory.mktemp("resharding") / "gathered.json", timeout=180)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_stage_leader_gathers_its_stages_hf_tensors_bit_for_bit(gathered, layout):
    leaders = gathered[layout]
    tp, pp = LAYOUTS[layout]
    assert len(leaders) == 4 // tp, "one leader per pipeline stage of each DP replica"
    expected = hf_state(SHAPE, **SIZES)
    for replica in range(4 // (tp * pp)):
        stages = sorted((f for f in leaders.values() if f["replica"] == replica), key=lambda f: f["stage"])
        assert [f["stage"] for f in stages] == list(range(pp))
        names = [n for f in stages for n in f["names"]]
        assert sorted(names) == sorted(expected), "the stages together hold every tensor once"
        assert all(f["different"] == [] for f in stages)
        for f in stages:  # a stage holds its own layers only
            first = layer_offset(SHAPE.num_layers, pp, f["stage"])
            layers = {int(n.split(".")[2]) for n in f["names"] if n.startswith("model.layers.")}
            assert layers == set(range(first, first + SHAPE.num_layers // pp))


def _run(out: Path) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcrl.engines.resharding import gather_hf
    from hpcrl.placement.rank_groups import megatron_groups
    from hpcrl.runtime.mpi_world import init_torch_distributed

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    init_torch_distributed("gloo")
    expected = hf_state(SHAPE, **SIZES)
    full = hf_to_mcore(expected, SHAPE)
    results = {}
    for name, (tp, pp) in LAYOUTS.items():
        groups = megatron_groups(tp=tp, pp=pp, cp=1, ep=1, dp=world // (tp * pp))
        mine = {}
        for kind in ("tp", "pp"):
            for ranks in groups[kind]:
                group = dist.new_group(ranks)
                if rank in ranks:
                    mine[kind] = group
        tp_rank, pp_rank = dist.get_rank(mine["tp"]), dist.get_rank(mine["pp"])
        replica = next(group.index(rank) for group in groups["dp"] if rank in group)
        local = list(stage_state(full, SHAPE, tp, tp_rank, pp, pp_rank).items())
        got = dict(gather_hf(local, SHAPE, mine["tp"], pp, pp_rank, bucket_bytes=4096))
        found = None
        if got:
            found = {"replica": replica, "stage": pp_rank, "names": sorted(got),
                     "different": [n for n in got if n not in expected or not torch.equal(got[n], expected[n])]}
        everyone = comm.gather(found, root=0)
        results[name] = {str(r): f for r, f in enumerate(everyone or []) if f is not None}
    if rank == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _run(Path(sys.argv[1]))


def test_named_buckets_take_tensors_as_they_come_so_the_sync_source_never_holds_the_whole_model():
    taken = []

    def weights():
        for i in range(4):
            taken.append(i)
            yield f"t{i}", torch.zeros(4)  # 16 bytes each

    buckets = named_buckets(weights(), bucket_bytes=32)
    assert [n for n, _ in next(buckets)] == ["t0", "t1"] and taken == [0, 1, 2]
    assert [n for n, _ in next(buckets)] == ["t2", "t3"]


def test_a_digest_collected_bucket_by_bucket_equals_the_digest_of_the_whole():
    from hpcrl.engines.digests import combine_digests, tensor_digests, weights_digest

    weights = [(f"t{i}", torch.full((3,), float(i))) for i in range(4)]
    by_bucket = tensor_digests(weights[:2]) + tensor_digests(weights[2:])
    assert combine_digests(by_bucket) == weights_digest(weights) == weights_digest(reversed(weights))
    assert combine_digests(tensor_digests(weights[2:])) != weights_digest(weights), "every bucket counts"
    assert weights_digest([]) is None


# ---- mixture-of-experts models -------------------------------------------------------------------------------------

def _moe_model(arch: str, tied: bool = False):
    """A real transformers MoE model: 4 experts top-2, Qwen2-MoE with its gated shared expert."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=48, vocab_size=24, tie_word_embeddings=tied, num_experts_per_tok=2)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**sizes, num_local_experts=4))
    if arch == "qwen2_moe":
        return Qwen2MoeForCausalLM(Qwen2MoeConfig(**sizes, num_experts=4, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=24))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes, num_experts=4, moe_intermediate_size=16, head_dim=8))


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_real_hf_moe_model_converts_to_megatron_and_back_bit_for_bit(arch):
    """Router, each expert's fc1/fc2 (a row of the fused, expert-stacked HF tensors), the shared
    expert and its gate, Qwen3's q/k norms: HF -> Megatron -> HF gives every tensor back exactly."""
    model = _moe_model(arch)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    shape = GPTShape.from_hf(model.config)
    full = hf_to_mcore(hf, shape)
    assert full["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == \
        hf["model.layers.1.mlp.experts.gate_up_proj"][3].shape
    back = dict(mcore_state_to_hf(full.items(), shape))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2), (2, 1), (1, 4)])
def test_each_rank_reads_just_its_experts_and_their_tp_slices(tmp_path, tp, ep):
    """A Megatron rank of a MoE model reads its own experts only, each one row of the stacked HF
    tensor, then its TP slice; what it reads is what slicing the whole converted model gives, and
    putting every EP rank's experts back (renumbered) rebuilds the stacked tensors."""
    from safetensors.torch import save_file

    from hpcrl.engines.model_files import ModelFiles
    from hpcrl.engines.resharding import expert_offset, merge_tp

    model = _moe_model("qwen2_moe")
    hf = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    save_file(hf, tmp_path / "model.safetensors")
    files = ModelFiles(tmp_path)
    shape = GPTShape.from_hf(model.config)
    sizes = {"vocab": 24, "ffn": 48, "shared_ffn": 24}
    full = hf_to_mcore(hf, shape)
    gathered = {}
    for ep_rank in range(ep):
        shards = [stage_state(full, shape, tp, tp_rank, 1, 0, ep, ep_rank) for tp_rank in range(tp)]
        assert sum(".local_experts." in name for name in shards[0]) == 2 * 2 * 4 // ep   # layers x fc x experts
        for tp_rank, expected in enumerate(shards):
            for name, tensor in expected.items():
                got = read_stage_tensor(files, name, shape, sizes, tp, tp_rank, 1, 0, torch.float32, ep, ep_rank)
                assert torch.equal(got, tensor), (tp_rank, ep_rank, name)
        gathered.update({expert_offset(name, ep_rank * 4 // ep): merge_tp(name, [s[name] for s in shards])
                         for name in shards[0]})
    back = dict(mcore_state_to_hf(gathered.items(), shape))
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)
