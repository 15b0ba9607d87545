"""torch.distributed process groups for the plan: one per DP group of each role, one for weight sync.

`new_group` is collective over the whole world, so every rank (the controller too) builds the
same groups in the same order and keeps the ones it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from hpcrl.runtime.layout import WorldLayout


@dataclass
class ProcessGroups:
    dp: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)  # role -> this rank's DP group
    dp_index: dict[str, int] = field(default_factory=dict)                 # role -> this rank's DP index
    megatron: dict[str, dict] = field(default_factory=dict)                # role -> its Megatron groups here
    sync: dist.ProcessGroup | None = None
    sync_src: int = -1


def _new_group(ranks: list[int], always: bool = False) -> dist.ProcessGroup | None:
    """None for one rank (nothing to communicate), unless the engine needs a group as its world."""
    return dist.new_group(ranks) if len(ranks) > 1 or always else None


def build_process_groups(layout: WorldLayout, rank: int) -> ProcessGroups:
    groups = ProcessGroups()
    for name, role in layout.roles.items():
        for ranks in role.dp_groups:
            group = _new_group(ranks, always=role.engine == "deepspeed")
            if rank in ranks:
                groups.dp[name] = group
                groups.dp_index[name] = ranks.index(rank)
    for name, role in layout.roles.items():
        if role.engine == "megatron":  # tp/pp/cp/ep/dp/... groups, as megatron-core wants them
            from hpcrl.engines.megatron.groups import new_role_groups, role_rank_groups

            mine = new_role_groups(role_rank_groups(role.parallel, role.ranks), rank)
            if mine is not None:
                groups.megatron[name] = mine
    receivers = layout.sync_receivers()
    groups.sync_src = layout.roles["actor_train"].source
    members = [groups.sync_src] + receivers
    sync = _new_group(members) if receivers else None
    if rank in members:
        groups.sync = sync
    return groups
