"""The roles a worker rank can host. Each public method is callable by the controller."""
from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from hpcrl.config.job import JobConfig
from hpcrl.engines.hf_model import DTYPES
from hpcrl.engines.model_files import ModelFiles, load_full
from hpcrl.engines.native_sampler import Generation, NativeSampler, SamplingParams
from hpcrl.engines.base import TrainingEngine
from hpcrl.engines.digests import combine_digests, tensor_digests, weights_digest
from hpcrl.engines.registry import generation_engine, training_engine
from hpcrl.engines.torch_trainer import Samples
from hpcrl.ragged import Batch
from hpcrl.rewards import reward_specs, score_batch
from hpcrl.rollout.episodes import play
from hpcrl.rollout.multi_turn import MultiTurnRollout, multi_turn_rollout
from hpcrl.envs import EnvSpec
from hpcrl.envs.host import EnvPool
from hpcrl.placement.memory import ModelShape
from hpcrl.runtime.env_workers import RemoteEnvPool, serve_round
from hpcrl.runtime.faults import behaviour_shift, decode_delay_s
from hpcrl.runtime.interrupts import round_stop
from hpcrl.runtime.messages import TAG_ADDRESS
from hpcrl.runtime.mpi_world import free_port, poll_recv, send
from hpcrl.runtime.weight_sync import Source, StagedWeights, WeightReceiver, WeightServer, receive_object


@dataclass(frozen=True)
class RoleContext:
    """What a role needs from the rank hosting it."""

    job: JobConfig
    tokenizer: object
    model_files: ModelFiles   # the initial weights every engine loads (model.path or the run's random init)
    dp_group: dist.ProcessGroup | None
    dp_index: int
    peers: dict[str, object]  # the roles hosted on the same rank (filled in as they are built)
    device: str = "cpu"       # "cuda:<local device>" on GPU nodes
    megatron_groups: dict | None = None  # this rank's Megatron process groups (engine: megatron)
    replica_leader: bool = True           # the first rank of this rank's replica of the role
    replica_devices: tuple[int, ...] = ()  # the local devices of that replica's ranks (vLLM's TP GPUs)
    # Weight sync: the stage this rank sends (and its sync group), when it is a trainer stage's
    # leader; and, on a rank that loads weights, where each trainer stage comes from.
    sync_stage: int | None = None
    sync_send_group: dist.ProcessGroup | None = None
    sync_sources: list[tuple[int, dist.ProcessGroup | None, int]] = field(default_factory=list)  # (stage, group, src)
    sync_loaders: tuple[int, ...] = ()   # every rank that loads weights, in the sync groups' order
    sync_direct: bool = False            # vLLM on GPUs of its own: its TP workers receive over NCCL
    shared_weights: bool = False         # native rollout samples with this rank's actor_train parameters
    context_groups: tuple | None = None  # (cp group, dp x cp group): engine torch with context parallelism
    env_rank: int | None = None          # a rollout replica leader's env rank (roles.env), None: envs run here
    env_clients: tuple[int, ...] = ()    # an env rank's rollout replica leaders


def training_engine_for(role: str, ctx: RoleContext, trainable: bool) -> TrainingEngine:
    """The job's engine for a training role, built on this rank from the model files (each engine
    reads only the part it keeps)."""
    job = ctx.job
    name = job.engine(role)
    groups = ctx.megatron_groups if name == "megatron" else ctx.dp_group
    options = {"torch": {"fsdp": getattr(job.roles, role).fsdp, "context_groups": ctx.context_groups},
               "deepspeed": {"zero_stage": job.zero_stage(role)}}.get(name, {})
    if role == "critic":   # the capability table keeps the critic off engines without a value head
        options["value_head"] = True
    return training_engine(name)(ctx.model_files, job, ctx.tokenizer.pad_token_id, groups, ctx.device,
                                 trainable=trainable, **options)


def sample_generator(seed: int, step: int, replica: int, attempt: int = 0) -> torch.Generator:
    """Sampling randomness as a pure function of (seed, step, replica, round): resumable and reproducible."""
    return torch.Generator().manual_seed((((seed * 1_000_003 + step) * 1_009 + replica) * 101 + attempt) % 2**63)


class Resident:
    """A role that may leave its devices while a role sharing them runs (the plan's stage moves):
    `offload` and `reload` return the seconds they took, for the controller's time_offload_s."""

    def _move_out(self) -> None:
        self.trainer.offload()

    def _move_in(self) -> None:
        self.trainer.reload()

    def offload(self) -> float:
        started = time.perf_counter()
        self._move_out()
        return time.perf_counter() - started

    def reload(self) -> float:
        started = time.perf_counter()
        self._move_in()
        return time.perf_counter() - started


class ActorTrain(Resident):
    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.trainer = training_engine_for("actor_train", ctx, trainable=True)
        self.staged: StagedWeights | None = None
        if ctx.sync_stage is not None:
            self.staged = StagedWeights(pin_memory=ctx.device.startswith("cuda"))
            if ctx.sync_send_group is not None:
                address = _vllm_address(ctx) if ctx.sync_direct else None
                self.server = WeightServer(self.staged, ctx.sync_send_group, ctx.device, address)

    def logprobs(self, batch: Batch) -> Batch | None:
        replay = {"routed_experts": batch["routed_experts"]} if "routed_experts" in batch else {}
        logprobs = self.trainer.logprobs(batch["prompt_ids"], batch["response_ids"], **replay)
        return None if logprobs is None else {"old_logprobs": logprobs}

    def train_step(self, batch: Batch, lr: float) -> Batch:
        columns = {k: batch[k] for k in ("old_logprobs", "ref_logprobs", "advantages", "importance_weights",
                                         "loss_mask") if k in batch}
        samples = Samples(batch["prompt_ids"], batch["response_ids"], columns, batch.get("routed_experts"))
        metrics = self.trainer.train_step(samples, lr)
        return {"metrics": [metrics]}

    def stage_weights(self, version: int, digest: bool) -> list[tuple[str, str]] | None:
        """Copy the weights of policy `version` to the host, on the sync sources, for the push that
        follows at rollout's next round boundary. Collective over the role (gathering is). With
        `digest`, every stage leader of every replica returns its tensors' digests (None elsewhere)."""
        if self.ctx.dp_index >= self.trainer.gather_replicas and not digest:
            return None   # only the first replica's weights are sent; gathering the others would be waste
        digests: list[tuple[str, str]] = []
        weights = self.trainer.named_weights()
        if digest:
            weights = _digesting(weights, digests)
        if self.staged is not None:
            self.staged.stage(weights, version)
        else:
            for _ in weights:  # gathering sharded weights is collective over the role's ranks
                pass
        return digests or None

    def save(self, checkpoint_dir: Path) -> None:
        """The engine's model + optimizer state (collective over the role's ranks)."""
        self.trainer.save_state(checkpoint_dir / "actor_train")

    def load(self, checkpoint_dir: Path) -> None:
        self.trainer.load_state(checkpoint_dir / "actor_train")


def _vllm_address(ctx: RoleContext) -> dict:
    """Where vLLM's TP workers meet this stage leader (rank 0) for NCCL, sent to each replica leader
    (over MPI: a leader asks only once its vLLM engine is built, which may take minutes). The ranks
    after 0 go to the loaders' workers in loader order. The meeting itself may wait as long as the
    slowest engine takes to build: up to `watchdog.call_timeout_max_s`."""
    address = {"host": socket.gethostname(), "port": free_port(), "loaders": list(ctx.sync_loaders),
               "tp": ctx.job.roles.actor_infer.parallel.tp, "timeout_s": ctx.job.watchdog.call_timeout_max_s}
    address["world_size"] = 1 + address["tp"] * len(ctx.sync_loaders)
    for loader in ctx.sync_loaders:
        send(address, loader, TAG_ADDRESS)
    return address


def _digesting(weights: Iterable[tuple[str, torch.Tensor]], into: list[tuple[str, str]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights as they come, with each tensor's digest appended to `into` on the way."""
    for name, tensor in weights:
        into += tensor_digests([(name, tensor)])
        yield name, tensor


class Critic(Resident):
    """The value model of PPO (algorithm.advantage: gae): the policy's decoder with a value head,
    trained on the GAE returns beside the actor."""

    def __init__(self, ctx: RoleContext):
        self.trainer = training_engine_for("critic", ctx, trainable=True)

    def values(self, batch: Batch) -> Batch | None:
        values = self.trainer.values(batch["prompt_ids"], batch["response_ids"])
        return None if values is None else {"values": values}

    def train_step(self, batch: Batch, lr: float) -> Batch:
        columns = {k: batch[k] for k in ("values", "returns")}
        return {"metrics": [self.trainer.train_step(Samples(batch["prompt_ids"], batch["response_ids"], columns), lr)]}

    def save(self, checkpoint_dir: Path) -> None:
        self.trainer.save_state(checkpoint_dir / "critic")

    def load(self, checkpoint_dir: Path) -> None:
        self.trainer.load_state(checkpoint_dir / "critic")


class Reference(Resident):
    """A frozen copy of the initial policy, for the KL penalty."""

    def __init__(self, ctx: RoleContext):
        self.trainer = training_engine_for("reference", ctx, trainable=False)

    def logprobs(self, batch: Batch) -> Batch | None:
        logprobs = self.trainer.logprobs(batch["prompt_ids"], batch["response_ids"])
        return None if logprobs is None else {"ref_logprobs": logprobs}


class ActorInfer(Resident):
    """Rollout with the job's generation engine. `native` runs on every rank of the role. `vllm` runs
    one offline engine per rollout replica, on the replica's first rank, with tensor parallelism
    inside vLLM over the replica's devices, and loads the weights itself; the replica's other
    ranks give their GPUs to vLLM's TP workers and build nothing."""

    def __init__(self, ctx: RoleContext):
        job = self.job = ctx.job
        self.ctx = ctx
        name = job.engine("actor_infer")
        tokenizer = ctx.tokenizer
        self.model = None
        self.engine = None
        if name == "native":
            if ctx.shared_weights:   # the plan checked that they are the weights a sync would send
                self.model = ctx.peers["actor_train"].trainer.module
            else:
                self.model = load_full(ctx.model_files, job.model.dtype, ctx.device).requires_grad_(False)
            self.engine = NativeSampler(self.model, tokenizer.stop_token_ids, tokenizer.pad_token_id, decode_delay_s(),
                                        job.rollout.max_num_seqs, owns_weights=not ctx.shared_weights,
                                        lockstep=job.rollout.batching == "lockstep",
                                        record_routing=job.algorithm.router_replay)
        elif ctx.replica_leader:
            self.engine = generation_engine(name)(ctx.model_files.path, DTYPES[job.model.dtype],
                                                  tokenizer.stop_token_ids, job.seed,
                                                  tensor_parallel_size=len(ctx.replica_devices),
                                                  gpu_memory_utilization=job.rollout.gpu_memory_utilization,
                                                  devices=ctx.replica_devices,
                                                  filtered_sampling=job.rollout.top_p < 1 or job.rollout.top_k > 0,
                                                  max_num_seqs=job.rollout.max_num_seqs,
                                                  record_routing=job.algorithm.router_replay,
                                                  max_model_len=ModelShape.from_model(job.model).max_position_embeddings)
        rollout = job.rollout
        self.params = SamplingParams(rollout.max_new_tokens, rollout.temperature, rollout.top_p, rollout.top_k)
        self.episodes: MultiTurnRollout | None = None   # an env job's, built at its first round
        self.receiver = WeightReceiver(getattr(self.engine, "landing_buffer", None))
        if ctx.sync_direct and ctx.sync_sources:   # a vLLM replica leader: connect its workers to every stage
            rank = dist.get_rank()
            groups = []
            for _, _, src in ctx.sync_sources:
                address, _, _ = poll_recv(source=src, tag=TAG_ADDRESS)
                groups.append({**address, "rank_offset": 1 + address["tp"] * address["loaders"].index(rank)})
            self.engine.join_weight_groups(groups)

    def _move_out(self) -> None:
        if self.engine is not None:   # a vLLM TP follower's GPU is its leader's engine's
            self.engine.sleep()

    def _move_in(self) -> None:
        if self.engine is not None:
            self.engine.wake()

    def generate(self, batch: Batch, step: int, attempt: int = 0, greedy: bool = False,
                 interruptible: bool = False) -> Batch | None:
        """One round: a response (or its continuation) per row, each within its `budgets` entry of
        new tokens; rows still running after `rollout.max_round_s`, when the controller interrupts
        round (step, attempt) (`interruptible`), or once every row marked `needed` has ended, come
        back unfinished. `greedy`: the most likely tokens (evaluation)."""
        if self.engine is None:  # a vLLM TP follower: the replica's first rank answers for it
            return None
        generator = sample_generator(self.job.seed, step, self.ctx.dp_index, attempt)
        params = dataclasses.replace(self.params, greedy=greedy)
        stop = round_stop(self.job.rollout.max_round_s, (step, attempt) if interruptible else None,
                          batch.get("needed"))
        out: Generation = self.engine.generate(batch["prompt_ids"], params, generator, batch["budgets"], stop)
        shift = behaviour_shift()   # 0 but in the mismatch tests
        logprobs = out.logprobs.with_values(out.logprobs.values + shift) if shift else out.logprobs
        routing = {} if out.routed_experts is None else {"routed_experts": out.routed_experts}
        return {"response_ids": out.response_ids, "behaviour_logprobs": logprobs, "finished": out.finished, **routing}

    def play(self, batch: Batch, step: int, attempt: int = 0) -> Batch:
        """An env round: a whole trajectory per row (hpcrl.rollout.episodes), its prompt the episode's
        first observation, its response the actions and observations after it."""
        env = self.job.env
        if self.episodes is None:   # the env processes start with the first round
            remote = None if self.ctx.env_rank is None else RemoteEnvPool(self.ctx.env_rank, env.workers)
            self.episodes = multi_turn_rollout(self.job, self.engine, self.ctx.tokenizer, remote)
        seeds = np.random.default_rng([self.job.seed, step, attempt, self.ctx.dp_index]).integers(
            0, 2 ** 62, len(batch["env_seed"]))
        try:
            return play(self.episodes, batch["env_seed"], batch["group"], seeds, env.group_redundancy)
        finally:
            self.episodes.pool.end_round()

    def receive_weights(self, digest: bool) -> str | None:
        """Load the pushed weights, every trainer stage at once, bucket by bucket; with `digest`, the
        digest of what was loaded (the native model itself; for vLLM what it was handed)."""
        if self.ctx.sync_direct:   # vLLM's workers receive every stage over NCCL, on their own GPUs
            plans = [receive_object(group, src) for _, group, src in self.ctx.sync_sources]
            digests = self.engine.receive_pushed(plans, digest) if self.engine is not None else []
            return combine_digests(digests) if digest else None
        local = self.ctx.peers.get("actor_train")
        sources = [Source(local=local.staged) if group is None else Source(group, src)
                   for _, group, src in self.ctx.sync_sources]
        digests = []
        native = isinstance(self.engine, NativeSampler)
        for bucket, landed in self.receiver.receive(sources):
            if self.engine is not None and not landed:
                self.engine.load_weights(bucket)
            if digest and not native:
                digests += tensor_digests(bucket)
        if self.engine is not None:
            self.engine.weights_loaded()
        if not digest:
            return None
        return weights_digest(self.model.named_parameters()) if native else combine_digests(digests)


class Reward:
    """Reward workers (when the job places a `reward` role; else the controller scores): each scores
    its share of a batch, every sample by its domain's reward (hpcrl.rewards.scoring), while rollout
    and training go on."""

    def __init__(self, ctx: RoleContext):
        self.tokenizer = ctx.tokenizer
        self.specs = reward_specs(ctx.job)

    def score(self, batch: Batch) -> Batch:
        rewards, codes = score_batch(self.tokenizer, batch["response_ids"], batch["answers"], batch["domains"],
                                     self.specs, batch["prompt_ids"])
        return {"rewards": rewards, "codes": codes}


class Env:
    """Env workers (roles.env): `env.workers` env processes for each rollout rank this rank serves,
    answering their env calls while a round runs (hpcrl.runtime.env_workers)."""

    def __init__(self, ctx: RoleContext):
        config = ctx.job.env
        spec = EnvSpec(config.name, config.options)
        self.pools = {client: EnvPool(spec, config.workers, config.step_timeout_s) for client in ctx.env_clients}

    def serve_round(self) -> None:
        serve_round(self.pools)


ROLE_CLASSES = {"actor_train": ActorTrain, "reference": Reference, "critic": Critic, "actor_infer": ActorInfer,
                "reward": Reward, "env": Env}
