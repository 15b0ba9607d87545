"""The controller's view of the workers: calls to role groups with explicit dispatch modes.

Two modes, as in ROLL/verl:
- `ONE_TO_ALL`: every rank of the group gets the same arguments (weight sync, save, setup);
- `DP_SPLIT`: the first argument is a batch (a dict of equal-length lists) split into contiguous
  shards, one per data-parallel rank; every rank of a DP replica gets its replica's shard, and
  the results of one rank per replica are concatenated back in the original sample order.
Calls are asynchronous: `call()` returns a `Pending`; `wait()` and `wait_any()` receive replies,
file every reply under its own call (whichever call is being waited for), and abort the world
on an error report from any rank.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hpcrl.runtime.messages import TAG_CALL, TAG_ERROR, TAG_REPLY, Call, ErrorReport, Reply
from hpcrl.runtime.mpi_world import COMM, abort, poll_recv

Batch = dict[str, list]


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    DP_SPLIT = "dp_split"


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Contiguous, near-equal shards of a columnar batch."""
    size = len(next(iter(batch.values())))
    bounds = [size * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i]:bounds[i + 1]] for k, v in batch.items()} for i in range(parts)]


def concat_batches(shards: list[Batch]) -> Batch:
    return {k: [x for shard in shards for x in shard[k]] for k in shards[0]}


@dataclass
class Pending:
    group: "WorkerGroup"
    mode: Dispatch
    call_ids: dict[int, int]          # rank -> call id
    results: dict[int, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.call_ids)

    def value(self) -> Any:
        if self.mode is Dispatch.DP_SPLIT:
            return concat_batches([self.results[rank] for rank in self.group.collect_ranks])
        return [self.results[rank] for rank in self.group.ranks]


class WorkerGroup:
    """The ranks hosting one role, with their data-parallel layout from the compiled plan."""

    _ids = itertools.count()

    def __init__(self, role: str, ranks: list[int], dp_groups: list[list[int]]):
        self.role = role
        self.ranks = ranks
        # The DP index of each rank: replica d holds the d-th member of every DP group.
        self.dp_index = {rank: d for group in dp_groups for d, rank in enumerate(group)}
        self.dp_size = len(dp_groups[0])
        # One rank per replica returns the replica's result: the first rank of each replica.
        self.collect_ranks = [min(r for r in ranks if self.dp_index[r] == d) for d in range(self.dp_size)]

    def call(self, method: str, mode: Dispatch, *args: Any) -> Pending:
        shards = split_batch(args[0], self.dp_size) if mode is Dispatch.DP_SPLIT else None
        call_ids = {}
        for rank in self.ranks:
            call_args = (shards[self.dp_index[rank]],) + args[1:] if shards is not None else args
            call_id = next(self._ids)
            COMM.send(Call(call_id, self.role, method, call_args), dest=rank, tag=TAG_CALL)
            call_ids[rank] = call_id
        pending = Pending(self, mode, call_ids)
        for rank, call_id in call_ids.items():
            _outstanding[call_id] = (pending, rank)
        return pending


_outstanding: dict[int, tuple[Pending, int]] = {}  # call id -> (its Pending, the rank it went to)


def _receive_one() -> Pending:
    """Receive the next reply and file it; returns the Pending it belongs to."""
    message, source, tag = poll_recv()
    if tag == TAG_ERROR:
        assert isinstance(message, ErrorReport)
        abort(f"hpcrl: {message.describe()}\nhpcrl: aborting all ranks.")
    if tag != TAG_REPLY or not isinstance(message, Reply) or message.call_id not in _outstanding:
        abort(f"hpcrl: controller got an unexpected message (tag {tag}) from rank {source}")
    owner, rank = _outstanding.pop(message.call_id)
    owner.results[rank] = message.result
    return owner


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
