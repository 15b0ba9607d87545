"""A small parent process for every rank, so that a rank that dies is named with its exit signal.

A process killed by a signal (the OOM killer, a segfault, `kill -9`) can say nothing, and only its
parent learns how it ended. So `python -m hpcrl.runtime` first becomes this supervisor: it starts
the real rank as its child (same arguments, environment and inherited file descriptors, so the
child is the MPI rank the launcher meant: PMI works through them), passes on every signal the
launcher sends, and when the child ends abnormally writes RUN_DIR/ranks/rank-<N>.exit.json (rank,
host, PID, signal or exit code). The controller's watchdog reads it and names the dead rank with
its role; the supervisor waits a little before it exits too, so the controller can report before
the launcher (mpiexec's clean-up, srun --kill-on-bad-exit) ends the world. The child is killed if
the supervisor dies (PR_SET_PDEATHSIG), so no rank outlives the world.
It imports neither MPI nor torch.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.config.constants import EXIT_HUNG, EXIT_REFUSED, EXIT_REQUEUE, EXIT_STOPPED, RANK_EXITS_DIR
from hpcrl.runtime.startup import SPAWNED_ENV

SUPERVISED_ENV = "HPCRL_SUPERVISED"
EXITS_DIR = RANK_EXITS_DIR
REPORT_GRACE_S = 10.0     # how long a supervisor outlives its dead rank, for the controller to name it
_FORWARDED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGCONT, signal.SIGHUP)
_NORMAL_EXITS = (0, EXIT_HUNG, EXIT_REFUSED, EXIT_STOPPED, EXIT_REQUEUE)   # ends the runtime chose itself


def launcher_rank(env: dict[str, str] | None = None) -> int | None:
    """This process's rank as the launcher numbers it (MPICH/hydra, srun, Open MPI, PMIx)."""
    env = os.environ if env is None else env
    for name in ("PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def exit_record_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / EXITS_DIR / f"rank-{rank}.exit.json"


def read_exit_record(run_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads(exit_record_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return None


def describe_exit(record: dict) -> str:
    if record.get("signal"):
        return f"killed by signal {record['signal_number']} ({record['signal']})"
    return f"exited with code {record['code']}"


def _die_with_parent() -> None:
    """In the child, before it runs: SIGKILL when the supervisor goes (Linux prctl)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_dir(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    return None


def supervise(argv: list[str]) -> int:
    """Run `python -m hpcrl.runtime argv` as a child and return (as this process's exit code) how it ended."""
    env = dict(os.environ, **{SUPERVISED_ENV: "1", SPAWNED_ENV: repr(time.time())})
    child = subprocess.Popen([sys.executable, "-m", "hpcrl.runtime", *argv], env=env, close_fds=False,
                             preexec_fn=_die_with_parent)
    for signum in _FORWARDED:
        signal.signal(signum, lambda sig, _frame: child.send_signal(sig))
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    if code in _NORMAL_EXITS:
        return code
    rank, run_dir = launcher_rank(), _run_dir(argv)
    record = {"rank": rank, "host": socket.gethostname(), "pid": child.pid, "code": code, "time": time.time()}
    if code < 0:
        record.update(signal=signal.Signals(-code).name, signal_number=-code)
    if rank is not None and run_dir is not None:
        path = exit_record_path(run_dir, rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError:
            pass
    print(f"hpcrl: rank {rank} (PID {child.pid} on {record['host']}) {describe_exit(record)}", file=sys.stderr,
          flush=True)
    time.sleep(REPORT_GRACE_S)   # the controller names it and ends the world meanwhile
    return 128 - code if code < 0 else code
