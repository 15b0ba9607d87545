"""`hpcrl export`: a run's checkpoint of every training engine becomes a Hugging Face model directory
that transformers loads strictly, holding bit for bit the weights the trainer handed to rollout."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import hpcrl

from hpcrl.engines.digests import weights_digest
from hpcrl.metrics import read_metrics

SMALL = ["--set", "train.prompts_per_step=8", "--set", "algorithm.group_size=4", "--set", "log.tensorboard=false",
         "--set", "train.steps=2", "--set", "checkpoint.every=2", "--set", "log.check_weights=true"]
ENGINES = {   # name -> (the engine, the job's settings)
    "torch-fsdp2": ("torch", ["roles.actor_train.fsdp=true"]),
    "deepspeed-zero3": ("deepspeed", ["roles.actor_train.engine=deepspeed", "roles.actor_train.zero_stage=3"]),
    "megatron-tp2": ("megatron", ["roles.actor_train.engine=megatron", "roles.actor_train.parallel.tp=2",
                                  "roles.actor_train.parallel.dp=1", "roles.reference.engine=megatron"]),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_export_loads_strictly_in_transformers_with_the_trainers_weights(tmp_path, engine):
    name, settings = ENGINES[engine]
    if name != "torch" and importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    sets = [x for o in settings for x in ("--set", o)]
    trained = hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), *SMALL, *sets, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    exported = hpcrl("export", str(run_dir), "--out", str(out), timeout=300)
    assert exported.returncode == 0, exported.stderr
    assert f"exported step 2 ({name} engine" in exported.stdout
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info   # no missing, unexpected or mismatched keys
    # the digest the run logged of the weights the trainer staged for rollout at step 2
    assert weights_digest(model.named_parameters()) == read_metrics(run_dir / "metrics.jsonl")[-1]["digest_actor_train"][0]
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("3+4=", return_tensors="pt")
    assert prompt.input_ids[0, 0] == tokenizer.bos_token_id == model.generation_config.bos_token_id
    sampling = model.generation_config
    assert (sampling.do_sample, sampling.temperature, sampling.top_p, sampling.top_k) == (True, 1.0, 1.0, 0), \
        "the job's sampling (no top-k: 0, which generate would otherwise fill with 50)"
    assert sampling.eos_token_id == [tokenizer.eos_token_id], "the tokens rollout stopped at"
    with torch.no_grad():
        generated = model.generate(**prompt)
    assert generated.shape[1] <= prompt.input_ids.shape[1] + model.generation_config.max_new_tokens


def test_export_names_the_checkpoints_it_has(tmp_path):
    run_dir = tmp_path / "run"
    assert hpcrl("run", "jobs/tiny_grpo.yaml", "--run-dir", str(run_dir), *SMALL, timeout=300).returncode == 0
    missing = hpcrl("export", str(run_dir), "--step", "7", "--out", str(tmp_path / "hf"))
    assert missing.returncode == 2 and "no step-7 (checkpoints here: 2)" in missing.stderr
    not_a_run = hpcrl("export", str(tmp_path), "--out", str(tmp_path / "hf"))
    assert not_a_run.returncode == 2 and "no job.yaml" in not_a_run.stderr


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_moe"])
def test_a_model_too_large_for_one_file_is_written_in_shards_that_transformers_loads_strictly(tmp_path, arch):
    """What `hpcrl export` (and every model hpcrl writes) uses: tensor by tensor into files of at
    most the shard size, with transformers' index; experts one tensor each, as the hub stores them."""
    from transformers import AutoModelForCausalLM

    from hpcrl.config.job import JobConfig
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.model_files import ModelFiles, write_model

    experts = {"num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 16} if arch == "qwen2_moe" else {}
    job = JobConfig.model_validate({"name": "shards", "task": {"name": "addition"},
                                    "model": {"arch": arch, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                              "num_kv_heads": 2, "intermediate_size": 48, **experts},
                                    "roles": {"actor_train": {}, "actor_infer": {}}})
    model = random_model(job.model, CharTokenizer(), seed=3)
    write_model(model.config, type(model).__name__, model.named_parameters(), tmp_path, shard_bytes=16_000)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    assert not list(tmp_path.glob("*.partial"))
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert weights_digest(loaded.named_parameters()) == weights_digest(model.named_parameters())
    files = ModelFiles(tmp_path)
    assert len(files.names()) >= len(dict(model.named_parameters()))
