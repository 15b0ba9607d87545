"""Env instances in processes of their own: one that hangs past its step timeout, raises or dies
is killed and replaced, its trajectory is failed with the reason, and the other envs go on (ROLL
only logs hung envs). Calls go out to many envs at once and answers are collected as they come,
so every env progresses at its own pace (env-level asynchrony).

Each env process is a fresh interpreter (`python -m hpcrl.envs.host`), not a fork (an env host
lives in an MPI rank, where forking is unsafe) nor a multiprocessing spawn (which re-imports the
rank's main module, torch and all, in every env process); it imports only hpcrl.envs and the env's
module, found on the parent's sys.path.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hpcrl.envs.base import StepResult
from hpcrl.envs.registry import EnvSpec

START_ALLOWANCE_S = 60.0   # a new process's interpreter start and env build, on top of its first call's timeout


@dataclass(frozen=True)
class EnvFailure:
    """Why a call got no answer: the env was killed and its slot will start a new one."""

    kind: str     # hung, raised, died
    reason: str


def _serve(conn: Connection, spec: EnvSpec) -> None:
    """An env host process: build the env, then answer ("reset", seed) and ("step", action) calls."""
    try:
        env = spec.build()
    except Exception as exc:   # reported as the first call's failure
        conn.send(("error", f"could not be built: {type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", env.reset(payload) if kind == "reset" else env.step(payload)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Slot:
    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.deadline: float | None = None   # of the call in flight


class EnvPool:
    """`size` env slots built from `spec`, each in its own process, started on first use."""

    def __init__(self, spec: EnvSpec, size: int, step_timeout_s: float):
        self.spec, self.step_timeout_s = spec, step_timeout_s
        self.slots = [_Slot() for _ in range(size)]
        self.failures: Counter[str] = Counter()   # by kind: what the run's metrics report

    def _start(self, slot: _Slot) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        slot.process = subprocess.Popen([sys.executable, "-m", "hpcrl.envs.host", str(child.fileno())],
                                        pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        slot.conn = Connection(parent.detach())
        slot.conn.send(self.spec)

    def submit(self, index: int, kind: str, payload: Any) -> None:
        """Send ("reset", seed) or ("step", action text) to slot `index` (one call in flight per slot)."""
        slot = self.slots[index]
        if slot.deadline is not None:
            raise RuntimeError(f"env slot {index} has a call in flight")
        allowance = 0.0
        if slot.process is None:
            self._start(slot)
            allowance = START_ALLOWANCE_S
        slot.deadline = time.monotonic() + self.step_timeout_s + allowance
        try:
            slot.conn.send((kind, payload))
        except OSError:   # the process died since its last call: `collect` reads its closed socket and says so
            pass

    def pending(self) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot.deadline is not None]

    def collect(self, timeout: float | None = None) -> list[tuple[int, str | StepResult | EnvFailure]]:
        """Answers that arrive within `timeout` (None: wait for at least one): an observation for a
        reset, a StepResult for a step, or an EnvFailure for a slot that hung, raised or died (its
        process killed; the slot's next call starts a new one)."""
        busy = {self.slots[i].conn: i for i in self.pending()}
        if not busy:
            return []
        now = time.monotonic()
        until = min(self.slots[i].deadline for i in busy.values())
        limit = max(0.0, until - now) if timeout is None else max(0.0, min(timeout, until - now))
        answers: list[tuple[int, str | StepResult | EnvFailure]] = []
        for conn in wait(list(busy), limit):
            index = busy[conn]
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                try:   # its end of the socket closed: the process is exiting
                    code = self.slots[index].process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                answers.append((index, self._fail(index, "died", f"the env process exited (code {code})")))
                continue
            if status == "ok":
                self.slots[index].deadline = None
                answers.append((index, value))
            else:
                answers.append((index, self._fail(index, "raised", value)))
        now = time.monotonic()
        for index in [i for i in self.pending() if self.slots[i].deadline <= now]:
            answers.append((index, self._fail(index, "hung", f"no answer within {self.step_timeout_s:g} s "
                                                              "(env.step_timeout_s)")))
        return answers

    def call_all(self, calls: dict[int, tuple[str, Any]]) -> dict[int, str | StepResult | EnvFailure]:
        """Submit every call and wait for all their answers."""
        for index, (kind, payload) in calls.items():
            self.submit(index, kind, payload)
        answers: dict[int, str | StepResult | EnvFailure] = {}
        while len(answers) < len(calls):
            answers.update(self.collect())
        return answers

    def _fail(self, index: int, kind: str, reason: str) -> EnvFailure:
        self.failures[kind] += 1
        self._stop(self.slots[index])
        return EnvFailure(kind, reason)

    @staticmethod
    def _stop(slot: _Slot) -> None:
        if slot.process is not None:
            slot.process.kill()
            slot.process.wait()
            slot.conn.close()
        slot.process, slot.conn, slot.deadline = None, None, None

    def end_round(self) -> None:
        """A rollout round is over: the envs stay for the next (hpcrl.runtime.env_workers ends a
        remote pool's round here)."""

    def close(self) -> None:
        for slot in self.slots:
            self._stop(slot)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":   # an env process: its end of the socket, then the spec, then calls
    connection = Connection(int(sys.argv[1]))
    _serve(connection, connection.recv())
