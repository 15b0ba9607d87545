"""The roles a worker rank can host. Each public method is callable by the controller."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpcrl.config.job import JobConfig
from hpcrl.engines.hf_model import build_model
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
from hpcrl.engines.base import NamedTensors, TrainingEngine
from hpcrl.engines.registry import generation_engine, training_engine
from hpcrl.engines.torch_trainer import Samples
from hpcrl.rewards import score_responses
from hpcrl.runtime.weight_sync import broadcast_named, combine_digests, tensor_digests, weights_digest

Batch = dict[str, list]


@dataclass(frozen=True)
class RoleContext:
    """What a role needs from the rank hosting it."""

    job: JobConfig
    tokenizer: object
    dp_group: dist.ProcessGroup | None
    dp_index: int
    sync_group: dist.ProcessGroup | None
    sync_src: int
    peers: dict[str, object]  # the roles hosted on the same rank (filled in as they are built)
    device: str = "cpu"       # "cuda:<local device>" on GPU nodes
    megatron_groups: dict | None = None  # this rank's Megatron process groups (engine: megatron)
    replica_leader: bool = True           # the first rank of this rank's replica of the role
    replica_devices: tuple[int, ...] = ()  # the local devices of that replica's ranks (vLLM's TP GPUs)


def training_engine_for(role: str, ctx: RoleContext, trainable: bool) -> TrainingEngine:
    """The job's engine for a training role, built on this rank from the seeded HF model."""
    job = ctx.job
    name = job.engine(role)
    model = build_model(job.model, ctx.tokenizer, job.seed).to(ctx.device)
    groups = ctx.megatron_groups if name == "megatron" else ctx.dp_group
    options = {"torch": {"fsdp": getattr(job.roles, role).fsdp},
               "deepspeed": {"zero_stage": job.zero_stage(role)}}.get(name, {})
    return training_engine(name)(model, job, ctx.tokenizer.pad_token_id, groups, trainable=trainable, **options)


def sample_generator(seed: int, step: int, replica: int, attempt: int = 0) -> torch.Generator:
    """Sampling randomness as a pure function of (seed, step, replica, round): resumable and reproducible."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + replica) * 101 + attempt)


class ActorTrain:
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.trainer = training_engine_for("actor_train", ctx, trainable=True)

    def logprobs(self, batch: Batch) -> Batch:
        return {"old_logprobs": self.trainer.logprobs(batch["prompt_ids"], batch["response_ids"])}

    def train_step(self, batch: Batch, lr: float) -> Batch:
        columns = {k: batch[k] for k in ("old_logprobs", "ref_logprobs", "advantages", "importance_weights")
                   if k in batch}
        metrics = self.trainer.train_step(Samples(batch["prompt_ids"], batch["response_ids"], columns), lr)
        return {"metrics": [metrics]}

    def send_weights(self) -> int:
        """Only the sync source sends; the other replicas hold the same weights and have nothing to do."""
        ctx = self.ctx
        weights = self.trainer.named_weights()
        if ctx.sync_group is None or dist.get_rank() != ctx.sync_src:
            for _ in weights:  # gathering sharded weights is collective over the role's TP/PP ranks
                pass
            return 0
        moved = 0
        for bucket in broadcast_named(weights, ctx.sync_src, ctx.sync_group):
            moved += sum(t.numel() * t.element_size() for _, t in bucket)
        return moved

    def digest(self) -> str | None:
        """None on a rank that holds no full copy (Megatron TP/PP ranks past the first of a replica)."""
        return weights_digest(self.trainer.named_weights())

    def save(self, checkpoint_dir: Path) -> None:
        """The engine's model + optimizer state (collective over the role's ranks)."""
        self.trainer.save_state(checkpoint_dir / "actor_train")

    def load(self, checkpoint_dir: Path) -> None:
        self.trainer.load_state(checkpoint_dir / "actor_train")


class Reference:
    """A frozen copy of the initial policy, for the KL penalty."""

    def __init__(self, ctx: RoleContext):
        self.trainer = training_engine_for("reference", ctx, trainable=False)

    def logprobs(self, batch: Batch) -> Batch:
        return {"ref_logprobs": self.trainer.logprobs(batch["prompt_ids"], batch["response_ids"])}


class ActorInfer:
    """Rollout with the job's generation engine. `native` runs on every rank of the role. `vllm` runs
    one offline engine per rollout replica, on the replica's first rank, with tensor parallelism
    inside vLLM over the replica's devices; the replica's other ranks give their GPUs to vLLM's
    TP workers and only take part in the weight broadcast."""

    def __init__(self, ctx: RoleContext):
        job = self.job = ctx.job
        self.ctx = ctx
        name = job.engine("actor_infer")
        tokenizer = ctx.tokenizer
        # vLLM holds the weights itself: the HF model only hands it the config and the first weights.
        self.model = build_model(job.model, tokenizer, job.seed).to(ctx.device if name == "native" else "cpu")
        self.model.requires_grad_(False)
        self.engine = None
        if name == "native":
            self.engine = NativeSampler(self.model, tokenizer.eos_token_id, tokenizer.pad_token_id)
        elif ctx.replica_leader:
            self.engine = generation_engine(name)(self.model, tokenizer.eos_token_id, job.seed,
                                                  tensor_parallel_size=len(ctx.replica_devices),
                                                  devices=ctx.replica_devices)
        self.received_digest: str | None = None   # engines whose weights live elsewhere (vLLM's workers)
        rollout = job.rollout
        self.params = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k)

    def generate(self, batch: Batch, step: int, attempt: int = 0) -> Batch:
        if self.engine is None:  # a vLLM TP follower: the replica's first rank answers for it
            return {"response_ids": [], "behaviour_logprobs": []}
        generator = sample_generator(self.job.seed, step, self.ctx.dp_index, attempt)
        responses, logprobs = self.engine.generate(batch["prompt_ids"], self.params, generator)
        return {"response_ids": responses, "behaviour_logprobs": logprobs}

    def receive_weights(self) -> int:
        local_trainer = self.ctx.peers.get("actor_train")
        if local_trainer is not None:  # colocated: the trainer's weights are in this process
            self._load([list(local_trainer.trainer.named_weights())])
            return 0
        return self._load(broadcast_named(None, self.ctx.sync_src, self.ctx.sync_group))

    def _load(self, buckets: Iterable[NamedTensors]) -> int:
        """Hand every bucket to the engine; returns the bytes moved. For an engine whose weights live
        elsewhere (vLLM's workers) the digest of what it was handed is kept, over all buckets."""
        hashed = self.job.log.check_weights and not isinstance(self.engine, NativeSampler)
        digests, moved = [], 0
        for bucket in buckets:
            if self.engine is not None:
                self.engine.load_weights(bucket)
            if hashed:
                digests += tensor_digests(bucket)
            moved += sum(t.numel() * t.element_size() for _, t in bucket)
        if hashed:
            self.received_digest = combine_digests(digests)
        return moved

    def digest(self) -> str | None:
        """The native sampler's model itself; for vLLM the weights it was handed (its workers hold them)."""
        if isinstance(self.engine, NativeSampler):
            return weights_digest(self.model.named_parameters())
        return self.received_digest if self.engine is not None else None


class Reward:
    """Rule-based reward on a worker (when the job places a `reward` role; else the controller scores)."""

    def __init__(self, ctx: RoleContext):
        self.tokenizer = ctx.tokenizer

    def score(self, batch: Batch) -> Batch:
        return {"rewards": score_responses(self.tokenizer, batch["response_ids"], batch["answers"])}


ROLE_CLASSES = {"actor_train": ActorTrain, "reference": Reference, "actor_infer": ActorInfer, "reward": Reward}
