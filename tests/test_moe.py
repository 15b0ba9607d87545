"""Mixture-of-experts models (Qwen2-MoE: router, experts, gated shared expert) through the whole run:
GRPO with native rollout on the tiny task, trained by the torch engine and by megatron with expert
parallelism, the experts' weights synced to rollout and checked by digest after every step, and the
checkpoint exported to a directory transformers loads strictly."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import hpcrl

from hpcrl.engines.digests import weights_digest
from hpcrl.engines.model_files import INIT_DIR
from hpcrl.metrics import read_metrics

ARCHS = {"qwen2_moe": ["model.moe_intermediate_size=32"], "qwen3_moe": ["model.experts_per_token=1"], "mixtral": []}


class _Ids:
    vocab_size, pad_token_id, bos_token_id, eos_token_id = 40, 0, 1, 2


@pytest.mark.parametrize("arch", ARCHS)
def test_a_hub_checkpoint_stored_per_expert_reads_as_the_fused_tensors_transformers_builds(arch, tmp_path):
    """`model.path` of a real MoE checkpoint: transformers' save_pretrained writes the hub layout (one
    tensor per expert and projection; Mixtral's block_sparse_moe names), and every engine's loader
    reads it by the names of the model it builds (fused, stacked over experts): whole, by expert
    rows (an FSDP2 shard) and flat (a ZeRO-3 partition)."""
    from hpcrl.config import load_job
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.model_files import ModelFiles, load_full

    model_config = load_job("jobs/tiny_grpo.yaml", [f"model.arch={arch}", "model.num_experts=4", *ARCHS[arch]]).model
    model = random_model(model_config, _Ids, seed=3)
    model.save_pretrained(tmp_path)
    files = ModelFiles(tmp_path)
    assert not any(".experts.gate_up_proj" in name for name in files.names()), "stored per expert"
    loaded = dict(load_full(files, "float32").named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(loaded[name], param), name
    fused = model.model.layers[1].mlp.experts
    assert torch.equal(files.read("model.layers.1.mlp.experts.gate_up_proj", 0, 1, 3), fused.gate_up_proj[1:3])
    assert torch.equal(files.read_flat("model.layers.1.mlp.experts.down_proj", 70, 3000),
                       fused.down_proj.detach().reshape(-1)[70:3070])


@pytest.mark.parametrize("arch", ARCHS)
def test_what_hpcrl_writes_and_sends_vllm_is_the_hub_layout_transformers_saves(arch, tmp_path):
    """save_model (the random init, exports) and the weights pushed to vLLM cut the fused expert
    tensors into the hub's per-expert ones: the very tensors, names and files of transformers'
    own save_pretrained, which is what vLLM's loaders read."""
    from safetensors.torch import load_file

    from hpcrl.config import load_job
    from hpcrl.engines.expert_layout import hub_tensors
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.model_files import save_model

    model_config = load_job("jobs/tiny_grpo.yaml", [f"model.arch={arch}", "model.num_experts=4", *ARCHS[arch]]).model
    model = random_model(model_config, _Ids, seed=5)
    model.save_pretrained(tmp_path / "transformers")
    saved = load_file(tmp_path / "transformers" / "model.safetensors")
    sent = dict(hub_tensors(model.named_parameters(), model.config.model_type))
    assert sent.keys() == saved.keys() and all(torch.equal(sent[n], saved[n]) for n in saved)
    written = load_file(save_model(model, tmp_path / "hpcrl") / "model.safetensors")
    assert written.keys() == saved.keys() and all(torch.equal(written[n], saved[n]) for n in saved)


def test_the_load_balancing_loss_is_switch_transformers_over_the_real_tokens_and_trains_the_routers(tmp_path):
    """`moe_aux_loss` of a step is E * sum_e f_e * P_e per layer (f: share of the real tokens' k
    routed slots, P: mean softmax probability), averaged over layers, computed here from transformers'
    own router logits; with algorithm.moe_aux_loss_coef > 0 the step's gradient is not the one without."""
    import numpy as np

    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.batch import pack
    from hpcrl.engines.model_files import ModelFiles, load_full, write_random_init
    from hpcrl.engines.torch_trainer import Samples, TorchTrainer
    from hpcrl.ragged import Ragged

    tokenizer = CharTokenizer()
    overrides = ["model.arch=qwen3_moe", "model.num_experts=4", "train.ppo_epochs=1", "train.minibatches=1",
                 "train.grad_clip=1.0"]
    files = ModelFiles(write_random_init(load_job("jobs/tiny_grpo.yaml", overrides), tokenizer, tmp_path))
    rng = np.random.default_rng(0)
    prompts = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, n) for n in (3, 9, 5, 7)], np.int32)
    responses = Ragged.from_rows([rng.integers(3, tokenizer.vocab_size, n) for n in (4, 1, 6, 2)], np.int32)
    zeros = responses.with_values(np.zeros(len(responses.values), np.float32))
    samples = Samples(prompts, responses, {"old_logprobs": zeros.with_values(zeros.values - 2.0),
                                           "advantages": zeros.with_values(rng.standard_normal(len(zeros.values))
                                                                           .astype(np.float32))})
    model = load_full(files, torch.float32)
    batch = pack(prompts, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], output_router_logits=True)
    keep = batch["attention_mask"].reshape(-1).bool()
    expected = []
    for logits in out.router_logits:
        probs = torch.softmax(logits[keep].float(), dim=-1)
        routed = torch.zeros_like(probs).scatter_(1, probs.topk(2, dim=-1).indices, 1.0)
        expected.append(4 * float((routed.mean(0) / 2 * probs.mean(0)).sum()))
    norms = {}
    for coef in (0.0, 1.0):
        job = load_job("jobs/tiny_grpo.yaml", overrides + [f"algorithm.moe_aux_loss_coef={coef}"])
        metrics = TorchTrainer(files, job, tokenizer.pad_token_id, None).train_step(samples, job.train.lr)
        assert metrics["moe_aux_loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)
        norms[coef] = metrics["grad_norm"]
    assert norms[1.0] != pytest.approx(norms[0.0], rel=1e-3)


MOE = ["model.arch=qwen2_moe", "model.num_experts=4", "model.experts_per_token=2", "model.moe_intermediate_size=32",
       "train.prompts_per_step=8", "algorithm.group_size=4", "log.tensorboard=false", "train.steps=3",
       "checkpoint.every=3", "log.check_weights=true"]


ENGINES = {"torch": [], "megatron-ep2": ["roles.actor_train.engine=megatron", "roles.reference.engine=megatron",
                                          "roles.actor_train.parallel.ep=2"]}


@pytest.mark.parametrize("engine", ENGINES)
def test_grpo_trains_a_moe_model_end_to_end_and_its_experts_reach_rollout_and_the_export(tmp_path, engine):
    """On the torch engine (DDP) and on megatron with the experts split over its two ranks (the
    weight sync and the export gather them from both)."""
    from transformers import AutoModelForCausalLM

    if engine.startswith("megatron") and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (pip install hpcrl[megatron])")
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    trained = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir),
                    *[x for o in MOE + ENGINES[engine] for x in ("--set", o)], timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([m["loss"], m["entropy"], m["kl"]])).all() for m in metrics)
    # where the router sent the step's tokens: the most loaded expert above a balanced share, the least below
    assert all(m["moe_load_max"] >= 1 >= m["moe_load_min"] >= 0 for m in metrics)
    # rollout loaded what the trainer staged, experts included (a mismatch would have failed the run)
    assert set(metrics[-1]["digest_actor_infer"]) == set(metrics[-1]["digest_actor_train"])
    exported = hpcrl("export", str(run_dir), "--out", str(out), timeout=300)
    assert exported.returncode == 0, exported.stderr
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert weights_digest(model.named_parameters()) == metrics[-1]["digest_actor_train"][0]
    initial = dict(AutoModelForCausalLM.from_pretrained(run_dir / INIT_DIR).named_parameters())
    for name, param in model.named_parameters():
        if ".mlp." in name:   # router, routed experts and the shared expert all trained
            assert not torch.equal(param, initial[name]), name
