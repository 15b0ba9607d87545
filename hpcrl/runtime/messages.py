"""What travels between the controller and the workers over MPI: small pickled objects, with any
token columns inside them sent out of band as raw buffers (see mpi_world.send)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAG_CALL = 11    # controller -> worker: run a method of a hosted role
TAG_REPLY = 12   # worker -> controller: the method's result
TAG_ERROR = 13   # worker -> controller: the method raised; the world is about to be aborted
TAG_SYNC = 14    # controller -> a weight server's thread: send the staged weights now
TAG_HEARTBEAT = 15  # worker -> controller, every watchdog.heartbeat_s: alive, and in which call
TAG_DUMP = 16    # controller -> worker: print every thread's Python stack (a hang is being reported)
TAG_ADDRESS = 17  # trainer stage leader -> vLLM replica leader: where its workers meet it for NCCL
TAG_INTERRUPT = 18  # controller -> rollout replica: end generation round (batch, index) now (partial rollout)
TAG_ENV = 19     # rollout replica <-> its env rank: env calls, their answers, the end of a round (roles.env)


@dataclass(frozen=True)
class Call:
    call_id: int
    role: str
    method: str
    args: tuple[Any, ...] = ()
    split: bool = False   # args[0] is this rank's replica's share of a batch (None on all but its data leader)
    reply: bool = True    # whether this rank answers (of a replica, only the rank holding the result does)


@dataclass(frozen=True)
class Reply:
    call_id: int
    result: Any


@dataclass(frozen=True)
class ErrorReport:
    rank: int
    role: str
    method: str
    traceback: str

    def describe(self) -> str:
        return f"rank {self.rank} (role {self.role}, in {self.method}) failed:\n{self.traceback.rstrip()}"


@dataclass(frozen=True)
class Beat:
    """A worker's heartbeat: the call its main thread is in (None between calls), and for how long."""

    method: str | None
    seconds: float


SHUTDOWN = "__shutdown__"
