"""One run per directory: `RUN_DIR/.hpcrl.lock` names who holds the run (host, PID, Slurm job).

`hpcrl run` holds it for as long as its MPI world runs; `hpcrl submit` takes it for the job it
submits (the job may wait in the queue), and the job's controller renews it at every start (a
requeued or restarted job keeps its own lock). A second `hpcrl run` or `hpcrl submit` on the same
directory is refused with the holder's name. A lock whose holder is gone (a dead PID on this host,
a Slurm job that has ended) is stale: it is taken over, and said so. The lock is a small JSON file
created with O_EXCL, which works on the shared filesystems run directories live on.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCK_NAME = ".hpcrl.lock"
TOKEN_ENV = "HPCRL_RUN_LOCK"   # the holder's token, passed to the ranks it starts


class RunLockError(RuntimeError):
    """The run directory is held by a live run, or the lock cannot be written."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    command: str                      # run | submit | job
    slurm_job_id: str | None = None
    since: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    token: str = field(default_factory=lambda: uuid.uuid4().hex)

    @classmethod
    def here(cls, command: str, slurm_job_id: str | None = None, token: str | None = None) -> Holder:
        holder = cls(socket.gethostname(), os.getpid(), command, slurm_job_id)
        return holder if token is None else cls(**{**asdict(holder), "token": token})

    def describe(self) -> str:
        job = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"`hpcrl {self.command}` (host {self.host}, PID {self.pid}{job}, since {self.since})"


def slurm_job_key(env: Mapping[str, str] | None = None) -> str | None:
    """This process's Slurm job as users name it: `12`, or `12_3` for task 3 of array job 12."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def lock_path(run_dir: Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def read_holder(run_dir: Path) -> Holder | None:
    """The current holder, or None when there is no lock (an unreadable lock counts as a holder that
    is gone: it is reported and taken over)."""
    try:
        data = json.loads(lock_path(run_dir).read_text())
        return Holder(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return Holder("?", -1, "?", token="unreadable")


def why_stale(holder: Holder, env: Mapping[str, str] | None = None) -> str | None:
    """Why `holder` no longer runs (the lock may be taken over), or None if it may still run."""
    if holder.token == "unreadable":
        return "the lock file is unreadable"
    if holder.slurm_job_id:
        from hpcrl.launch.scheduler import find_tool, query_jobs

        if find_tool("scontrol", env) is None:
            return None   # Slurm cannot be asked from here
        job = holder.slurm_job_id
        records = [r for r in query_jobs(job, env).values() if r.job_id == job or r.job_id.startswith(f"{job}_")]
        if not records:
            return f"Slurm no longer knows job {job}"
        if all(r.finished for r in records):
            return f"Slurm job {job} has ended ({', '.join(sorted({r.state for r in records}))})"
        return None
    if holder.host == socket.gethostname():
        return None if _alive_here(holder) else f"PID {holder.pid} on {holder.host} has exited"
    return None   # another host's process: it cannot be checked from here


def _alive_here(holder: Holder) -> bool:
    if holder.host != socket.gethostname():
        return True
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def acquire(run_dir: Path, holder: Holder, env: Mapping[str, str] | None = None) -> str | None:
    """Take the lock of `run_dir` for `holder` (nothing to do when it holds it already: the same
    token); returns a note when a stale lock was taken over. Raises RunLockError naming the live
    holder."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunLockError(f"{run_dir}: cannot create the run directory ({exc.strerror}); choose a writable "
                           "--run-dir") from None
    note = None
    for _ in range(3):   # another process may take a stale lock between our read and our write
        try:
            _create(lock_path(run_dir), holder)
            return note
        except FileExistsError:
            pass
        current = read_holder(run_dir)
        if current is None:
            continue
        if current.token == holder.token:
            return None   # held for us: `hpcrl run` or `hpcrl submit` took it for the ranks it starts
        reason = why_stale(current, env)
        if reason is None:
            raise RunLockError(f"{run_dir} is in use by {current.describe()}. Wait for it to end, stop it with "
                               f"`hpcrl cancel {run_dir}`, or give another --run-dir")
        try:
            os.replace(lock_path(run_dir), run_dir / f"{LOCK_NAME}.stale-{os.getpid()}")
            os.unlink(run_dir / f"{LOCK_NAME}.stale-{os.getpid()}")
        except FileNotFoundError:
            continue
        note = f"{run_dir}: took over a stale lock of {current.describe()}: {reason}"
    raise RunLockError(f"{run_dir}: could not take the lock ({lock_path(run_dir)} keeps changing)")


def release(run_dir: Path, holder: Holder) -> None:
    """Remove the lock if `holder` still holds it."""
    current = read_holder(run_dir)
    if current is not None and current.token == holder.token:
        try:
            lock_path(run_dir).unlink()
        except FileNotFoundError:
            pass


def _create(path: Path, holder: Holder) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except PermissionError as exc:
        raise RunLockError(f"{path.parent}: the run directory is not writable ({exc.strerror}); fix its "
                           "permissions or give another --run-dir") from None
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(holder), handle)
        handle.flush()
        os.fsync(handle.fileno())


def update(run_dir: Path, holder: Holder) -> None:
    """Rewrite the lock `holder` holds with what is new about it (the Slurm job id once submitted)."""
    current = read_holder(run_dir)
    if current is None or current.token != holder.token:
        raise RunLockError(f"{run_dir}: the lock was taken from this process by {current and current.describe()}")
    tmp = Path(run_dir) / f"{LOCK_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(asdict(holder)))
    os.replace(tmp, lock_path(run_dir))
