"""The vllm engine: the translation to vLLM's parameters and outputs (pure, no vLLM needed here), and
generation against the native sampler where a GPU and vLLM exist."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO, random_files

from hpcrl.engines.native_sampler import SamplingParams
from hpcrl.ragged import Ragged
from hpcrl.engines.vllm_engine import (llm_kwargs, read_bucket, request_seeds, routed_row, sampled_tokens, stage_bucket,
                                       visible_devices, vllm_sampling_kwargs)


def test_sampling_params_translate_to_one_sample_with_its_logprob_and_no_text():
    kwargs = vllm_sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5), seed=11,
                                  stop_ids=(2,))
    assert kwargs == dict(n=1, max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=11, logprobs=0,
                          detokenize=False, stop_token_ids=[2], ignore_eos=False)
    assert vllm_sampling_kwargs(SamplingParams(7), seed=0, stop_ids=(2,), max_tokens=3)["max_tokens"] == 3, \
        "a continued response may add only what is left of its budget"
    assert vllm_sampling_kwargs(SamplingParams(4), seed=0, stop_ids=(2,))["top_k"] == -1, "0 means no cut: vLLM's -1"


def test_vllm_workers_see_the_gpus_this_rank_numbers_as_its_replicas():
    """Where Slurm leaves the node's own GPU ids in CUDA_VISIBLE_DEVICES (no cgroup confinement:
    half a node is "4,5,6,7"), the replica's local positions 2, 3 are GPUs 6 and 7, not 2 and 3."""
    assert visible_devices([2, 3], "4,5,6,7") == "6,7"
    assert visible_devices([0, 1], "0,1,2,3") == "0,1"
    assert visible_devices([1, 2], None) == "1,2", "nothing inherited: the positions are the ids"


def test_a_colocated_sync_bucket_reaches_the_workers_through_a_file_in_shared_memory():
    """collective_rpc delivers a tensor argument to vLLM's worker processes as a plain list (msgpack,
    vLLM 0.32), so a bucket goes as a file the workers map: the same tensors in the same order,
    views into one receive buffer and bf16 included; the file is gone afterwards."""
    flat = torch.arange(40, dtype=torch.float32).to(torch.bfloat16)
    bucket = [("model.layers.1.mlp.down_proj.weight", flat[:24].view(4, 6)), ("model.norm.weight", flat[24:32]),
              ("model.embed_tokens.weight", flat[32:].view(2, 4))]
    with stage_bucket(bucket) as path:
        assert path.startswith("/dev/shm/")
        read = read_bucket(path)
    assert [name for name, _ in read] == [name for name, _ in bucket]
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, expected) for (_, t), (_, expected) in zip(read, bucket))
    assert not Path(path).exists()


def test_request_seeds_are_a_function_of_the_generator_and_differ_per_prompt():
    first = request_seeds(torch.Generator().manual_seed(5), 16)
    assert first == request_seeds(torch.Generator().manual_seed(5), 16)
    assert first != request_seeds(torch.Generator().manual_seed(6), 16)
    assert len(set(first)) == 16 and all(0 <= s < 2**31 - 1 for s in first)


def test_the_llm_reads_token_ids_returns_processed_logprobs_and_can_sleep():
    kwargs = llm_kwargs("/tmp/m", 2, torch.bfloat16, 3, 0.4, 128, enforce_eager=True)
    assert kwargs["dtype"] == "bfloat16" and kwargs["tensor_parallel_size"] == 2 and kwargs["max_model_len"] == 128
    assert kwargs["skip_tokenizer_init"] and kwargs["enable_sleep_mode"] and kwargs["load_format"] == "safetensors"
    assert kwargs["logprobs_mode"] == "processed_logprobs", "the trainer recomputes log softmax(logits / T)"
    assert kwargs["generation_config"] == "vllm", "the job gives the sampling and the stop ids: none read from the model"
    # top-k/top-p: vLLM's processed log-probabilities are of the filtered distribution; the raw ones (before
    # temperature) are the trainer's at temperature 1, the only temperature the schema allows with them
    filtered = llm_kwargs("/tmp/m", 2, torch.bfloat16, 3, 0.4, 128, enforce_eager=True, filtered_sampling=True)
    assert filtered["logprobs_mode"] == "raw_logprobs"


def test_the_sampled_tokens_logprobs_are_read_from_each_step():
    # A stand-in for vLLM's CompletionOutput (vLLM cannot be installed without a GPU): with logprobs=0
    # each step maps the sampled token id to an object with `.logprob`.
    step = lambda token, value: {token: SimpleNamespace(logprob=value)}  # noqa: E731
    completion = SimpleNamespace(token_ids=[5, 2], logprobs=[step(5, -0.25), step(2, -1.5)])
    assert sampled_tokens(completion) == ([5, 2], [-0.25, -1.5])



def test_router_replay_asks_vllm_for_the_routing_and_reads_its_positions_as_the_native_sampler_records_them():
    """vLLM's `routed_experts` [positions, layers, top_k] (prompt and sampled tokens but the last)
    is the native sampler's row; another number of positions (an aborted request) is dropped."""
    assert "enable_return_routed_experts" not in llm_kwargs("/tmp/m", 1, torch.bfloat16, 3, 0.4, 128, True)
    assert llm_kwargs("/tmp/m", 1, torch.bfloat16, 3, 0.4, 128, True, record_routing=True)[
        "enable_return_routed_experts"]
    routed = np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2) % 8
    completion = SimpleNamespace(token_ids=[5, 2], routed_experts=routed)   # 3 prompt tokens + 2 - 1
    row = routed_row(completion, 3, np.uint8)
    assert row.dtype == np.uint8 and np.array_equal(row, routed.reshape(-1))
    assert len(routed_row(completion, 4, np.uint8)) == 0
    assert len(routed_row(SimpleNamespace(token_ids=[5], routed_experts=None), 3, np.uint8)) == 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install hpcrl[vllm])")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("model_overrides", [[], ["model.arch=qwen2_moe", "model.num_experts=4"]],
                         ids=["qwen2", "qwen2_moe"])
def test_vllm_samples_with_the_logprobs_the_native_sampler_computes(tmp_path, model_overrides):
    """Also a MoE model: vLLM loads hpcrl's init directory (experts in the hub layout), and its
    samples' log-probs are the HF model's, and it records the experts of every position it fed
    (router replay); then weights pushed in that layout land (the engine's own loader: the same
    log-probs again)."""
    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.batch import pack, response_logprobs
    from hpcrl.engines.model_files import load_full
    from hpcrl.engines.vllm_engine import VLLMEngine

    tokenizer = CharTokenizer()
    files = random_files(load_job(REPO / "jobs" / "tiny_grpo.yaml", model_overrides), tokenizer, tmp_path)   # vLLM loads these
    model = load_full(files, torch.float32)
    moe = bool(model_overrides)
    engine = VLLMEngine(files.path, torch.float32, tokenizer.stop_token_ids, seed=1, gpu_memory_utilization=0.2,
                        enforce_eager=True, record_routing=moe)
    prompts = Ragged.from_rows([tokenizer.encode(t) for t in ("3+4=", "12+3=", "7=")] * 4, np.int32)
    out = engine.generate(prompts, SamplingParams(6, temperature=0.8), torch.Generator().manual_seed(0),
                          budgets=np.array([6, 2, 0] * 4))
    full, _ = response_logprobs(model, pack(prompts, out.response_ids, tokenizer.pad_token_id), temperature=0.8)
    assert out.finished.all() and (out.response_ids.lengths <= [6, 2, 0] * 4).all()
    if moe:   # router replay: vLLM's record of each fed position, as transformers routes the whole sequence
        from hpcrl.engines import router_replay

        seen = []
        for router in router_replay.routers(model):
            router.register_forward_hook(lambda m, i, o: seen.append(o[2]))
        batch = pack(prompts, out.response_ids, tokenizer.pad_token_id)
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  position_ids=batch["position_ids"])
        own = torch.stack(seen, dim=1).reshape(*batch["input_ids"].shape, len(seen), -1)
        recorded = router_replay.padded_routing(out.routed_experts, prompts.lengths, out.response_ids.lengths,
                                                own.shape[2], own.shape[3])
        fed = recorded[:, :, 0, 0] >= 0
        started = out.response_ids.lengths > 0
        assert int(fed.sum()) == int((prompts.lengths + out.response_ids.lengths - 1)[started].sum())
        agree = (recorded[fed].sort(-1).values == own[fed].sort(-1).values).all(-1).float().mean()
        assert agree > 0.95, agree   # fp32 on both sides: only near-ties may route apart
    for i, (response, row) in enumerate(zip(out.response_ids, out.logprobs)):
        assert tokenizer.eos_token_id not in response[:-1]
        assert torch.allclose(full[i, : len(row)], torch.from_numpy(row), atol=1e-3)
    engine.load_weights([(name, p.detach().cuda()) for name, p in model.named_parameters()])
    engine.weights_loaded()
    again = engine.generate(prompts, SamplingParams(6, temperature=0.8), torch.Generator().manual_seed(0),
                            budgets=np.array([6, 2, 0] * 4))
    assert [r.tolist() for r in again.response_ids] == [r.tolist() for r in out.response_ids]
