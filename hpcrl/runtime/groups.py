"""torch.distributed process groups for the plan: per role its DP, Megatron and replica groups; per
trainer pipeline stage a weight-sync group (gloo, with `rollout.sync_timeout_s` as its timeout).

`new_group` is collective over the whole world, so every rank (the controller too) builds the
same groups in the same order and keeps the ones it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from hpcrl.runtime.layout import WorldLayout


@dataclass
class ProcessGroups:
    dp: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)  # role -> this rank's DP group
    dp_index: dict[str, int] = field(default_factory=dict)                 # role -> this rank's DP index
    megatron: dict[str, dict] = field(default_factory=dict)                # role -> its Megatron groups here
    # role -> (this rank's cp group, the role's dp x cp group), for a torch role with context parallelism
    context: dict[str, tuple[dist.ProcessGroup, dist.ProcessGroup]] = field(default_factory=dict)
    # role -> (this rank's replica group, its data leader), for replicas of more than one rank
    replica: dict[str, tuple[dist.ProcessGroup, int]] = field(default_factory=dict)
    sync: dict[int, dist.ProcessGroup] = field(default_factory=dict)       # trainer stage -> its sync group


def _new_group(ranks: list[int], always: bool = False) -> dist.ProcessGroup | None:
    """None for one rank (nothing to communicate), unless the engine needs a group as its world."""
    return dist.new_group(ranks) if len(ranks) > 1 or always else None


def build_process_groups(layout: WorldLayout, rank: int, sync_timeout_s: float) -> ProcessGroups:
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
        elif role.engine == "torch" and role.parallel.get("cp", 1) > 1:
            # its cp groups, and DDP over every rank (the torch engine has no tp or pp: dp x cp is all)
            cp_groups = {tuple(ranks): dist.new_group(ranks) for ranks in role.rank_groups["cp"]}
            everyone = dist.new_group(list(role.ranks))
            for ranks, group in cp_groups.items():
                if rank in ranks:
                    groups.context[name] = (group, everyone)
    # Batches are broadcast inside a replica over gloo, whatever the device (see data_plane.py).
    for name, role in layout.roles.items():
        for replica in role.replicas:
            if len(replica) > 1:
                group = dist.new_group(replica, backend="gloo")
                if rank in replica:
                    groups.replica[name] = (group, replica[0])
    sync = layout.sync
    for stage in range(len(sync.sources)):
        members = sync.members(stage)
        if len(members) > 1:
            group = dist.new_group(members, backend="gloo", timeout=timedelta(seconds=sync_timeout_s))
            if rank in members:
                groups.sync[stage] = group
    return groups
