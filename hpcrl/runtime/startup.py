"""Where a rank's start-up goes: when it passed each phase, gathered by the controller at the
start-up barrier and written to RUN_DIR/startup.json (`bench/startup.py` prints it).

Times are wall-clock seconds since `hpcrl run` started mpiexec (HPCRL_LAUNCHED), or since the
earliest mark of any rank when the world was started otherwise (srun in a batch script).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

LAUNCHED_ENV = "HPCRL_LAUNCHED"        # set by `hpcrl run`: when it started mpiexec
SPAWNED_ENV = "HPCRL_RANK_SPAWNED"     # set by the supervisor: when mpiexec/srun started this rank
STARTUP_FILE = "startup.json"

MARKS: list[tuple[str, float]] = []    # this rank's (phase, time it ended)


def mark(phase: str) -> None:
    """This rank has just finished `phase`."""
    MARKS.append((phase, time.time()))


def spawned() -> None:
    """The first marks of a rank: started by mpiexec/srun (its supervisor), then its own interpreter."""
    if SPAWNED_ENV in os.environ:
        MARKS.append(("spawned (supervisor)", float(os.environ[SPAWNED_ENV])))


def write(run_dir: Path, per_rank: list[list[tuple[str, float]]], roles: list[str]) -> dict:
    """The ranks' marks as seconds since the launch, with each phase's own duration; written to
    RUN_DIR/startup.json and returned."""
    origin = float(os.environ.get(LAUNCHED_ENV, min(t for marks in per_rank for _, t in marks)))
    table = {}
    for rank, (marks, role) in enumerate(zip(per_rank, roles)):
        previous = origin
        rows = []
        for phase, at in marks:
            rows.append({"phase": phase, "at_s": round(at - origin, 3), "took_s": round(at - previous, 3)})
            previous = at
        table[str(rank)] = {"roles": role, "phases": rows}
    (Path(run_dir) / STARTUP_FILE).write_text(json.dumps(table, indent=1))
    return table
