"""Model-written code runs here only: a bubblewrap sandbox with no network, a read-only system and limits.

Each run gets its own directory, /tmp/sandbox, holding its files (read-only), new namespaces
(network, PID, IPC, UTS: no interface but a down loopback, its own process tree that dies with it),
and kernel limits on CPU time, address space, open files, file size and processes. It can write
only to /tmp (its directory included) and /dev/shm, each a tmpfs of half of memory_mb: its files
sit in RAM, which the address-space limit does not count, so its address space and files together
stay under 2 x memory_mb, and nothing reaches the host's disk (the inodes of empty files, bounded
by the wall time, are not counted: bubblewrap sets a tmpfs's size only). A bubblewrap older than
0.7 sizes no tmpfs: there they are directories of the run's on the host's disk instead.
Started by root (a CI runner, a container), the program runs as an unprivileged user id of its
own, so that the process limit holds (the kernel does not count root's) and it cannot signal any
process of the job. Wall time and output size are enforced from outside: past either, or when the
caller's own time limit interrupts the run, the sandbox is killed, with everything it started (its
PID namespace ends with it).

The caller's process never executes the code: `run_python` starts `bwrap`, which starts the
interpreter. Without bubblewrap (`apt-get install bubblewrap`) it refuses to run anything.
"""
from __future__ import annotations

import functools
import itertools
import os
import resource
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

INSIDE = "/tmp/sandbox"   # on the sandbox's own empty /tmp: the rest of the system is read-only
_UIDS = itertools.count()


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces on this machine."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024          # address space: an interpreter with numpy maps about 300 MB
    processes: int = 32
    output_bytes: int = 1 << 20    # stdout and stderr each
    file_bytes: int = 16 << 20     # any one file it writes
    open_files: int = 64


@dataclass(frozen=True)
class Outcome:
    """How a run ended. `status`: ok (exit 0), error (another exit code), timeout (wall or CPU time),
    memory (MemoryError or killed by the address-space limit), output (past output_bytes)."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def bwrap_path() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed: model-written code runs only in its sandbox; "
                                 "install it with `apt-get install bubblewrap` (scripts/install-system-deps does)")
    return found


def python_interpreter() -> str:
    """The system's Python 3 (its standard library is what model-written programs may use; a job's
    virtual environment may sit in a home directory the sandbox's user cannot read)."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def _sandbox_uid() -> int | None:
    """An unprivileged user id of this run's own when started by root (None otherwise)."""
    if os.geteuid() != 0:
        return None
    return 200_000 + (os.getpid() * 1009 + next(_UIDS)) % 100_000


def _limit(uid: int | None, limits: Limits):
    """The child's set-up before exec: resource limits, then (from root) the sandbox's own user."""
    def setup() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes,) * 2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # the kernel counts every process of the user: the sandbox's own uid starts at 0; without
        # root the user's processes already running count too
        running = 0 if uid is not None else _processes_of(os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (running + limits.processes,) * 2)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
    return setup


def _processes_of(uid: int) -> int:
    return sum(owner == uid for _, (owner, _) in _processes())


def _command(workdir: Path, limits: Limits, program: list[str]) -> list[str]:
    """bwrap's arguments: the system read-only, the program's files (`workdir`/files) read-only in its
    directory on a writable /tmp, and /dev read-only but for its devices and a writable /dev/shm
    (bubblewrap's /dev is an unsized tmpfs)."""
    binds = [arg for path in sorted((workdir / "files").iterdir())
             for arg in ("--ro-bind", str(path), f"{INSIDE}/{path.name}")]
    tmp, shm = _scratch(workdir, limits)
    return [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1",
            "--ro-bind", "/", "/", *tmp, "/tmp", "--dir", INSIDE, *binds,
            "--proc", "/proc", "--dev", "/dev", *shm, "/dev/shm", "--remount-ro", "/dev",
            "--chdir", INSIDE, "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", INSIDE,
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "OMP_NUM_THREADS", "1", *program]


def _scratch(workdir: Path, limits: Limits) -> tuple[list[str], list[str]]:
    """How /tmp and /dev/shm are mounted (their mount point follows): a tmpfs of half of memory_mb
    each where bubblewrap sizes a tmpfs (0.7 and later, not setuid); elsewhere (RHEL 8 and 9, Ubuntu
    22.04) an unsized tmpfs would hold in RAM whatever the program writes, so they are `workdir`'s
    own directories on the host's disk, where RLIMIT_FSIZE bounds each file and the wall time the rest."""
    if _bwrap_sizes_tmpfs():
        size = ["--size", str(limits.memory_mb << 19)]   # half of memory_mb, in bytes
        return [*size, "--tmpfs"], [*size, "--tmpfs"]
    return ["--bind", str(workdir / "tmp")], ["--bind", str(workdir / "shm")]


@functools.cache
def _bwrap_sizes_tmpfs() -> bool:
    """bubblewrap takes --size from 0.7 on, and never when installed setuid."""
    path = bwrap_path()
    if os.stat(path).st_mode & stat.S_ISUID:
        return False
    usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30)
    return "--size" in usage.stdout + usage.stderr


def run_python(code: str, stdin: str = "", limits: Limits = Limits(), files: dict[str, str] | None = None) -> Outcome:
    """Run `code` as main.py in the sandbox's directory (with `files` beside it) under `limits`; never
    raises for what the code does (SandboxUnavailable when bubblewrap cannot start at all)."""
    workdir = Path(tempfile.mkdtemp(prefix="hpcrl-sandbox-"))
    uid = _sandbox_uid()
    try:
        for scratch in ("files", "tmp", "shm"):
            (workdir / scratch).mkdir()
        for name, text in {"main.py": code, **(files or {})}.items():
            (workdir / "files" / name).write_text(text)
        if uid is not None:
            for path in [workdir, *workdir.iterdir(), *(workdir / "files").iterdir()]:
                os.chown(path, uid, uid)
        program = [python_interpreter(), "-E", "-s", "main.py"]   # its directory on sys.path, no user site
        return _supervise(_command(workdir, limits, program), stdin, limits, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(command: list[str], stdin: str, limits: Limits, uid: int | None) -> Outcome:
    started = time.monotonic()
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=_limit(uid, limits), start_new_session=True)
    output = {"stdout": bytearray(), "stderr": bytearray()}
    try:
        _write(process, stdin)
        ended = _read(process, output, limits, started)
    except BaseException:   # the caller's own time limit (base.RewardTimeout), ^C: the program must not outlive it
        _kill(process, uid)
        process.wait()
        raise
    if ended != "exited":
        _kill(process, uid)
    returncode = process.wait()
    wall = time.monotonic() - started
    stdout, stderr = (output[k].decode(errors="replace") for k in ("stdout", "stderr"))
    if returncode == 1 and stderr.startswith("bwrap:"):   # bubblewrap's own failure: nothing ran
        raise SandboxUnavailable(f"the sandbox could not start: {stderr.strip()} (bubblewrap needs user "
                                 "namespaces, sysctl user.max_user_namespaces > 0, and an interpreter every user "
                                 "can run)")
    return Outcome(_status(ended, returncode, stderr), returncode, stdout, stderr, wall)


def _write(process: subprocess.Popen, stdin: str) -> None:
    try:
        process.stdin.write(stdin.encode())
        process.stdin.close()
    except BrokenPipeError:
        pass


def _read(process: subprocess.Popen, output: dict[str, bytearray], limits: Limits, started: float) -> str:
    """Collect stdout and stderr until the program ends ("exited"), or "timeout" / "output"."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    open_streams = 2
    while open_streams:
        left = limits.wall_s - (time.monotonic() - started)
        if left <= 0:
            return "timeout"
        for key, _ in selector.select(timeout=left):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            output[key.data] += chunk
            if len(output[key.data]) > limits.output_bytes:
                del output[key.data][limits.output_bytes:]
                return "output"
    try:
        process.wait(timeout=max(0.0, limits.wall_s - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:   # closed its output but runs on
        return "timeout"
    return "exited"


def _kill(process: subprocess.Popen, uid: int | None) -> None:
    """Everything the program started. With a user id of its own, every process of that user but
    bwrap, until none is left (bwrap then sees its child end, reaps it and exits: killing bwrap first
    would orphan the program); otherwise bwrap's session, whose namespace dies with it."""
    if uid is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    def remaining() -> list[int]:
        return [pid for pid, (owner, state) in _processes() if owner == uid and state != "Z" and pid != process.pid]

    while pids := remaining():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _processes() -> list[tuple[int, tuple[int, str]]]:
    """(pid, (real user, state letter)) of every process."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
                found.append((int(entry.name), (int(fields["Uid"].split()[0]), fields["State"].split()[0])))
            except (OSError, KeyError, ValueError):
                pass
    return found


def _status(ended: str, returncode: int, stderr: str) -> str:
    if ended != "exited":
        return ended
    if returncode == 0:
        return "ok"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return "memory"
    # RLIMIT_CPU: SIGXCPU, then SIGKILL at the hard limit (bwrap reports a signal as 128 + its number)
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "timeout"
    return "error"
