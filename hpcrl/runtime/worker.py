"""The worker loop: host the roles the plan gives this rank and run what the controller calls."""
from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcrl.runtime.data_plane import broadcast_batch
from hpcrl.runtime.faults import maybe_fail
from hpcrl.runtime.messages import SHUTDOWN, TAG_CALL, TAG_REPLY, Call, Reply
from hpcrl.runtime.mpi_world import COMM, CONTROLLER, poll_recv, report_and_wait, send
from hpcrl.runtime.watchdog import Heartbeat


class RankHost:
    """Calls addressed to the rank rather than to one role (role name "*"): checkpoint save/load."""

    def __init__(self, roles: dict[str, Any]):
        self.roles = roles

    def ready(self) -> list[tuple[str, float]]:
        """Answered once every role of the rank is built (the controller's start-up barrier), with
        when this rank passed each phase of its start-up (hpcrl.runtime.startup)."""
        from hpcrl.runtime import startup

        return startup.MARKS

    def save_checkpoint(self, path: str) -> None:
        from hpcrl.checkpoint import save_rng

        for role in self.roles.values():
            if hasattr(role, "save"):
                role.save(Path(path))
        save_rng(Path(path), COMM.Get_rank())

    def hash_files(self, path: str, shares: dict[int, list[str]]) -> dict[str, tuple[int, str]]:
        """Size and SHA-256 of this rank's share of a checkpoint's files, each fsync'ed on the way."""
        from hpcrl.checkpoint.manifest import sha256_file

        return {name: tuple(vars(sha256_file(Path(path) / name, fsync=True)).values())
                for name in shares.get(COMM.Get_rank(), [])}

    def check_files(self, path: str, shares: dict[int, list[tuple[str, str]]]) -> str | None:
        """The first of this rank's share of a checkpoint's files whose SHA-256 is not the manifest's."""
        from hpcrl.checkpoint.manifest import sha256_file

        for name, expected in shares.get(COMM.Get_rank(), []):
            if sha256_file(Path(path) / name).sha256 != expected:
                return f"{name}: SHA-256 mismatch (corrupt)"
        return None

    def load_checkpoint(self, path: str) -> None:
        from hpcrl.checkpoint import load_rng

        for role in self.roles.values():
            if hasattr(role, "load"):
                role.load(Path(path))
        load_rng(Path(path), COMM.Get_rank())


def serve(roles: dict[str, Any], replicas: Mapping[str, tuple[dist.ProcessGroup, int]] | None = None,
          tag: int = TAG_CALL, heartbeat: Heartbeat | None = None) -> None:
    """Answer calls on `tag` until the controller says shutdown. An exception is reported, then the
    world aborts. (The main thread serves TAG_CALL; a weight server's thread serves TAG_SYNC.)

    `replicas`: for each hosted role whose model replica spans several ranks, the replica's group
    and its data leader: a split call's batch arrives at the leader and is broadcast from there.
    `heartbeat`: told which call runs, for the controller's watchdog.
    """
    roles = {"*": RankHost(roles), **roles}
    replicas = replicas or {}
    while True:
        if heartbeat is not None:
            heartbeat.activity = None
        call, _, _ = poll_recv(source=CONTROLLER, tag=tag)
        assert isinstance(call, Call)
        if call.method == SHUTDOWN:
            send(Reply(call.call_id, None), CONTROLLER, TAG_REPLY)
            return
        if heartbeat is not None:
            heartbeat.activity = (call.method, time.monotonic())
        try:
            maybe_fail(COMM.Get_rank(), call.method)
            args = call.args
            if call.split and call.role in replicas:
                group, leader = replicas[call.role]
                args = (broadcast_batch(args[0], leader, group),) + args[1:]
            result = getattr(roles[call.role], call.method)(*args)
        except BaseException:
            report_and_wait(call.role, call.method)
            return
        if call.reply:
            send(Reply(call.call_id, result), CONTROLLER, TAG_REPLY, wait=True)
