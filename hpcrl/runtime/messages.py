"""What travels between the controller and the workers over MPI (pickled small objects)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TAG_CALL = 11    # controller -> worker: run a method of a hosted role
TAG_REPLY = 12   # worker -> controller: the method's result
TAG_ERROR = 13   # worker -> controller: the method raised; the world is about to be aborted


@dataclass(frozen=True)
class Call:
    call_id: int
    role: str
    method: str
    args: tuple[Any, ...] = ()


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


SHUTDOWN = "__shutdown__"
