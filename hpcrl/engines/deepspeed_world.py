"""DeepSpeed's world made the role's rank group.

DeepSpeed assumes it owns the whole torch.distributed world: ZeRO-3 calls `barrier()` while it is
built and broadcasts from rank 0 of the world before every forward, and it names source ranks as
ranks of its world (`broadcast(t, 0, dp_group)`). In hpcrl the world also holds the controller and
the other roles, which never enter those calls. DeepSpeed routes every collective through one
backend object (`deepspeed.comm.comm.cdb`); this module wraps it so that "no group" and "the
world" mean the role's group and every rank DeepSpeed names or is told is a rank of the role.
Nothing else of DeepSpeed is touched.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch.distributed as dist

_WORLD = (None, dist.GroupMember.WORLD)


def _signature(method: Any) -> inspect.Signature | None:
    """The signature of a backend method as written, with `self`. DeepSpeed wraps its collectives
    in decorators that hide it (`def wrapper(self, *args, **kwargs)`, no functools.wraps); the
    wrapped function is the closure's `func`."""
    function = getattr(method, "__func__", method)
    while True:
        cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ())) \
            if hasattr(function, "__code__") else {}
        inner = cells["func"].cell_contents if "func" in cells else getattr(function, "__wrapped__", None)
        if not callable(inner):
            break
        function = inner
    try:
        return inspect.signature(function)
    except (TypeError, ValueError):
        return None


class RoleScopedBackend:
    """A deepspeed.comm backend whose world is `group` (every other attribute is DeepSpeed's own)."""

    def __init__(self, backend: Any, group: dist.ProcessGroup):
        self._backend = backend
        self.group = group
        self._ranks = dist.get_process_group_ranks(group)

    def __getattr__(self, name: str) -> Any:
        """Called only for names not set yet: each method is resolved once and kept on the instance,
        so collectives on the training path do not inspect signatures again."""
        attr = getattr(self._backend, name)
        if not callable(attr):
            return attr
        resolved = self._scope(attr)
        setattr(self, name, resolved)
        return resolved

    def _scope(self, attr: Any) -> Any:
        signature = _signature(attr)
        if signature is None or "group" not in signature.parameters:
            return attr

        def scoped(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self._backend, *args, **kwargs)
            bound.apply_defaults()
            if bound.arguments.get("group") in _WORLD:
                bound.arguments["group"] = self.group
            for key in ("src", "dst"):  # ranks of DeepSpeed's world -> global ranks, with or without a group
                if bound.arguments.get(key) is not None:
                    bound.arguments[key] = self._ranks[bound.arguments[key]]
            return attr(*bound.args[1:], **bound.kwargs)

        return scoped

    def get_global_rank(self, group: Any, group_rank: int) -> int:
        """The rank in DeepSpeed's world (the role) of `group`'s rank `group_rank`."""
        return self._ranks.index(self._backend.get_global_rank(self.group if group in _WORLD else group, group_rank))

    def get_world_group(self) -> dist.ProcessGroup:
        return self.group

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup:
        if sorted(ranks) == list(range(len(self._ranks))):
            return self.group
        raise RuntimeError(f"DeepSpeed asked for a process group of ranks {ranks} of its world; hpcrl builds every "
                           "group before the engines (new_group is collective over all ranks, the controller too)")


def scope_deepspeed_world(group: dist.ProcessGroup) -> None:
    """Initialise deepspeed.comm on the existing world and make `group` its world. Roles colocated
    whole (actor, reference, critic on the same ranks) each have a group of their own over the same
    ranks: the first one's serves as the world of all (DeepSpeed's world collectives are the same
    over either; each engine still reduces over its own group)."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    deepspeed.init_distributed(dist_backend=dist.get_backend(group), auto_mpi_discovery=False,
                               dist_init_required=False)
    current = ds_comm.cdb
    if isinstance(current, RoleScopedBackend):
        if dist.get_process_group_ranks(current.group) != dist.get_process_group_ranks(group):
            raise RuntimeError("two DeepSpeed roles on one rank need the same ranks (colocate them whole, with the "
                               "same dp)")
        return
    ds_comm.cdb = RoleScopedBackend(current, group)
