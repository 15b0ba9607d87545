"""Noticing a rank that died or hangs, naming it, and ending the world so the restart policy applies.

Three ways a rank goes wrong without raising (a raise is reported by the rank itself):
- **it dies** (SIGKILL, a segfault, the OOM killer): its supervisor (supervisor.py) writes an exit
  record; the controller names the rank, its role, host and exit signal within a tick (1 s).
- **it stops** (SIGSTOP, a node that freezes, Python's lock held for minutes): its heartbeats stop;
  after `watchdog.lost_after_s` the controller names it, with the call it was in.
- **a call never ends** although every rank is alive (a deadlocked collective): the call's deadline
  is `call_timeout_factor` times the longest call of its kind so far, at least `call_timeout_min_s`,
  at most `call_timeout_max_s` (also the deadline of a kind not seen finishing yet).
For the last two every live rank prints its threads' Python stacks (faulthandler) first. Then the
world is aborted with EXIT_HUNG: `hpcrl run` restarts it from the newest checkpoint while
`max_restarts` allows, and the batch script requeues it.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hpcrl.config.constants import EXIT_HUNG
from hpcrl.config.job import WatchdogConfig
from hpcrl.runtime.messages import TAG_DUMP, TAG_HEARTBEAT, Beat, ErrorReport
from hpcrl.runtime.mpi_world import CONTROLLER, abort, poll_recv, queued, send
from hpcrl.runtime.supervisor import EXITS_DIR, describe_exit, read_exit_record

TICK_S = 1.0   # how often the controller looks (when no message is waiting)
DUMP_WAIT_S = 3.0
DEATH_RECORD_WAIT_S = 2.0   # how long a raised error waits for a dead peer's record (the likelier cause)


@dataclass(frozen=True)
class RankInfo:
    host: str
    pid: int
    roles: str

    def describe(self, rank: int) -> str:
        return f"rank {rank} (role {self.roles}, host {self.host}, pid {self.pid})"


DUMP_PROBE_S = 0.05   # how often a worker looks for the controller's request of its stacks


class Heartbeat:
    """A worker's thread: a heartbeat every `interval_s`, and a stack dump when the controller asks."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.activity: tuple[str, float] | None = None   # (method, monotonic start) of the main thread's call
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcrl-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Before the rank leaves MPI: no thread may be inside an MPI call then."""
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            activity = self.activity
            method, seconds = (activity[0], time.monotonic() - activity[1]) if activity else (None, 0.0)
            send(Beat(method, seconds), CONTROLLER, TAG_HEARTBEAT)
            beat_due = time.monotonic() + self.interval_s
            # A probe every 50 ms, asleep in between (a receive's back-off would wake this thread
            # every millisecond, and take the GIL from the busy main thread each time); `stop`
            # ends the wait at once (a rank's exit waited for a whole interval).
            while not self._stopping.wait(DUMP_PROBE_S) and time.monotonic() < beat_due:
                if queued(source=CONTROLLER, tag=TAG_DUMP):
                    poll_recv(source=CONTROLLER, tag=TAG_DUMP)
                    from hpcrl.runtime.mpi_world import COMM

                    print(f"hpcrl: Python stacks of rank {COMM.Get_rank()}, as asked by the controller:",
                          file=sys.stderr, flush=True)
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


class Watchdog:
    """The controller's side: heartbeats, exit records and call deadlines, checked every tick."""

    def __init__(self, config: WatchdogConfig, ranks: dict[int, RankInfo], run_dir: Path, since: float):
        """`since`: when this world started (wall clock): older exit records belong to an earlier one."""
        self.config = config
        self.ranks = ranks
        self.run_dir = Path(run_dir)
        self.since = since
        now = time.monotonic()
        self.started = now
        self.last_beat: dict[int, float] = {rank: now for rank in ranks}
        self.activity: dict[int, Beat] = {}
        self.slowest: dict[str, float] = {}
        self.last_check = now

    def beat(self, rank: int, beat: Beat) -> None:
        self.last_beat[rank] = time.monotonic()
        self.activity[rank] = beat

    def finished(self, method: str, seconds: float) -> None:
        self.slowest[method] = max(seconds, self.slowest.get(method, 0.0))

    def deadline(self, method: str) -> float:
        config = self.config
        if method not in self.slowest:
            return config.call_timeout_max_s
        return min(config.call_timeout_max_s,
                   max(config.call_timeout_min_s, config.call_timeout_factor * self.slowest[method]))

    def due(self) -> bool:
        return time.monotonic() - self.last_check >= TICK_S

    def check(self, calls: Iterable[tuple[int, str, float]]) -> None:
        """Abort the world if a rank died, went silent, or owes a reply past its call's deadline.
        `calls`: (rank, method, monotonic start) of every reply still owed. Call it only when no
        message is waiting (the heartbeats received are all counted)."""
        now = time.monotonic()
        self.last_check = now
        self._abort_if_dead()
        for rank, seen in self.last_beat.items():
            if now - seen > self.config.lost_after_s:
                self._hung(f"{self.ranks[rank].describe(rank)} has sent no heartbeat for {now - seen:.1f} s "
                           f"(watchdog.lost_after_s {self.config.lost_after_s:g}){self._doing(rank)}"
                           f"{self._process_state(rank)}")
        for rank, method, started in calls:
            if now - started > self.deadline(method):
                self._hung(f"{self.ranks[rank].describe(rank)} has not answered {method} after {now - started:.1f} s "
                           f"(deadline {self.deadline(method):.0f} s: {self._deadline_rule(method)}){self._doing(rank)}")

    def _abort_if_dead(self, consequence: str = "") -> None:
        dead = self._dead_ranks()
        if dead:
            lines = [f"hpcrl: {self.ranks[rank].describe(rank) if rank in self.ranks else f'rank {rank}'} died: "
                     f"{describe_exit(record)}{self._doing(rank)}" for rank, record in dead]
            abort("\n".join(lines) + consequence + "\nhpcrl: aborting all ranks.", EXIT_HUNG)

    def error_reported(self, report: ErrorReport) -> None:
        """A rank raised: when a peer of it died (its collective then fails), the death is the cause.
        Its supervisor's record comes within a moment; a rank that raised on its own is reported as is."""
        deadline = time.monotonic() + DEATH_RECORD_WAIT_S
        while time.monotonic() < deadline:
            last = report.traceback.strip().splitlines()[-1] if report.traceback.strip() else ""
            self._abort_if_dead(f"\nhpcrl: then rank {report.rank} (role {report.role}) failed in {report.method}: "
                                f"{last}")
            time.sleep(0.1)

    def _dead_ranks(self) -> list[tuple[int, dict]]:
        folder = self.run_dir / EXITS_DIR
        if not folder.is_dir():
            return []
        dead = []
        for name in os.listdir(folder):
            if name.startswith("rank-") and name.endswith(".exit.json"):
                rank = int(name[len("rank-"):-len(".exit.json")])
                record = read_exit_record(self.run_dir, rank)
                if record is not None and record.get("time", 0) >= self.since:
                    dead.append((rank, record))
        return sorted(dead)

    def _doing(self, rank: int) -> str:
        beat = self.activity.get(rank)
        if beat is None:
            return ", before its first heartbeat (still starting up)"
        if beat.method is None:
            return ", between calls"
        return f", in {beat.method} for {beat.seconds:.1f} s at its last heartbeat"

    def _process_state(self, rank: int) -> str:
        """What /proc says of the rank's process when it runs on this host."""
        import socket

        info = self.ranks[rank]
        if info.host != socket.gethostname():
            return ""
        try:
            fields = Path(f"/proc/{info.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return "; its process is gone"
        state = {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger", "D": "in uninterruptible I/O",
                 "Z": "a zombie", "R": "running", "S": "sleeping"}.get(fields[0], fields[0])
        return f"; its process is {state}"

    def _deadline_rule(self, method: str) -> str:
        if method not in self.slowest:
            return "watchdog.call_timeout_max_s, none finished yet"
        return (f"{self.config.call_timeout_factor:g} x the slowest so far, {self.slowest[method]:.1f} s, within "
                f"[{self.config.call_timeout_min_s:g}, {self.config.call_timeout_max_s:g}]")

    def _hung(self, message: str) -> None:
        print(f"hpcrl: {message}\nhpcrl: asking every live rank for its Python stacks, then aborting all ranks",
              file=sys.stderr, flush=True)
        for rank in self.ranks:
            send(None, rank, TAG_DUMP)
        time.sleep(DUMP_WAIT_S)
        abort(f"hpcrl: {message}\nhpcrl: aborting all ranks.", EXIT_HUNG)
