"""The vllm generation engine: an offline `vllm.LLM` per rollout DP group (TP inside vLLM).

It implements hpcrl.engines.base.GenerationEngine like the native sampler: token ids in, token
ids and their log-probabilities out, weights in under HF names, sleep/wake around training.
vLLM is imported only when an engine is built; the translation from hpcrl's SamplingParams
and the reading of vLLM's outputs are pure functions, testable without vLLM.

Log-probabilities: vLLM returns by default those of the raw model (before temperature); the
engine asks for `logprobs_mode="processed_logprobs"`, the distribution after temperature (and
after top-k/top-p when set), which is what the trainer recomputes: log softmax(logits / T).
With top-k or top-p the filtered distribution's log-probabilities are returned (the native
sampler reports unfiltered ones), so the two engines agree exactly only without them.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.engines.native_sampler import SamplingParams

SEED_RANGE = 2**31 - 1


def request_seeds(generator: torch.Generator, count: int) -> list[int]:
    """One vLLM seed per prompt, drawn from the rollout generator: sampling stays a pure function
    of (job seed, step, replica), as with the native sampler, whatever order vLLM schedules in."""
    return torch.randint(0, SEED_RANGE, (count,), generator=generator).tolist()


def vllm_sampling_kwargs(params: SamplingParams, seed: int, eos_id: int) -> dict[str, Any]:
    """vllm.SamplingParams(**these): one sample, the sampled token's log-probability, token ids only."""
    return dict(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,  # -1: no top-k cut (every vLLM version)
        seed=seed,
        logprobs=0,              # 0 extra candidates: just the sampled token's log-probability
        detokenize=False,
        stop_token_ids=[eos_id],  # kept in the output, as the native sampler keeps <eos>
        ignore_eos=False,
    )


def llm_kwargs(model_dir: str, tensor_parallel_size: int, dtype: torch.dtype, seed: int,
               gpu_memory_utilization: float, max_model_len: int, enforce_eager: bool) -> dict[str, Any]:
    """vllm.LLM(**these): token ids in and out (no tokenizer), random weights replaced by
    `load_weights` before the first generate, sleep mode on for colocated roles."""
    return dict(
        model=model_dir,
        tensor_parallel_size=tensor_parallel_size,
        dtype=str(dtype).removeprefix("torch."),
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        skip_tokenizer_init=True,
        load_format="dummy",
        enable_sleep_mode=True,
        logprobs_mode="processed_logprobs",
    )


def sampled_tokens(completion) -> tuple[list[int], list[float]]:
    """Token ids and their log-probabilities from one vLLM CompletionOutput (logprobs=0: each
    step's dict holds the sampled token)."""
    ids = [int(t) for t in completion.token_ids]
    return ids, [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]


def _load_into_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs inside each vLLM worker (collective_rpc): the model's own HF-name loader."""
    worker.model_runner.get_model().load_weights(weights=weights)


class VLLMEngine:
    def __init__(self, model: torch.nn.Module, eos_id: int, seed: int, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool = False, sleep_level: int = 1,
                 devices: Sequence[int] = ()):
        """Serve `model` (the HF model every rank builds): its config is written for vLLM, its
        weights copied in with `load_weights`. Alone in a one-rank world with TP = 1, vLLM runs
        in this process and weights are handed over without serialisation; otherwise its engine
        runs in child processes (their own torch.distributed world, TP workers on `devices`, the
        local GPU indices of this replica's ranks) and weights travel pickled through `collective_rpc`."""
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if devices:  # vLLM's TP workers take the GPUs of this replica's ranks (set before vLLM starts them)
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        if tensor_parallel_size == 1 and alone:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # collective_rpc ships `_load_into_worker` by reference to vLLM's worker processes
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        self._vllm = vllm
        self.eos_id = eos_id
        self.sleep_level = sleep_level
        self._config_dir = tempfile.TemporaryDirectory(prefix="hpcrl-vllm-")
        model.config.save_pretrained(self._config_dir.name)
        dtype = next(model.parameters()).dtype
        self.llm = vllm.LLM(**llm_kwargs(self._config_dir.name, tensor_parallel_size, dtype, seed,
                                         gpu_memory_utilization, model.config.max_position_embeddings,
                                         enforce_eager))
        self.load_weights([(name, p.detach()) for name, p in model.named_parameters()])

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator) -> tuple[list[list[int]], list[list[float]]]:
        sampling = [self._vllm.SamplingParams(**vllm_sampling_kwargs(params, seed, self.eos_id))
                    for seed in request_seeds(generator, len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=sampling,
                                    use_tqdm=False)
        pairs = [sampled_tokens(out.outputs[0]) for out in outputs]
        return [ids for ids, _ in pairs], [logp for _, logp in pairs]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.llm.collective_rpc(_load_into_worker, args=(weights,))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self) -> None:
        """Level 1 keeps the weights in host memory and drops the KV cache; level 2 drops both
        (only safe when the next step loads new weights before generating)."""
        self.llm.sleep(level=self.sleep_level)

    def wake(self) -> None:
        self.llm.wake_up()
