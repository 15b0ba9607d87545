"""A job's `sweep:` block as the combinations one Slurm job array runs, one per task.

    sweep:
      train.lr: [1.0e-3, 3.0e-3]
      seed: [1, 2, 3]

gives 6 tasks, the cartesian product in a stable order: the keys in the order written, the values
in list order, the last key varying fastest (task 0: lr 1e-3 seed 1, task 1: lr 1e-3 seed 2, ...).
Every combination is validated (and, by the caller, planned) before anything is submitted.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.config import ConfigError, JobConfig, validate
from hpcrl.config.overrides import apply_overrides
from hpcrl.config.yaml_source import load_yaml_with_lines

MAX_TASKS = 1000          # Slurm's default MaxArraySize is 1001 (indices 0-1000)
INDEX_FILE = "sweep.json"
FORBIDDEN_KEYS = ("name", "sweep")


@dataclass(frozen=True)
class SweepTask:
    index: int
    overrides: dict[str, Any]   # key path -> value of this combination
    job: JobConfig

    @property
    def dirname(self) -> str:
        return f"sweep-{self.index}"

    def describe(self) -> str:
        return describe_overrides(self.overrides)


def describe_overrides(overrides: dict[str, Any]) -> str:
    """`train.lr=0.001 seed=2`: the values as JSON (what --set would take)."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())


def load_job_and_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[JobConfig, list[SweepTask]]:
    """The job (with its overrides) and, when it has a `sweep:` block, every combination as a validated job."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["no such file"])
    data, lines = load_yaml_with_lines(path)
    if overrides:
        data = apply_overrides(data, list(overrides))
    job = validate(JobConfig, data, str(path), lines)
    if job.sweep is None:
        return job, []
    sweep = job.sweep
    problems = []
    if not sweep:
        problems.append("sweep: is empty; give key paths with lists of values, e.g. seed: [1, 2, 3]")
    for key, values in sweep.items():
        if key.split(".")[0] in FORBIDDEN_KEYS:
            problems.append(f"sweep.{key}: cannot be swept (every task shares the job's name and run directory)")
        if not values:
            problems.append(f"sweep.{key}: the list of values is empty")
    count = 1
    for values in sweep.values():
        count *= max(1, len(values))
    if count > MAX_TASKS:
        problems.append(f"sweep: {count} combinations; at most {MAX_TASKS} fit in one job array")
    if problems:
        raise ConfigError(str(path), problems)
    base = {k: v for k, v in data.items() if k != "sweep"}
    keys = list(sweep)
    tasks = []
    for index, combo in enumerate(itertools.product(*(sweep[k] for k in keys))):
        chosen = dict(zip(keys, combo))
        source = f"{path} (sweep task {index}: {describe_overrides(chosen)})"
        tasks.append(SweepTask(index, chosen, validate(JobConfig, apply_overrides(base, chosen), source, lines)))
    return job, tasks


def write_index(run_root: Path, tasks: list[SweepTask]) -> Path:
    """RUN_ROOT/sweep.json: which directory runs which combination."""
    index = {"keys": list(tasks[0].overrides) if tasks else [],
             "tasks": [{"index": t.index, "run_dir": t.dirname, "overrides": t.overrides} for t in tasks]}
    path = run_root / INDEX_FILE
    path.write_text(json.dumps(index, indent=1) + "\n")
    return path


def read_index(run_root: Path) -> list[dict[str, Any]]:
    path = Path(run_root) / INDEX_FILE
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("tasks", [])
