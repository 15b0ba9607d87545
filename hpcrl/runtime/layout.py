"""The compiled plan seen from inside the job: which world ranks host which role, and its groups.

Nothing here decides placement: it keeps the part of the plan the ranks need, in picklable form,
and answers the questions the data plane and the weight sync ask of it: which ranks form a model
replica, which of them receives a replica's data from the controller (its data leader), which
holds the result (Megatron: TP rank 0 of the last pipeline stage), and which rank holds each
pipeline stage's full weights (TP rank 0 of that stage).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpcrl.placement import Plan

# Generation engines whose replica's first rank drives the whole replica (vLLM's TP workers are
# its child processes): the weights are loaded there only.
LEADER_LOADS_WEIGHTS = ("vllm",)


@dataclass(frozen=True)
class RoleLayout:
    name: str
    ranks: list[int]
    rank_groups: dict[str, list[list[int]]]   # tp/pp/cp/ep/dp -> groups of world ranks (Megatron order)
    engine: str
    parallel: dict[str, int]

    @property
    def dp_groups(self) -> list[list[int]]:
        return self.rank_groups["dp"]

    @property
    def dp_size(self) -> int:
        return len(self.dp_groups[0])

    def _index(self, kind: str, rank: int) -> int:
        """`rank`'s position in its group of `kind` (its tp/pp/cp/dp rank)."""
        return next(group.index(rank) for group in self.rank_groups[kind] if rank in group)

    def dp_index(self, rank: int) -> int:
        return self._index("dp", rank)

    @property
    def replicas(self) -> list[list[int]]:
        """The ranks of each model replica (its TP x PP x CP ranks), by DP index, in rank order:
        replica d holds the d-th member of every DP group."""
        return [sorted(group[d] for group in self.dp_groups) for d in range(self.dp_size)]

    @property
    def whole_replicas(self) -> list[int]:
        """The DP replicas whose stage leaders hold the whole model once it is gathered: every one,
        but with expert parallelism only those of EP rank 0, one in ep consecutive replicas (a
        replica's EP peers are the next replicas, and their leaders send it their experts)."""
        return list(range(0, self.dp_size, self.parallel.get("ep", 1)))

    def replica_of(self, rank: int) -> list[int]:
        return self.replicas[self.dp_index(rank)]

    def data_leader(self, replica: int) -> int:
        """The rank that receives the replica's share of a batch and broadcasts it to the others."""
        return self.replicas[replica][0]

    def result_rank(self, replica: int) -> int:
        """The rank that holds (and returns) the replica's results: TP and CP rank 0 of the last
        pipeline stage, where the logits are."""
        pp = self.parallel.get("pp", 1)
        return self.stage_leaders(replica)[pp - 1]

    def stage_leaders(self, replica: int) -> list[int]:
        """Per pipeline stage, the replica's rank with TP and CP rank 0: it holds the stage's full
        (TP-gathered) weights."""
        pp = self.parallel.get("pp", 1)
        leaders = {self._index("pp", r): r for r in self.replicas[replica]
                   if self._index("tp", r) == 0 and self._index("cp", r) == 0}
        return [leaders[stage] for stage in range(pp)]

    @property
    def weight_loaders(self) -> list[int]:
        """The ranks that load weights into a generation engine."""
        if self.engine in LEADER_LOADS_WEIGHTS:
            return [replica[0] for replica in self.replicas]
        return list(self.ranks)


@dataclass(frozen=True)
class SyncLayout:
    """Trainer -> rollout weight sync: every pipeline stage of the trainer's first replica sends its
    own layers from its stage leader, all stages at once, to every rank that loads weights; a
    loader that is itself a stage's source takes that stage from its own memory."""

    sources: list[int]                 # per stage, the sending rank
    loaders: list[int]                 # the rollout ranks that load weights

    def members(self, stage: int) -> list[int]:
        """The ranks of stage `stage`'s sync group: its source first, then the loaders it sends to."""
        source = self.sources[stage]
        return [source] + [r for r in self.loaders if r != source]

    def direct_to_vllm(self, layout: WorldLayout) -> bool:
        """Whether (on GPUs) the stage leaders send straight to vLLM's TP workers over NCCL: when
        rollout is vLLM on devices of its own. Sharing devices with the trainer, a GPU would be in
        the NCCL communicator twice, so the weights go through host memory instead."""
        infer, train = layout.roles["actor_infer"], layout.roles["actor_train"]
        return infer.engine == "vllm" and not set(infer.ranks) & set(train.ranks)


@dataclass(frozen=True)
class WorldLayout:
    world_size: int
    roles: dict[str, RoleLayout]
    local_device: dict[int, int]   # worker rank -> device index on its node (the GPU it drives)
    residency: dict[str, tuple[str, ...]] = field(default_factory=dict)  # plan.residency: stage -> resident roles
    shared_weights: bool = False   # plan.rollout_shares_weights: rollout samples with the trainer's parameters

    @property
    def movable(self) -> set[str]:
        """The roles that leave their devices in some stage: parked in host memory once built, so
        that the next one is built on a free device (vLLM sizes its pool from what is free)."""
        return {name for name in self.roles if any(name not in here for here in self.residency.values())}

    def roles_on(self, rank: int) -> list[str]:
        return [name for name, role in self.roles.items() if rank in role.ranks]

    @property
    def sync(self) -> SyncLayout:
        """Who sends and who loads at a weight sync: nobody when rollout samples with the trainer's
        own parameters (they are the synced weights already)."""
        if self.shared_weights:
            return SyncLayout([], [])
        return SyncLayout(self.roles["actor_train"].stage_leaders(0), self.roles["actor_infer"].weight_loaders)


def world_layout(plan: Plan) -> WorldLayout:
    roles = {name: RoleLayout(name, list(role.ranks), {k: [list(g) for g in v] for k, v in role.rank_groups.items()},
                              role.engine, dict(role.parallel))
             for name, role in plan.roles.items()}
    local_device = {rank: plan.slot_of_rank(rank) % plan.devices_per_node for rank in range(1, plan.world_size)}
    return WorldLayout(plan.world_size, roles, local_device, plan.residency, plan.rollout_shares_weights)
