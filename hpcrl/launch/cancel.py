"""`hpcrl cancel RUN_DIR`: stop the run that holds a run directory, whether it runs here or in Slurm.

The holder is read from the run directory's lock (hpcrl.launch.lock). A Slurm job is cancelled
with `scancel` (SIGTERM to the batch script and every rank: the ranks save a checkpoint if they
can within Slurm's KillWait, and the job is not requeued); an `hpcrl run` on this machine is asked
through RUN_DIR/control and SIGTERM to its launcher (it saves at the end of the step and stops).
Either way the next `hpcrl run` or `hpcrl submit` of the same directory resumes from the newest
checkpoint.
"""
from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

from hpcrl.checkpoint.signals import write_control
from hpcrl.launch.lock import read_holder, why_stale
from hpcrl.launch.scheduler import run_tool


class CancelError(RuntimeError):
    """Nothing to cancel, or the holder cannot be reached from here."""


def cancel(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> str:
    """Stop the run holding `run_dir`; returns what was done, for the user."""
    run_dir = Path(run_dir)
    holder = read_holder(run_dir)
    if holder is None:
        raise CancelError(f"{run_dir}: no run holds it (no .hpcrl.lock): nothing to cancel")
    stale = why_stale(holder, env)
    if stale is not None:
        raise CancelError(f"{run_dir}: its last holder, {holder.describe()}, has ended ({stale}): nothing to cancel")
    if holder.command != "run" and holder.slurm_job_id:
        # no RUN_DIR/control: scancel's SIGTERM reaches every rank, and the batch script's own trap
        # writes its stop there (a sweep's tasks each read their own directory's, not RUN_ROOT's)
        proc = run_tool(["scancel", holder.slurm_job_id], env)
        if proc is None or proc.returncode != 0:
            detail = "scancel not found" if proc is None else (proc.stderr or proc.stdout).strip()
            raise CancelError(f"scancel {holder.slurm_job_id} failed: {detail}")
        return (f"cancelled Slurm job {holder.slurm_job_id}: its ranks save a checkpoint if they can within Slurm's "
                f"KillWait and stop; it is not requeued. `hpcrl submit` of {run_dir} again resumes it")
    if holder.host != socket.gethostname():
        raise CancelError(f"{run_dir} is held by {holder.describe()}: run `hpcrl cancel {run_dir}` on {holder.host}")
    write_control(run_dir, "stop", "hpcrl cancel")
    os.kill(holder.pid, signal.SIGTERM)
    return (f"asked `hpcrl run` (PID {holder.pid}) to stop: it saves a checkpoint at the end of the current step "
            "and ends; the same `hpcrl run` resumes it")
