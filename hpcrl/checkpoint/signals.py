"""Preemption notices (SIGUSR1 from `sbatch --signal`, SIGTERM at the time limit or on scancel) and requeue.

The handler only sets a flag: the run checkpoints at the next step boundary, where every rank
is in a consistent state, then exits with EXIT_REQUEUE. Work never happens inside a handler.
Workers install it too: SIGUSR1's default action is to terminate the process. Ranks may see
the signal at different moments, so the runtime must agree on the decision (e.g. the controller
decides and tells the workers, or an allreduce of `requested`).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from types import FrameType
from typing import Callable, Union

from hpcrl.config.constants import EXIT_REQUEUE

log = logging.getLogger(__name__)

PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGTERM)
_Handler = Union[Callable[[int, "FrameType | None"], object], int, None]


class PreemptionSignal:
    """A flag set by the first of `signals`; later ones are counted and otherwise ignored."""

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS):
        self.signals = tuple(signals)
        self._first: int | None = None
        self._count = 0
        self._previous: dict[int, _Handler] = {}

    def install(self) -> "PreemptionSignal":
        """Idempotent. Must run in the main thread (a Python rule for signal handlers)."""
        if self._previous:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionSignal.install() must be called from the main thread")
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before install()."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._first is None:
            self._first = signum
        self._count += 1

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def requested(self) -> bool:
        return self._first is not None

    @property
    def signal_name(self) -> str | None:
        """The first signal that arrived ('SIGUSR1', 'SIGTERM'), or None."""
        return signal.Signals(self._first).name if self._first is not None else None

    @property
    def count(self) -> int:
        return self._count

    def __enter__(self) -> "PreemptionSignal":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def requeue_slurm_job(timeout: float = 30.0) -> bool:
    """`scontrol requeue $SLURM_JOB_ID`; True on success, False outside Slurm or on failure (logged).

    Call it after the checkpoint is committed: Slurm then ends the running job (SIGTERM, then
    SIGKILL after KillWait), and the job needs `#SBATCH --requeue` (or JobRequeue=1) to be accepted.
    """
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.warning("cannot requeue Slurm job %s: scontrol is not on PATH; resubmit the job by hand", job_id)
        return False
    try:
        result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("scontrol requeue %s did not answer within %g s; check `squeue -j %s`", job_id, timeout, job_id)
        return False
    if result.returncode != 0:
        log.warning("scontrol requeue %s failed (exit %d): %s. Is the job submitted with --requeue?",
                    job_id, result.returncode, (result.stderr or result.stdout).strip())
        return False
    return True


__all__ = ["EXIT_REQUEUE", "PREEMPTION_SIGNALS", "PreemptionSignal", "requeue_slurm_job"]
