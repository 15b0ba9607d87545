"""The vllm generation engine: an offline `vllm.LLM` per rollout DP group (TP inside vLLM).

It implements hpcrl.engines.base.GenerationEngine like the native sampler: token ids in, token
ids and their log-probabilities out, weights in under HF names, sleep/wake around training.
vLLM is imported only when an engine is built; the translation from hpcrl's SamplingParams
and the reading of vLLM's outputs are pure functions, testable without vLLM.

Log-probabilities must be those the trainer recomputes, log softmax(logits / T) over the whole
vocabulary (as the native sampler reports them), or every ratio and off-policy weight is biased.
vLLM's "processed" log-probabilities are after temperature and after top-k/top-p; its "raw" ones
before both. Without top-k/top-p the engine asks for processed ones; with them, for raw ones,
which match only at temperature 1 (the job schema refuses top-k/top-p at another temperature).

Weights: with rollout on GPUs of its own, each stage leader of the trainer broadcasts its
buckets over an NCCL communicator straight to the TP workers of every replica, which receive on
their own device and load bucket by bucket (`join_weight_groups`, `receive_pushed`: the
update-weights-from-distributed pattern of verl, NeMo-RL and slime, on vLLM's stateless process
group). Colocated with the trainer (a GPU would be in the communicator twice), the weights come
through host memory and `collective_rpc` instead.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.engines.capabilities import ModelDims, parallel_refusals, routed_experts
from hpcrl.engines.digests import tensor_digests
from hpcrl.engines.expert_layout import hub_tensors
from hpcrl.engines.native_sampler import Generation, SamplingParams
from hpcrl.engines.router_replay import index_dtype
from hpcrl.ragged import Ragged

Meta = list[tuple[str, tuple[int, ...], torch.dtype]]

SEED_RANGE = 2**31 - 1


def request_seeds(generator: torch.Generator, count: int) -> list[int]:
    """One vLLM seed per prompt, drawn from the rollout generator: sampling stays a pure function
    of (job seed, step, replica), as with the native sampler, whatever order vLLM schedules in."""
    return torch.randint(0, SEED_RANGE, (count,), generator=generator).tolist()


def vllm_sampling_kwargs(params: SamplingParams, seed: int, stop_ids: Sequence[int], max_tokens: int | None = None
                         ) -> dict[str, Any]:
    """vllm.SamplingParams(**these): one sample of at most `max_tokens` (default the params'), the
    sampled token's log-probability, token ids only."""
    return dict(
        n=1,
        max_tokens=params.max_new_tokens if max_tokens is None else max_tokens,
        temperature=0.0 if params.greedy else params.temperature,   # vLLM's greedy decoding
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,  # -1: no top-k cut (every vLLM version)
        seed=seed,
        logprobs=0,              # 0 extra candidates: just the sampled token's log-probability
        detokenize=False,
        stop_token_ids=list(stop_ids),  # kept in the output, as the native sampler keeps them
        ignore_eos=False,
    )


def llm_kwargs(model_dir: str, tensor_parallel_size: int, dtype: torch.dtype, seed: int,
               gpu_memory_utilization: float, max_model_len: int, enforce_eager: bool,
               filtered_sampling: bool = False, max_num_seqs: int | None = None,
               record_routing: bool = False) -> dict[str, Any]:
    """vllm.LLM(**these): the weights loaded by vLLM itself from the HF directory (each TP worker
    reads its own shard), token ids in and out (no tokenizer), sleep mode on for colocated roles,
    the log-probabilities of the unfiltered distribution (see the module doc); with `record_routing`
    a MoE model's outputs carry each position's experts (router replay)."""
    return dict(
        model=model_dir,
        tensor_parallel_size=tensor_parallel_size,
        dtype=str(dtype).removeprefix("torch."),
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        skip_tokenizer_init=True,
        load_format="safetensors",
        enable_sleep_mode=True,
        logprobs_mode="raw_logprobs" if filtered_sampling else "processed_logprobs",
        # the job's sampling and stop ids are all given (the tokenizer's stop_token_ids already hold the
        # eos ids of the model's generation_config.json): vLLM reads nothing of its own from that file,
        # and stops where the native sampler and the scorer stop
        generation_config="vllm",
        **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),   # vLLM's own continuous batching
        **({"enable_return_routed_experts": True} if record_routing else {}),
    )


def sampled_tokens(completion) -> tuple[list[int], list[float]]:
    """Token ids and their log-probabilities from one vLLM CompletionOutput (logprobs=0: each
    step's dict holds the sampled token)."""
    ids = [int(t) for t in completion.token_ids]
    return ids, [float(step[token].logprob) for token, step in zip(ids, completion.logprobs)]


def routed_row(completion, prompt_length: int, dtype: type) -> np.ndarray:
    """A completion's routing (vLLM's `routed_experts` [positions, layers, top_k]) as hpcrl's flat
    row (hpcrl.engines.router_replay): the positions vLLM fed, its prompt and every sampled token
    but the last. Empty (the trainer then routes the sample itself) when vLLM gave none or another
    number of positions, as a request aborted mid-step may: a shifted routing would be worse than none."""
    routed = getattr(completion, "routed_experts", None)
    if routed is None or len(routed) != prompt_length + len(completion.token_ids) - 1:
        return np.zeros(0, dtype)
    return np.asarray(routed).astype(dtype).reshape(-1)


def _load_into_worker(worker, path: str, model_type: str) -> None:
    """Runs inside each vLLM worker (collective_rpc): one staged bucket (`stage_bucket`), mapped
    from its file, through the model's own loader, which takes a hub checkpoint's names (a MoE
    layer's experts one tensor each)."""
    worker.model_runner.get_model().load_weights(weights=hub_tensors(read_bucket(path), model_type))


@contextlib.contextmanager
def stage_bucket(weights: Sequence[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """A bucket of host tensors as a safetensors file in shared memory (/dev/shm where it has room;
    a container's may hold 64 MB, less than one large tensor: then the temporary directory), for
    vLLM's worker processes to map: collective_rpc's own serialisation (msgpack between the
    engine's processes, vLLM 0.32) delivers a tensor argument as a plain list, so only the path
    goes through it. The file is gone once the block ends (or, after a kill, by hpcrl.launch.shm)."""
    from safetensors.torch import save_file

    size = sum(tensor.nbytes for _, tensor in weights)
    shared = "/dev/shm" if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * size + 2**26 else None
    with tempfile.NamedTemporaryFile(prefix="hpcrl-weights-", suffix=".safetensors", dir=shared) as staged:
        # a clone each: views into one receive buffer share its storage, which safetensors refuses
        save_file({name: tensor.detach().to("cpu").clone() for name, tensor in weights}, staged.name,
                  metadata={"order": json.dumps([name for name, _ in weights])})
        yield staged.name


def read_bucket(path: str) -> list[tuple[str, torch.Tensor]]:
    """A staged bucket's tensors, in the order they were given."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as staged:
        names = json.loads(staged.metadata()["order"])
        return [(name, staged.get_tensor(name)) for name in names]


def _join_weight_groups(worker, groups: list[dict]) -> None:
    """Runs inside each vLLM worker: join one NCCL communicator per trainer pipeline stage, as rank
    `rank_offset + worker.rank` (the trainer's stage leader is rank 0 of each)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    worker.hpcrl_weight_groups = [
        PyNcclCommunicator(StatelessProcessGroup.create(host=g["host"], port=g["port"],
                                                        rank=g["rank_offset"] + worker.rank,
                                                        world_size=g["world_size"], store_timeout=g["timeout_s"]),
                           device=worker.device)
        for g in groups]


def _receive_into_worker(worker, plans: list[list[Meta]], digest: bool, model_type: str) -> list[tuple[str, str]]:
    """Runs inside each vLLM worker: every stage's buckets from its communicator, on this worker's
    own device, each loaded as it lands (in the hub's layout); returns the digests of the tensors
    as sent when asked."""
    model = worker.model_runner.get_model()
    stream = torch.cuda.current_stream()
    digests: list[tuple[str, str]] = []
    for group, plan in zip(worker.hpcrl_weight_groups, plans):
        for meta in plan:
            flat = torch.empty(sum(torch.Size(shape).numel() for _, shape, _ in meta), dtype=meta[0][2],
                               device=worker.device)
            group.broadcast(flat, src=0, stream=stream)
            stream.synchronize()
            tensors, start = [], 0
            for name, shape, _ in meta:
                count = torch.Size(shape).numel()
                tensors.append((name, flat[start:start + count].view(shape)))
                start += count
            model.load_weights(weights=hub_tensors(tensors, model_type))
            if digest:
                digests += tensor_digests(tensors)
    return digests


def visible_devices(positions: Sequence[int], inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for vLLM's workers: the GPUs this process calls `positions` (indices
    into the inherited list, which Slurm fills with the node's own GPU ids where it does not confine
    the job's devices with cgroups, e.g. "4,5,6,7" for half a node)."""
    ids = inherited.split(",") if inherited else [str(p) for p in range(max(positions) + 1)]
    return ",".join(ids[p] for p in positions)


class VLLMEngine:
    _request_ids = itertools.count()

    def __init__(self, model_dir: str | os.PathLike, dtype: torch.dtype, stop_ids: Sequence[int], seed: int,
                 tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5, enforce_eager: bool = False,
                 sleep_level: int = 1, devices: Sequence[int] = (), filtered_sampling: bool = False,
                 max_num_seqs: int | None = None, record_routing: bool = False, max_model_len: int | None = None):
        """Serve the HF model in `model_dir` (`model.path` or the run's random init), which vLLM
        loads itself. Alone in a one-rank world with TP = 1, vLLM runs in this process; otherwise
        its engine runs in child processes (their own torch.distributed world, TP workers on
        `devices`, the local GPU indices of this replica's ranks). `filtered_sampling`: the job samples
        with top-k or top-p (see the module doc). `record_routing`: generations carry a MoE model's
        routing (algorithm.router_replay). `max_model_len`: the context the job serves (its
        model.max_position_embeddings cap; default the model's own), which vLLM must fit one
        sequence of into its pool to start."""
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if devices:  # vLLM's TP workers take the GPUs of this replica's ranks (set before vLLM starts them)
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if tensor_parallel_size == 1 and alone:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # collective_rpc ships the functions above by reference to vLLM's worker processes
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        self._vllm = vllm
        self.stop_ids = tuple(stop_ids)
        self.sleep_level = sleep_level
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        refused = parallel_refusals("actor_infer", "vllm", {"tp": tensor_parallel_size}, ModelDims.from_hf(config))
        if refused:   # the plan refuses these first, from the same table
            raise ValueError("; ".join(refused))
        self.model_type = config.model_type
        self.routing_dtype = index_dtype(routed_experts(config)) if record_routing else None
        self.llm = vllm.LLM(**llm_kwargs(str(model_dir), tensor_parallel_size, dtype, seed, gpu_memory_utilization,
                                         max_model_len or config.max_position_embeddings, enforce_eager,
                                         filtered_sampling,
                                         max_num_seqs, record_routing))

    def generate(self, prompts: Ragged, params: SamplingParams, generator: torch.Generator,
                 budgets: np.ndarray | None = None, stop: Callable[[np.ndarray], bool] | None = None) -> Generation:
        budgets = np.full(len(prompts), params.max_new_tokens) if budgets is None else budgets
        seeds = request_seeds(generator, len(prompts))
        rows = [i for i in range(len(prompts)) if budgets[i] > 0]
        sampling = [self._vllm.SamplingParams(**vllm_sampling_kwargs(params, seeds[i], self.stop_ids, int(budgets[i])))
                    for i in rows]
        inputs = [{"prompt_token_ids": prompts[i].tolist()} for i in rows]
        if stop is None:
            outputs = self.llm.generate(inputs, sampling_params=sampling, use_tqdm=False)
        else:
            outputs = self._generate_until(inputs, sampling, stop, rows, len(prompts))
        ids, logprobs = [[] for _ in range(len(prompts))], [[] for _ in range(len(prompts))]
        routing = [np.zeros(0, self.routing_dtype or np.uint8) for _ in range(len(prompts))]
        finished = np.ones(len(prompts), dtype=bool)
        for row, out in zip(rows, outputs):
            if out is not None:
                ids[row], logprobs[row] = sampled_tokens(out.outputs[0])
                if self.routing_dtype is not None:
                    routing[row] = routed_row(out.outputs[0], len(prompts[row]), self.routing_dtype)
            finished[row] = out is not None and out.finished
        routed = Ragged.from_arrays(routing, self.routing_dtype) if self.routing_dtype is not None else None
        return Generation(Ragged.from_rows(ids, np.int32), Ragged.from_rows(logprobs, np.float32), finished, routed)

    def _generate_until(self, inputs: list[dict], sampling: list, stop: Callable[[np.ndarray], bool],
                        rows: list[int], count: int) -> list:
        """Step vLLM's engine until every request ends or `stop(finished)` is true (`rows`: the call's
        row of each request, of `count`; the others have ended already); the requests still running
        are aborted and come back with the tokens they have (partial rollout). None: no token yet."""
        engine = self.llm.llm_engine
        ids = [f"hpcrl-{next(self._request_ids)}" for _ in inputs]
        for request_id, prompt, params in zip(ids, inputs, sampling):
            engine.add_request(request_id, prompt, params)
        latest: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                latest[out.request_id] = out
            finished = np.ones(count, dtype=bool)
            finished[rows] = [r in latest and latest[r].finished for r in ids]
            if stop(finished):
                engine.abort_request([r for r in ids if r not in latest or not latest[r].finished])
                break
        return [latest.get(r) for r in ids]

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Hand host tensors to every worker through shared memory (`stage_bucket`): the sync's
        buckets when rollout shares its GPUs with the trainer."""
        with stage_bucket(weights) as path:
            self.llm.collective_rpc(_load_into_worker, args=(path, self.model_type))

    def weights_loaded(self) -> None:
        """After the last bucket of a sync: cached KV blocks were computed with the old weights."""
        self.llm.reset_prefix_cache()

    def join_weight_groups(self, groups: list[dict]) -> None:
        """Connect every TP worker to the trainer's stage leaders (one NCCL communicator per stage:
        host, port, rank_offset, world_size, timeout_s), once, before the first sync."""
        self.llm.collective_rpc(_join_weight_groups, args=(groups,))

    def receive_pushed(self, plans: list[list[Meta]], digest: bool) -> list[tuple[str, str]]:
        """Receive one sync (every stage's bucket plan, in stage order) straight into the workers."""
        digests = self.llm.collective_rpc(_receive_into_worker, args=(plans, digest, self.model_type))[0]
        self.weights_loaded()
        return digests

    def sleep(self) -> None:
        """Level 1 keeps the weights in host memory and drops the KV cache; level 2 drops both
        (only safe when the next step loads new weights before generating)."""
        self.llm.sleep(level=self.sleep_level)

    def wake(self) -> None:
        self.llm.wake_up()
