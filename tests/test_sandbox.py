"""The sandbox for model-written code: each hostile program is contained, classified, and leaves
nothing behind; a benign one runs. Real bubblewrap, real kernel limits (no mock)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

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
