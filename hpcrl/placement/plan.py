"""The compiled device map: which slots each role owns, its rank groups, and what each stage runs.

World layout (the runtime relies on it): MPI rank 0 is the controller and owns no device slot. A
slot is `node * devices_per_node + local_device`; the plan's used slots, sorted, are world ranks
1..N in that order, so `world_size = 1 + len(used_slots)`.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from hpcrl.placement.memory import MemoryEstimate
from hpcrl.placement.rank_groups import GROUP_KINDS

STAGES = ("rollout", "reward", "logprobs", "train")
PRODUCTION = ("rollout", "reward")    # with rollout.max_staleness >= 1 these run alongside the two below
CONSUMPTION = ("logprobs", "train")
CONTROLLER_RANK = 0


def residency_windows(asynchronous: bool, needs_room: Collection[str]) -> dict[str, tuple[str, ...]]:
    """The stages at whose entry the controller moves roles between device and host memory, each
    with the stages that run during it. Synchronously every stage runs alone, and one in which no
    role needs device memory (`needs_room`: scoring on the controller) moves nothing. Asynchronously
    rollout (and scoring) run all the time, alongside logprobs or train: the moves happen only at
    the consumer's stage changes, and the production stages' roles stay resident throughout."""
    if asynchronous:
        return {stage: (stage, *PRODUCTION) for stage in CONSUMPTION}
    return {stage: (stage,) for stage in STAGES if stage in needs_room}


def kept_residency(stage: str, windows: dict[str, tuple[str, ...]], asynchronous: bool) -> tuple[str, ...]:
    """For a stage that moves nothing, the stages whose residency it runs in: the consumer's two in
    async mode, else the last stage before it (in pipeline order, cyclically) that moves roles."""
    if asynchronous:
        return tuple(windows)
    at = STAGES.index(stage)
    earlier = [STAGES[(at - k) % len(STAGES)] for k in range(1, len(STAGES))]
    return next(((s,) for s in earlier if s in windows), ())


def resident_roles(stages: tuple[str, ...], roles: dict[str, tuple[tuple[int, ...], tuple[str, ...], bool]]
                   ) -> tuple[str, ...]:
    """The roles on their devices while `stages` run. `roles`: name -> (slots, active stages, moves),
    where `moves` says whether the role may leave the device (roles.<name>.offload, and state to
    move). A role stays when it is active in one of the stages, may not move, or shares its slots
    with no role that is active then (nothing needs the room); else it waits in host memory."""
    active = {name for name, (_, active_in, _) in roles.items() if set(active_in) & set(stages)}
    busy = {slot for name in active for slot in roles[name][0]}
    return tuple(name for name, (slots, _, moves) in roles.items()
                 if name in active or not moves or not busy & set(slots))


@dataclass(frozen=True)
class RolePlan:
    """One role's devices and parallel layout. `groups` hold global slots, `rank_groups` world ranks."""

    name: str
    engine: str
    parallel: dict[str, int]                 # tp, pp, cp, ep, dp
    slots: tuple[int, ...]                   # local rank i of the role runs on slots[i]
    ranks: tuple[int, ...]                   # world rank of slots[i]
    nodes: tuple[int, ...]                   # nodes the slots are on, ascending
    groups: dict[str, list[list[int]]]       # tp/pp/cp/ep/dp -> groups of global slots (Megatron order)
    rank_groups: dict[str, list[list[int]]]  # the same groups as world ranks
    stages: tuple[str, ...]                  # stages in which the role is active
    colocate_with: str | None
    memory: MemoryEstimate                   # the footprint on each device while resident
    memory_gb: dict[str, float]              # stage -> GB per device (0 where offloaded to host)

    @property
    def world(self) -> int:
        return len(self.slots)

    @property
    def node_range(self) -> str:
        """The nodes as placement syntax, e.g. "0-1" (or "0,2" when not contiguous)."""
        first, last = self.nodes[0], self.nodes[-1]
        if list(self.nodes) == list(range(first, last + 1)):
            return str(first) if first == last else f"{first}-{last}"
        return ",".join(str(n) for n in self.nodes)

    def local_rank(self, slot: int) -> int:
        """The role-local rank (Megatron's global rank inside this role's world) of a slot."""
        return self.slots.index(slot)

    def to_json(self) -> dict[str, Any]:
        return {"slots": list(self.slots), "ranks": list(self.ranks), "nodes": list(self.nodes),
                "parallel": dict(self.parallel),
                "groups": {kind: [list(g) for g in self.groups[kind]] for kind in GROUP_KINDS},
                "memory_gb": {stage: round(self.memory_gb[stage], 6) for stage in STAGES}}


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the roles active in it, those on their devices meanwhile, and the moves at
    its entry. `moves` is False for a stage that runs alongside others (rollout and reward in async
    mode, or a stage in which no role needs device memory): it changes nothing at entry and runs with
    the residency of the stages it `follows`, so `resident` and the memory are the union and the
    peak over those."""

    name: str
    active: dict[str, tuple[int, ...]]
    resident: tuple[str, ...]
    offload: tuple[str, ...]                  # moved to host memory at entry (inactive, sharing a slot whose
                                              # roles do not fit on the device together)
    overlaps: tuple[str, ...] = ()            # stages that run at the same time
    moves: bool = True
    follows: tuple[str, ...] = ()             # moves nothing: runs with the residency of these stages
    slot_memory_gb: dict[int, float] = field(default_factory=dict)  # used slot -> GB resident in this stage
    node_host_gb: dict[int, float] = field(default_factory=dict)    # node -> GB waiting in its host memory

    def to_json(self) -> dict[str, Any]:
        return {"active": {role: list(slots) for role, slots in self.active.items()},
                "resident": list(self.resident), "offload": list(self.offload), "overlaps": list(self.overlaps),
                "moves": self.moves, "follows": list(self.follows)}


@dataclass(frozen=True)
class CheckpointEstimate:
    """How big a checkpoint is and how long saving it takes (every node writes and hashes its share)."""

    bytes: int
    seconds: float
    nodes: int
    gbps: float
    window_s: int | None      # how long before the time limit the warning signal comes (Slurm profiles)

    @property
    def too_slow(self) -> bool:
        """The save starts only when the step in flight ends, and the batch script requeues a bit
        before the time limit: a save that needs more than half the warning window may not fit."""
        return self.window_s is not None and self.seconds > 0.5 * self.window_s


@dataclass(frozen=True)
class Plan:
    """The static device map of one job on one cluster profile."""

    world_size: int
    nodes: int
    devices_per_node: int
    roles: dict[str, RolePlan]
    stages: dict[str, StagePlan]
    job: str = ""
    cluster: str = ""
    device: str = "cuda"
    device_memory_gb: float = 0.0
    checkpoint: CheckpointEstimate | None = None
    node_memory_gb: float | None = None      # host memory per node (slurm.mem), when the profile says
    rollout_shares_weights: bool = False     # native rollout samples with the trainer's parameters (no sync)

    @property
    def used_slots(self) -> tuple[int, ...]:
        return tuple(sorted({slot for role in self.roles.values() for slot in role.slots}))

    def rank_of_slot(self, slot: int) -> int:
        """World rank of a used slot: 1 + its index among the sorted used slots (rank 0 is the controller)."""
        used = self.used_slots
        if slot not in used:
            raise KeyError(f"slot {slot} is not used by this plan (used: {list(used)})")
        return 1 + used.index(slot)

    def slot_of_rank(self, rank: int) -> int:
        if not 1 <= rank < self.world_size:
            raise KeyError(f"rank {rank} owns no slot (rank 0 is the controller; workers are 1..{self.world_size - 1})")
        return self.used_slots[rank - 1]

    def node_of_slot(self, slot: int) -> int:
        return slot // self.devices_per_node

    def roles_on_slot(self, slot: int) -> list[str]:
        return [name for name, role in self.roles.items() if slot in role.slots]

    def on_device(self, role: str, stage: str) -> bool:
        """Whether `role` holds device memory during `stage` (at some time, for an overlapped stage)."""
        return role in self.stages[stage].resident

    @property
    def residency(self) -> dict[str, tuple[str, ...]]:
        """Stage -> the roles on their devices during it, for the stages whose entry moves roles."""
        return {name: stage.resident for name, stage in self.stages.items() if stage.moves}

    def roles_of_rank(self, rank: int) -> list[str]:
        """The roles a worker rank hosts (empty for the controller)."""
        return [] if rank == CONTROLLER_RANK else self.roles_on_slot(self.slot_of_rank(rank))

    def to_json(self) -> dict[str, Any]:
        data = {"world_size": self.world_size, "nodes": self.nodes, "devices_per_node": self.devices_per_node,
                "roles": {name: role.to_json() for name, role in self.roles.items()},
                "stages": {name: stage.to_json() for name, stage in self.stages.items()},
                "rollout_shares_weights": self.rollout_shares_weights}
        if self.checkpoint is not None:
            data["checkpoint"] = {"bytes": self.checkpoint.bytes, "seconds": round(self.checkpoint.seconds, 3),
                                  "nodes": self.checkpoint.nodes, "window_s": self.checkpoint.window_s}
        return data
