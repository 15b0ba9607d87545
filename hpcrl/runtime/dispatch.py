"""The controller's view of the workers: calls to role groups with explicit dispatch modes.

Two modes, as in ROLL/verl:
- `ONE_TO_ALL`: every rank of the group gets the same arguments and replies (weight sync, save,
  setup);
- `DP_SPLIT`: the first argument is a columnar batch (`hpcrl.ragged`), split into contiguous
  shards, one per data-parallel replica. Each shard goes, as one message of raw buffers, to the
  replica's data leader only, which broadcasts it inside the replica over torch.distributed (as
  Megatron's `broadcast_data`); the other ranks get the call without the data. Only the rank that
  holds a replica's result replies, and the replies are concatenated in the original sample order.
Calls are asynchronous: `call()` returns a `Pending`; `wait()` and `wait_any()` receive replies,
file every reply under its own call (whichever call is being waited for), and abort the world
on an error report from any rank.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hpcrl.ragged import concat_batches, split_batch
from hpcrl.runtime.layout import RoleLayout
from hpcrl.runtime.messages import TAG_CALL, TAG_ERROR, TAG_HEARTBEAT, TAG_REPLY, Call, ErrorReport, Reply
from hpcrl.runtime.mpi_world import abort, poll_recv, queued, send
from hpcrl.runtime.watchdog import TICK_S, Watchdog


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"


@dataclass(eq=False)
class Pending:
    group: "WorkerGroup"
    mode: Dispatch
    call_ids: dict[int, int]          # replying rank -> call id
    method: str = ""
    started: float = field(default_factory=time.monotonic)
    results: dict[int, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.call_ids)

    def value(self) -> Any:
        if self.mode is Dispatch.DP_SPLIT:
            return concat_batches([self.results[rank] for rank in self.group.result_ranks])
        return [self.results[rank] for rank in self.group.ranks]


class WorkerGroup:
    """Ranks hosting one role (or one service of it, such as the weight servers), with its replicas'
    data leaders and result ranks from the compiled plan. `tag` is the MPI tag its calls travel on."""

    _ids = itertools.count()

    def __init__(self, role: str, ranks: list[int], data_leaders: list[int] | None = None,
                 result_ranks: list[int] | None = None, tag: int = TAG_CALL):
        self.role = role
        self.ranks = list(ranks)
        self.data_leaders = data_leaders if data_leaders is not None else list(ranks)
        self.result_ranks = result_ranks if result_ranks is not None else list(self.data_leaders)
        self.tag = tag

    @classmethod
    def of(cls, role: RoleLayout) -> WorkerGroup:
        replicas = range(role.dp_size)
        return cls(role.name, role.ranks, [role.data_leader(d) for d in replicas],
                   [role.result_rank(d) for d in replicas])

    @property
    def dp_size(self) -> int:
        return len(self.data_leaders)

    def call(self, method: str, mode: Dispatch, *args: Any) -> Pending:
        split = mode is Dispatch.DP_SPLIT
        shards = dict(zip(self.data_leaders, split_batch(args[0], self.dp_size))) if split else {}
        repliers = set(self.result_ranks) if split else set(self.ranks)
        call_ids = {}
        for rank in self.ranks:
            call_args = (shards.get(rank),) + args[1:] if split else args
            call_id = next(self._ids)
            send(Call(call_id, self.role, method, call_args, split, rank in repliers), rank, self.tag)
            if rank in repliers:
                call_ids[rank] = call_id
        pending = Pending(self, mode, call_ids, method)
        for rank, call_id in call_ids.items():
            _outstanding[call_id] = (pending, rank)
        return pending


_outstanding: dict[int, tuple[Pending, int]] = {}  # call id -> (its Pending, the rank that will reply)
_watchdog: Watchdog | None = None


def install_watchdog(watchdog: Watchdog) -> None:
    """From now on every wait for a reply also watches the workers (see watchdog.py)."""
    global _watchdog
    _watchdog = watchdog


def _receive_one() -> Pending:
    """Receive the next reply and file it; returns the Pending it belongs to. Heartbeats are counted
    on the way, and the watchdog looks at the workers whenever no message is waiting."""
    while True:
        if _watchdog is not None and _watchdog.due() and not queued():
            _watchdog.check((rank, pending.method, pending.started) for pending, rank in _outstanding.values())
        got = poll_recv(timeout=TICK_S if _watchdog is not None else None)
        if got is None:
            continue
        message, source, tag = got
        if tag == TAG_HEARTBEAT:
            if _watchdog is not None:
                _watchdog.beat(source, message)
            continue
        if tag == TAG_ERROR:
            assert isinstance(message, ErrorReport)
            if _watchdog is not None:
                _watchdog.error_reported(message)   # aborts naming a dead peer, if one died
            abort(f"hpcrl: {message.describe()}\nhpcrl: aborting all ranks.")
        if tag != TAG_REPLY or not isinstance(message, Reply) or message.call_id not in _outstanding:
            abort(f"hpcrl: controller got an unexpected message (tag {tag}) from rank {source}")
        owner, rank = _outstanding.pop(message.call_id)
        owner.results[rank] = message.result
        if _watchdog is not None:
            _watchdog.finished(owner.method, time.monotonic() - owner.started)
        return owner


def busy(ranks: set[int] | list[int]) -> bool:
    """Whether a call to any of `ranks` is still running (judged by the replies still owed)."""
    ranks = set(ranks)
    return any(set(pending.group.ranks) & ranks for pending, _ in _outstanding.values())


def wait(*pending: Any) -> list[Any]:
    """Block (without spinning) until every given call has replied; returns their values in order.
    Anything with `done` and `value()` can be waited for (a Pending, or a pair of them)."""
    while not all(p.done for p in pending):
        _receive_one()
    return [p.value() for p in pending]


def wait_any(pending: list[Any]) -> Any:
    """Block until one of the given calls is complete, and return it (replies to others are filed)."""
    while True:
        for p in pending:
            if p.done:
                return p
        _receive_one()


def run(group: WorkerGroup, method: str, mode: Dispatch, *args: Any) -> Any:
    """Call and wait: the synchronous form."""
    return wait(group.call(method, mode, *args))[0]

