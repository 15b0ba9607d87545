"""Megatron-core process groups for one role, as explicit torch.distributed groups.

A role is a sub-world of the job's MPI world (rank 0 is the controller; other roles own other
ranks), while `parallel_state.initialize_model_parallel` assumes that Megatron owns the whole
default group. So Megatron's global state is left untouched: the groups of each Megatron role are
created with `new_group` over the world ranks of the compiled plan, and handed to megatron-core
as a `ProcessGroupCollection` (the model, DDP, the optimizer and the schedules all take one).
This also lets two Megatron roles with different layouts share a rank (a colocated reference).

The rank lists come from hpcrl.placement's RankGenerator (megatron-core's, reimplemented) over
the role's local ranks, mapped to world ranks; for tp/pp/cp/ep/dp they are the plan's
`rank_groups` exactly (the tests check both).
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from hpcrl.placement.rank_groups import RankGenerator

# ProcessGroupCollection field -> (generator, token). "dense" is Megatron's decoder generator
# (ep=1), "expert" its expert generator (expert tp = tp, cp folded into expert dp).
_TOKENS = {
    "tp": ("dense", "tp"), "pp": ("dense", "pp"), "mp": ("dense", "tp-pp"), "cp": ("dense", "cp"),
    "tp_cp": ("dense", "tp-cp"), "dp": ("dense", "dp"), "dp_cp": ("dense", "dp-cp"),
    "tp_dp_cp": ("dense", "tp-dp-cp"), "ep": ("expert", "ep"), "expt_tp": ("expert", "tp"),
    "tp_ep": ("expert", "tp-ep"), "tp_ep_pp": ("expert", "tp-ep-pp"), "expt_dp": ("expert", "dp"),
}
# With one distributed-optimizer instance, Megatron's "intra" groups are the full ones.
_ALIASES = {"intra_dp_cp": "dp_cp", "intra_expt_dp": "expt_dp"}
GLOO_TWINS = ("dp_cp", "expt_dp")   # the distributed optimizer's groups, also wanted over gloo


def role_rank_groups(parallel: Mapping[str, int], ranks: Sequence[int]) -> dict[str, list[list[int]]]:
    """Every group kind megatron-core uses, as lists of world ranks (`ranks[i]` is local rank i)."""
    tp, pp, cp, ep = (parallel.get(k, 1) for k in ("tp", "pp", "cp", "ep"))
    world = len(ranks)
    if world % (tp * pp * cp):
        raise ValueError(f"{world} ranks do not split into tp={tp} x pp={pp} x cp={cp}")
    generators = {"dense": RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp),
                  "expert": RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1)}
    local = {kind: generators[gen].get_ranks(token) for kind, (gen, token) in _TOKENS.items()}
    local["embd"] = [sorted({g[0], g[-1]}) for g in local["pp"]]  # first and last stage hold embeddings
    local["pos_embd"] = [[g[0]] for g in local["pp"]]
    local["intra_dist_opt"] = [list(range(world))]
    return {kind: [[ranks[i] for i in group] for group in groups] for kind, groups in local.items()}


def new_role_groups(groups: Mapping[str, list[list[int]]], rank: int) -> dict[str, dist.ProcessGroup | None] | None:
    """Create the groups on every rank of the world (new_group is collective over the default group).

    Each distinct rank list is created once, in a fixed order, so every rank makes the same calls.
    Returns this rank's group of each kind (None for a kind it is in no group of, e.g. `embd` on a
    middle pipeline stage), or None when the rank is not in the role.
    """
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    mine: dict[str, dist.ProcessGroup | None] = {}
    for kind in sorted(groups):
        mine[kind] = None
        for ranks in groups[kind]:
            key = tuple(ranks)
            if key not in created:
                created[key] = dist.new_group(list(key))
            if rank in key:
                mine[kind] = created[key]
    if dist.get_backend() != "gloo":  # the distributed optimizer moves checkpoint state over gloo (host memory)
        for kind in GLOO_TWINS:
            mine[f"{kind}_gloo"] = None
            for ranks in groups[kind]:
                twin = dist.new_group(list(ranks), backend="gloo")
                if rank in ranks:
                    mine[f"{kind}_gloo"] = twin
    return mine if mine["intra_dist_opt"] is not None else None


def gloo_twin(mine: Mapping[str, dist.ProcessGroup | None], group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The gloo group over the same ranks as `group` (itself when it is a gloo group already)."""
    if dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group)
    for kind in GLOO_TWINS:
        twin = mine.get(f"{kind}_gloo")
        if twin is not None and dist.get_process_group_ranks(twin) == ranks:
            return twin
    raise RuntimeError(f"no gloo twin of the process group over ranks {ranks}")


def pg_collection(mine: Mapping[str, dist.ProcessGroup | None]):
    """megatron-core's ProcessGroupCollection of this rank's groups (imports megatron)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = {kind: group for kind, group in mine.items() if not kind.endswith("_gloo")}
    return ProcessGroupCollection(**own, **{alias: mine[kind] for alias, kind in _ALIASES.items()},
                                  inter_dist_opt=None)


@contextmanager
def default_group_is(role_group: dist.ProcessGroup) -> Iterator[None]:
    """Within this block, collectives that name no group use `role_group` instead of the whole world.

    megatron-core 0.16's `get_megatron_optimizer` aligns parameter groups with one
    `all_gather_object` over the default group, which would wait for ranks outside the role (the
    controller) forever. Only the two calls it makes are redirected, for the duration of the call.
    """
    real_size, real_gather = dist.get_world_size, dist.all_gather_object
    dist.get_world_size = lambda group=None: real_size(group if group is not None else role_group)
    dist.all_gather_object = lambda out, obj, group=None: real_gather(
        out, obj, group=group if group is not None else role_group)
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = real_size, real_gather
