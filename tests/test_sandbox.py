"""The sandbox for model-written code: each hostile program is contained, classified, and leaves
nothing behind; a benign one runs. Real bubblewrap, real kernel limits (no mock)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from hpcrl.rewards.base import RewardTimeout, TimeLimits
from hpcrl.rewards.sandbox import Limits, run_python

LIMITS = Limits(wall_s=4.0, cpu_s=2, memory_mb=512, processes=16, output_bytes=1 << 20)
HOSTILE = {   # name -> (program, the status it must end with, what its output must show)
    "infinite loop": ("while True: pass", "timeout", ""),
    "sleeper": ("import time; time.sleep(60)", "timeout", ""),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "timeout", ""),
    "memory hog": ("x = bytearray(8 << 30)", "memory", "MemoryError"),
    "network": ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)", "error",
                "Network is unreachable"),
    "write outside": ("open('/etc/hpcrl-sandbox-test', 'w').write('x')", "error", "Read-only file system"),
    "100 MB print": ("import sys; sys.stdout.write('x' * (100 << 20))", "output", ""),
    "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('still here')", "ok",
                        "still here"),
}


def _bwrap_children() -> list[int]:
    """The bwrap processes this process started and has not reaped (with or without root)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue
        if status.startswith("Name:\tbwrap\n") and f"\nPPid:\t{os.getpid()}\n" in status:
            found.append(int(entry.name))
    return found


def _sandbox_processes() -> list[str]:
    """Processes of the sandboxes' own user ids (root starts them as 200000 and up)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            if uid >= 200_000:
                found.append(status.splitlines()[0])
    return found


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_is_contained_and_leaves_nothing_behind(name):
    code, status, shows = HOSTILE[name]
    outcome = run_python(code, limits=LIMITS)
    assert outcome.status == status, outcome
    assert shows in outcome.stdout + outcome.stderr, outcome
    assert outcome.wall_s < LIMITS.wall_s + 2
    if name == "100 MB print":
        assert len(outcome.stdout) == LIMITS.output_bytes
    assert not Path("/etc/hpcrl-sandbox-test").exists()
    assert _sandbox_processes() == [], "the program left processes behind"


def test_the_parent_survives_and_the_program_sees_none_of_its_processes():
    outcome = run_python("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))", limits=LIMITS)
    assert outcome.status == "ok" and outcome.stdout.strip() == "[1]", outcome   # alone in its PID namespace
    os.kill(os.getpid(), 0)   # this process is alive


def test_a_benign_program_runs_with_its_files_and_input():
    started = time.monotonic()
    outcome = run_python("import helper\nprint(helper.double(int(input())))", stdin="21\n",
                         files={"helper.py": "def double(x):\n    return 2 * x\n"}, limits=LIMITS)
    assert (outcome.status, outcome.stdout) == ("ok", "42\n"), outcome
    assert time.monotonic() - started < 2


def test_what_a_program_writes_is_held_to_half_its_memory_limit_and_never_to_the_disk():
    """Its files sit in RAM that the address-space limit does not count: each writable place is a
    tmpfs of memory_mb / 2, and bubblewrap's own /dev tmpfs is read-only."""
    limits = Limits(wall_s=10.0, cpu_s=5, memory_mb=128)
    writer = """
import os
for place in (".", "/tmp", "/dev/shm", "/dev"):
    names, error = [f"{place}/f{i}" for i in range(32)], "none"   # 32 files of 8 MB: twice memory_mb
    try:
        for name in names:
            open(name, "wb").write(b"x" * (8 << 20))
    except OSError as raised:
        error = raised.strerror
    written = [name for name in names if os.path.exists(name)]
    print(place, sum(os.path.getsize(name) for name in written) >> 20, error, sep=",")
    for name in written:
        os.remove(name)
"""
    outcome = run_python(writer, limits=limits)
    assert outcome.status == "ok", outcome
    found = {place: (int(mb), error) for place, mb, error in (line.split(",") for line in outcome.stdout.splitlines())}
    for place in (".", "/tmp", "/dev/shm"):
        assert found[place][0] <= limits.memory_mb // 2 and found[place][1] == "No space left on device", found
    assert found["/dev"] == (0, "Read-only file system"), found


def test_with_a_bubblewrap_that_sizes_no_tmpfs_the_program_writes_to_the_runs_own_directory_on_disk(monkeypatch):
    """bubblewrap before 0.7 (RHEL 8 and 9, Ubuntu 22.04) or setuid takes no --size: /tmp and
    /dev/shm are then directories of the run's on the host's disk, each file held to file_bytes,
    and removed with the run; nothing is held in RAM."""
    from hpcrl.rewards import sandbox

    monkeypatch.setattr(sandbox, "_bwrap_sizes_tmpfs", lambda: False)
    limits = Limits(wall_s=10.0, cpu_s=5, memory_mb=256, file_bytes=4 << 20)
    writer = """
import os
for place in ("/tmp", "/dev/shm"):
    open(f"{place}/small", "wb").write(b"x" * (1 << 20))
    try:
        open(f"{place}/large", "wb").write(b"x" * (8 << 20))
    except OSError as raised:
        print(place, os.path.getsize(f"{place}/small") >> 20, os.path.getsize(f"{place}/large") >> 20, raised.strerror)
print(sorted(os.listdir("/tmp")))
"""
    before = set(Path("/tmp").glob("hpcrl-sandbox-*"))
    outcome = run_python(writer, limits=limits)
    assert outcome.status == "ok", outcome
    assert outcome.stdout.splitlines() == ["/tmp 1 4 File too large", "/dev/shm 1 4 File too large",
                                           "['large', 'sandbox', 'small']"], outcome
    assert set(Path("/tmp").glob("hpcrl-sandbox-*")) <= before, "the run's directories are removed with it"

def test_a_callers_time_limit_before_the_wall_time_still_kills_the_program():
    """A domain's reward_timeout_s below the code reward's wall_s interrupts run_python: the
    program goes with it, not on running."""
    with TimeLimits() as limits, pytest.raises(RewardTimeout):
        limits.run(1.0, run_python, "import time; time.sleep(60)", limits=LIMITS)
    assert _bwrap_children() == [] and _sandbox_processes() == []
