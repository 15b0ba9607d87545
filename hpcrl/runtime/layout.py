"""The compiled plan seen from inside the job: which world ranks host which role, and its groups.

Nothing here decides placement: it keeps the part of the plan the ranks need, in picklable form.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpcrl.placement import Plan


@dataclass(frozen=True)
class RoleLayout:
    name: str
    ranks: list[int]
    dp_groups: list[list[int]]
    engine: str
    parallel: dict[str, int]

    def replica_of(self, rank: int) -> list[int]:
        """The ranks of `rank`'s model replica (its TP x PP ranks; replica d holds the d-th member
        of every DP group), in rank order."""
        d = next(group.index(rank) for group in self.dp_groups if rank in group)
        return sorted(group[d] for group in self.dp_groups)

    @property
    def source(self) -> int:
        """The rank that owns a full copy of the weights (first rank of the first DP replica)."""
        return self.dp_groups[0][0]


@dataclass(frozen=True)
class WorldLayout:
    world_size: int
    roles: dict[str, RoleLayout]
    local_device: dict[int, int]   # worker rank -> device index on its node (the GPU it drives)

    def roles_on(self, rank: int) -> list[str]:
        return [name for name, role in self.roles.items() if rank in role.ranks]

    def sync_receivers(self) -> list[int]:
        """Rollout ranks that need the trainer's weights sent (those not sharing a rank with it)."""
        train = set(self.roles["actor_train"].ranks)
        return [r for r in self.roles["actor_infer"].ranks if r not in train]


def world_layout(plan: Plan) -> WorldLayout:
    roles = {name: RoleLayout(name, list(role.ranks), [list(g) for g in role.rank_groups["dp"]], role.engine,
                              dict(role.parallel))
             for name, role in plan.roles.items()}
    local_device = {rank: plan.slot_of_rank(rank) % plan.devices_per_node for rank in range(1, plan.world_size)}
    return WorldLayout(plan.world_size, roles, local_device)
