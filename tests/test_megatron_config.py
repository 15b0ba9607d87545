"""The megatron engine's pure parts (no megatron-core import): config translation, the role's rank
groups against the compiled plan, the packed batch layout, and the engine registry."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

from hpcrl.config import REPO_ROOT, load_job, load_profile
from hpcrl.engines import registry
from hpcrl.engines.megatron.config import gpt_model_kwargs, transformer_config_kwargs
from hpcrl.engines.megatron.groups import role_rank_groups
from hpcrl.engines.megatron.packing import equal_micro_batches, pack
from hpcrl.engines.micro_batches import MicroBatching
from hpcrl.placement import compile_plan
from hpcrl.ragged import Ragged

QWEN = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=96,
            vocab_size=32, max_position_embeddings=128, rms_norm_eps=1e-5)


def test_qwen2_translates_to_gqa_swiglu_rmsnorm_rope_with_qkv_bias():
    config = Qwen2Config(**QWEN, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    kwargs = transformer_config_kwargs(config, {"tp": 2, "pp": 2}, torch.bfloat16)
    assert kwargs["num_attention_heads"] == 8 and kwargs["num_query_groups"] == 2 and kwargs["kv_channels"] == 8
    assert kwargs["ffn_hidden_size"] == 96 and kwargs["num_layers"] == 4 and kwargs["hidden_size"] == 64
    assert kwargs["normalization"] == "RMSNorm" and kwargs["layernorm_epsilon"] == 1e-5
    assert kwargs["gated_linear_unit"] and kwargs["activation_func"] is F.silu
    assert kwargs["add_qkv_bias"] and not kwargs["add_bias_linear"]
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["pipeline_model_parallel_size"] == 2
    assert kwargs["bf16"] and not kwargs["fp16"] and kwargs["params_dtype"] is torch.bfloat16
    assert kwargs["calculate_per_token_loss"], "hpcrl's losses are pre-normalised: Megatron must sum gradients"
    model = gpt_model_kwargs(config)
    assert model["rotary_base"] == 1e6 and model["position_embedding_type"] == "rope"
    assert not model["share_embeddings_and_output_weights"] and model["vocab_size"] == 32


def test_llama_has_no_qkv_bias_and_ties_embeddings_when_hf_does():
    config = LlamaConfig(**QWEN, tie_word_embeddings=True, head_dim=16)
    kwargs = transformer_config_kwargs(config, {}, torch.float32)
    assert not kwargs["add_qkv_bias"] and kwargs["kv_channels"] == 16
    assert gpt_model_kwargs(config)["share_embeddings_and_output_weights"]


@pytest.mark.parametrize("config, expected", [
    # Qwen without norm_topk_prob keeps the top-k of a softmax over all experts as they are: pre-softmax
    (Qwen2MoeConfig(**QWEN, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=32),
     {"num_moe_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 16, "moe_router_pre_softmax": True,
      "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True, "add_qkv_bias": True,
      "qk_layernorm": False}),
    # with it (Qwen3-30B-A3B's config) they are renormalised: a softmax over the top-k logits
    (Qwen3MoeConfig(**QWEN, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True),
     {"num_moe_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 24, "moe_router_pre_softmax": False,
      "add_qkv_bias": False, "qk_layernorm": True}),
    (MixtralConfig(**QWEN, num_local_experts=4, num_experts_per_tok=2),
     {"num_moe_experts": 4, "moe_ffn_hidden_size": 96, "moe_router_pre_softmax": False, "add_qkv_bias": False}),
])
def test_moe_models_translate_to_megatron_routers_that_route_as_transformers_does(config, expected):
    kwargs = transformer_config_kwargs(config, {"tp": 2, "ep": 2, "dp": 2}, torch.float32)
    assert {key: kwargs.get(key) for key in expected} == expected
    assert "moe_shared_expert_intermediate_size" in kwargs or "shared_expert_intermediate_size" not in expected
    assert kwargs["expert_model_parallel_size"] == 2 and kwargs["moe_token_dispatcher_type"] == "alltoall"
    assert kwargs["sequence_parallel"], "megatron-core trains MoE layers with tp > 1 only under sequence parallelism"
    assert kwargs["moe_aux_loss_coeff"] == 0 and kwargs["moe_router_dtype"] == "fp32"


def test_qkv_biases_follow_the_config_and_a_windowed_mixtral_is_refused():
    """Qwen2-MoE builds its q/k/v biases from qkv_bias; Mixtral windows its attention whenever
    sliding_window is set (Qwen2 only with use_sliding_window, so its usual sliding_window stays)."""
    moe = dict(QWEN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert not transformer_config_kwargs(Qwen2MoeConfig(**moe, qkv_bias=False), {}, torch.float32)["add_qkv_bias"]
    assert transformer_config_kwargs(Qwen2Config(**QWEN, sliding_window=4096, use_sliding_window=False), {},
                                     torch.float32)["num_query_groups"] == 2
    with pytest.raises(ValueError, match="sliding_window=64: Mixtral's windowed attention"):
        transformer_config_kwargs(MixtralConfig(**QWEN, num_local_experts=4, sliding_window=64), {}, torch.float32)


def test_a_qwen_moe_with_dense_layers_is_refused():
    config = Qwen2MoeConfig(**QWEN, num_experts=4, mlp_only_layers=[1])
    with pytest.raises(ValueError, match="mlp_only_layers=.1., decoder_sparse_step=1: the megatron engine builds "
                                         "every layer with experts"):
        transformer_config_kwargs(config, {}, torch.float32)


@pytest.mark.parametrize("change, parallel, message", [
    ({}, {"cp": 2}, "context parallelism needs Transformer Engine"),
    ({}, {"ep": 2, "dp": 2}, "ep = 2 splits the experts of a mixture-of-experts model, and this model is dense"),
    ({"hidden_size": 96, "num_attention_heads": 12, "num_key_value_heads": 6}, {"tp": 4},
     r"6 KV heads \(model.num_kv_heads\) neither split over tp = 4 nor share out evenly"),
    ({"vocab_size": 33}, {"tp": 2}, "model.vocab_size: 33 does not split evenly"),
    ({"hidden_act": "gelu"}, {}, "only SwiGLU"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, {}, "rope_type='yarn'"),
])
def test_what_the_converter_cannot_represent_is_refused_with_the_field_named(change, parallel, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_kwargs(Qwen2Config(**{**QWEN, **change}), parallel, torch.float32)


def test_role_groups_are_the_compiled_plans_rank_groups():
    """The plan's tp/pp/cp/ep/dp groups (world ranks, controller at rank 0) are what the engine builds."""
    plan = compile_plan(load_job(REPO_ROOT / "jobs" / "qwen2.5-7b-grpo.yaml"),
                        load_profile(REPO_ROOT / "clusters" / "example-4x8-h100.yaml"))
    role = plan.roles["actor_train"]
    groups = role_rank_groups(role.parallel, role.ranks)
    for kind in ("tp", "pp", "cp", "ep", "dp"):
        assert groups[kind] == role.rank_groups[kind], kind
    assert groups["mp"][0] == sorted(groups["tp"][0] + groups["tp"][len(groups["tp"]) // 2])  # tp x pp of replica 0
    assert groups["embd"][0] == [groups["pp"][0][0], groups["pp"][0][-1]]
    assert groups["intra_dist_opt"] == [list(role.ranks)]


def test_packed_rows_start_at_column_zero_and_index_the_logits_that_predict_each_response_token():
    ids, floats = (lambda rows: Ragged.from_rows(rows, np.int32)), (lambda rows: Ragged.from_rows(rows, np.float32))
    batch = pack(ids([[1, 5], [1, 6, 7, 8]]), ids([[9, 2], [3]]), pad_id=0,
                 columns={"advantages": floats([[0.5, 0.5], [1.0]])})
    assert batch["tokens"].tolist() == [[1, 5, 9, 2, 0], [1, 6, 7, 8, 3]]
    assert batch["targets"].tolist() == [[5, 9, 2, 0, 0], [6, 7, 8, 3, 0]]
    # response token j of row i is predicted by the logits at len(prompt_i) - 1 + j
    picked = batch["targets"].gather(1, batch["index"])
    assert picked[0].tolist() == [9, 2] and picked[1, 0].item() == 3
    assert batch["response_mask"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert batch["advantages"].tolist() == [[0.5, 0.5], [1.0, 0.0]]
    # sequence parallelism splits the positions evenly over the TP ranks: the width is padded to a multiple
    split = pack(ids([[1, 5], [1, 6, 7, 8]]), ids([[9, 2], [3]]), pad_id=0, multiple=4)
    assert split["tokens"].tolist() == [[1, 5, 9, 2, 0, 0, 0, 0], [1, 6, 7, 8, 3, 0, 0, 0]]
    assert torch.equal(split["targets"].gather(1, split["index"]), picked)


def test_pipeline_micro_batches_fill_the_pipeline_split_evenly_and_keep_the_bounds():
    prompts, responses = np.array([3, 1, 4, 1, 5, 9, 2, 6]), np.array([2, 2, 2, 2, 2, 2, 2, 2])

    def sizes(cut, pp):
        groups = equal_micro_batches(cut, prompts, responses, pp)
        assert sorted(np.concatenate(groups).tolist()) == list(range(8)), "every sample exactly once"
        return [len(g) for g in groups]

    assert sizes(MicroBatching(joined=True), 1) == [8] and sizes(MicroBatching(joined=True), 2) == [4, 4]
    assert sizes(MicroBatching(joined=True), 3) == [2, 2, 2, 2]          # 3 does not divide 8: the next that does
    assert sizes(MicroBatching(samples=1, joined=True), 2) == [1] * 8
    assert sizes(MicroBatching(tokens=22, joined=True), 1) == [2, 2, 2, 2]   # width 11: at most 2 rows
    longest_first = equal_micro_batches(MicroBatching(joined=True), prompts, responses, 2)
    assert longest_first[0].tolist() == [5, 7, 4, 2], "grouped by length, longest first"


def test_registry_finds_engines_by_job_name_and_says_what_to_install():
    from hpcrl.engines.native_sampler import NativeSampler
    from hpcrl.engines.torch_trainer import TorchTrainer

    assert registry.training_engine("torch") is TorchTrainer
    assert registry.generation_engine("native") is NativeSampler
    with pytest.raises(registry.EngineNotAvailable, match="unknown generation engine 'sglang'"):
        registry.generation_engine("sglang")


def test_a_missing_extra_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(registry, "_installed", lambda module: False)
    with pytest.raises(registry.EngineNotAvailable, match=r"engine 'vllm' needs `pip install hpcrl\[vllm\]`"):
        registry.generation_engine("vllm")
    with pytest.raises(registry.EngineNotAvailable, match=r"`pip install hpcrl\[megatron\]`"):
        registry.training_engine("megatron")
