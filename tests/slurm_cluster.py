"""A real local Slurm cluster for the tests: start it, use it, stop it.

The cluster (munged + slurmctld + slurmd on this machine, one node with 8 CPUs, partition
``debug``) is run by ``scripts/slurm-local``; this module only drives that script and offers a
few helpers to submit jobs and wait for them.

Use the session fixture in a test module or a conftest.py::

    from slurm_cluster import slurm_env   # noqa: F401  (registers the fixture)

    def test_something(slurm_env, tmp_path):
        env = {**os.environ, **slurm_env}          # slurm_env = {"SLURM_CONF": ..., ...}
        subprocess.run(["sbatch", "--parsable", "--wrap", "true"], env=env, check=True)

Without Slurm installed the fixture skips with "slurm-wlm not installed: run
scripts/install-system-deps". Each pytest session gets its own cluster under
/tmp/hpcrl-slurm-pytest-*, stopped (and removed) at the end of the session. To reuse one
long-running cluster instead (faster when iterating), set ``HPCRL_SLURM_DIR``: the fixture starts
it there if needed and leaves it running if it was already up.

Not available locally: ``sacct`` (no slurmdbd; Slurm 22.05 has no file accounting storage).
Use ``scontrol show job`` (see :func:`job_info`) or the job-completion log
``<state dir>/log/jobcomp.txt``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM_LOCAL = REPO / "scripts" / "slurm-local"
SKIP_REASON = "slurm-wlm not installed: run scripts/install-system-deps"
SESSION_PREFIX = "hpcrl-slurm-pytest-"

# Job states after which a job does not run again (a requeued job passes through PENDING).
TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
     "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
)

_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun")


def missing_reason() -> str | None:
    """Why a local cluster cannot run here, or None if it can."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    if any(shutil.which(b, path=path) is None for b in _BINARIES):
        return SKIP_REASON
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd starts job steps as the job's user)"
    return None


def _run_script(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(SLURM_LOCAL), *args],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"scripts/slurm-local {' '.join(args)} failed (exit {proc.returncode}):\n"
            f"{proc.stdout}{proc.stderr}"
        )
    return proc


def _env_from_script(state_dir: str) -> dict[str, str]:
    out = _run_script("env", state_dir).stdout
    env = {}
    for line in out.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if m:
            # values are printed with bash's %q; our paths need no unquoting beyond this
            env[m.group(1)] = m.group(2).strip("'\"")
    if "SLURM_CONF" not in env:
        raise RuntimeError(f"scripts/slurm-local env printed no SLURM_CONF:\n{out}")
    return env


def _is_up(state_dir: str) -> bool:
    return _run_script("status", state_dir, check=False).returncode == 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_sessions() -> None:
    """Stop clusters left by pytest sessions that died without their teardown."""
    for d in Path(tempfile.gettempdir()).glob(SESSION_PREFIX + "*"):
        owner = d / "owner.pid"
        try:
            pid = int(owner.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            _run_script("down", str(d), check=False)
            shutil.rmtree(d, ignore_errors=True)


def ensure_slurm(state_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Start the local cluster (if it is not up) and return the variables clients need.

    Returns e.g. ``{"SLURM_CONF": "/tmp/hpcrl-slurm-pytest-x/slurm.conf",
    "HPCRL_SLURM_DIR": "/tmp/hpcrl-slurm-pytest-x"}``; merge it into the environment of
    every sbatch/squeue/srun/scontrol call. ``state_dir`` defaults to a new per-call
    directory (short, under /tmp: the munge socket path must stay short).
    """
    reason = missing_reason()
    if reason:
        raise RuntimeError(reason)
    if state_dir is None:
        reap_stale_sessions()
        state_dir = tempfile.mkdtemp(prefix=SESSION_PREFIX, dir=tempfile.gettempdir())
        (Path(state_dir) / "owner.pid").write_text(f"{os.getpid()}\n")
    state_dir = str(state_dir)
    _run_script("up", state_dir)
    return _env_from_script(state_dir)


def stop_slurm(state_dir: str | os.PathLike, remove: bool = False) -> None:
    """Stop the cluster in ``state_dir`` (no processes are left); optionally delete the dir."""
    _run_script("down", str(state_dir), check=False)
    if remove:
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_env() -> Iterator[dict[str, str]]:
    """A running local Slurm cluster for the session: ``{"SLURM_CONF": ..., "HPCRL_SLURM_DIR": ...}``."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    shared = os.environ.get("HPCRL_SLURM_DIR")
    if shared:
        was_up = _is_up(shared)
        state_dir = shared
    else:
        was_up = False
        state_dir = None
    try:
        env = ensure_slurm(state_dir)
    except RuntimeError as e:
        pytest.fail(f"could not start the local Slurm cluster:\n{e}", pytrace=False)
    try:
        yield env
    finally:
        if not was_up:
            stop_slurm(env["HPCRL_SLURM_DIR"], remove=not shared)


# ---------------------------------------------------------------------------------------------
# helpers for tests that submit jobs


def slurm_environ(slurm_env: dict[str, str], **extra: str) -> dict[str, str]:
    """os.environ + the cluster's variables + extra, without SLURM_* job variables of a caller
    that itself runs inside a Slurm job (they would confuse sbatch/srun)."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("SLURM_") or k.startswith("SBATCH_") or k.startswith("SRUN_"))}
    env.update(slurm_env)
    env.update(extra)
    return env


def slurm_cmd(args: list[str], slurm_env: dict[str, str], timeout: float = 30, **kw) -> str:
    """Run a Slurm client command against the cluster; return stdout; raise with stderr on failure."""
    proc = subprocess.run(args, env=slurm_environ(slurm_env), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def sbatch(args: list[str], slurm_env: dict[str, str], cwd: str | os.PathLike | None = None) -> str:
    """``sbatch --parsable ARGS``; returns the job id."""
    out = slurm_cmd(["sbatch", "--parsable", *args], slurm_env, cwd=cwd)
    return out.strip().split(";")[0]


_KV = re.compile(r"(\w[\w:/]*)=(\S*)")


def job_info(job_id: str, slurm_env: dict[str, str]) -> list[dict[str, str]]:
    """``scontrol show job -o JOB`` parsed: one dict per job (one per task for an array)."""
    out = slurm_cmd(["scontrol", "show", "job", "-o", str(job_id)], slurm_env)
    return [dict(_KV.findall(line)) for line in out.splitlines() if line.strip()]


def wait_job(job_id: str, slurm_env: dict[str, str], timeout: float = 30,
             poll: float = 0.2) -> list[dict[str, str]]:
    """Wait until the job (every task of an array) reached a terminal state; return job_info.

    On timeout raise with the job's record and the tail of the controller log.
    """
    deadline = time.monotonic() + timeout
    info: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        info = job_info(job_id, slurm_env)
        # a pending array shows one record for its not-yet-started tasks: wait for those too
        if info and all(j.get("JobState") in TERMINAL_STATES for j in info) and not any(
            "[" in j.get("ArrayTaskId", "") for j in info
        ):
            return info
        time.sleep(poll)
    log = Path(slurm_env["HPCRL_SLURM_DIR"], "log", "slurmctld.log")
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:]) if log.exists() else ""
    states = [(j.get("JobId"), j.get("ArrayTaskId"), j.get("JobState"), j.get("Reason")) for j in info]
    raise TimeoutError(f"job {job_id} not finished after {timeout}s: {states}\nslurmctld.log:\n{tail}")


def job_output_lines(text: str) -> list[str]:
    """A batch job's output lines without slurmstepd's notices. slurmstepd writes those into the
    same file at its own offset, so one may land inside a line of the job's own output (seen:
    "requeued=Trueslurmstepd-vm: error: *** JOB ... REQUEUE ***")."""
    return [line for line in re.sub(r"slurmstepd[^\n]*", "", text).splitlines() if line.strip()]
