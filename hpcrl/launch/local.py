"""`hpcrl run`: the same job, on this machine, with `mpiexec` and the local profile."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from hpcrl.checkpoint.signals import PREEMPTION_SIGNALS, REQUEUE_SIGNALS, clear_control, write_control
from hpcrl.config import ClusterProfile, JobConfig
from hpcrl.config.constants import AUTOMATIC_RESTART_ENV, EXIT_REFUSED, EXIT_REQUEUE, EXIT_STOPPED, RANK_EXITS_DIR
from hpcrl.launch.lock import TOKEN_ENV, Holder, acquire, release, slurm_job_key
from hpcrl.launch.shm import remove_stale
from hpcrl.placement import Plan
from hpcrl.runtime.startup import LAUNCHED_ENV


def mpiexec_path() -> str:
    """The mpiexec that belongs to the MPI mpi4py was installed with (the `mpich` wheel's, in the venv)."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec found: `pip install mpich` (or load your site's MPI module)")
    return found


def prepare_run_dir(job: JobConfig, plan: Plan, run_dir: Path) -> Path:
    """Write the resolved job (what the ranks load) and the compiled plan into the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "job.yaml"
    # Only what the user set: defaults that depend on other fields (a colocated role inherits its
    # partner's parallel sizes) must stay unset for the ranks to resolve them the same way.
    data = job.model_dump(mode="json", exclude_unset=True)
    data.pop("sweep", None)
    resolved.write_text(yaml.safe_dump(data, sort_keys=False))
    (run_dir / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    return resolved


def runtime_command(python: str, resolved_job: Path, profile_path: str | None, run_dir: Path,
                    resume: ResumeOptions | None = None) -> list[str]:
    """The command every rank runs; the launcher (mpiexec or srun) goes in front of it."""
    command = [python, "-m", "hpcrl.runtime", "--job", str(resolved_job), "--run-dir", str(run_dir)]
    if profile_path:
        command += ["--cluster", str(profile_path)]
    return command + (resume.arguments() if resume is not None else [])


@dataclass(frozen=True)
class ResumeOptions:
    """How a run may start over its run directory: `restart` from step 0 when no checkpoint can be
    resumed; `allowed_changes`, job fields that may differ from the checkpoint's."""

    restart: bool = False
    allowed_changes: tuple[str, ...] = ()

    def arguments(self) -> list[str]:
        return (["--restart"] if self.restart else []) + [
            word for key in self.allowed_changes for word in ("--allow-config-change", key)]


def _run_forwarding_signals(command: list[str], env: dict[str, str], run_dir: Path) -> int:
    """Run the MPI world. USR1/USR2 sent to us ask the run to checkpoint and end for a requeue, TERM
    and INT to checkpoint and stop (hpcrl.checkpoint.signals): the request goes into RUN_DIR/control,
    which the controller reads at every step boundary. TERM is also passed to mpiexec, which hands
    it to every rank. (mpiexec dies of USR2, and hands INT on itself: a terminal's Ctrl-C reaches it
    too, and a second INT from here would make it kill the ranks at once.)"""
    process = subprocess.Popen(command, env=env)

    def on_signal(signum: int, _frame) -> None:
        write_control(run_dir, "requeue" if signum in REQUEUE_SIGNALS else "stop",
                      f"{signal.Signals(signum).name} to hpcrl run")
        if signum == signal.SIGTERM:
            process.send_signal(signum)

    previous = {s: signal.signal(s, on_signal) for s in PREEMPTION_SIGNALS}
    try:
        return process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_local(job: JobConfig, profile: ClusterProfile, profile_path: str | None, plan: Plan, run_dir: Path,
              resume: ResumeOptions = ResumeOptions()) -> int:
    """Start the MPI world here and wait for it, holding the run directory's lock; restart after a
    failure up to `max_restarts` times (each restart resumes from the newest valid checkpoint).
    Returns the world's exit code."""
    holder = Holder.here("run", slurm_job_id=slurm_job_key())
    note = acquire(run_dir, holder)
    if note:
        print(f"hpcrl: {note}", file=sys.stderr, flush=True)
    try:
        resolved = prepare_run_dir(job, plan, run_dir)
        clear_control(run_dir)
        command = [mpiexec_path(), "-n", str(plan.world_size)]
        command += runtime_command(sys.executable, resolved, profile_path, run_dir, resume)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env[TOKEN_ENV] = holder.token
        env[LAUNCHED_ENV] = repr(time.time())   # the origin of RUN_DIR/startup.json
        for attempt in range(profile.max_restarts + 1):
            shutil.rmtree(run_dir / RANK_EXITS_DIR, ignore_errors=True)   # exit records of an earlier world
            code = _run_forwarding_signals(command, env, run_dir)
            remove_stale()
            if code in (0, EXIT_REQUEUE, EXIT_STOPPED, EXIT_REFUSED) or attempt == profile.max_restarts:
                return code
            print(f"hpcrl: the run failed (exit code {code}); restart {attempt + 1} of {profile.max_restarts} "
                  "from the newest checkpoint", file=sys.stderr, flush=True)
            env[AUTOMATIC_RESTART_ENV] = "1"
        return code
    finally:
        release(run_dir, holder)
