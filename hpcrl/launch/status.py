"""`hpcrl status [RUN_DIR ...]`: each run's Slurm job, its state, progress, last reward and restarts.

The Slurm columns come from scontrol / sacct (see scheduler.py); progress from RUN_DIR/metrics.jsonl.
Without Slurm (or for a job Slurm forgot) the state comes from the batch script's job_events.jsonl,
marked with `*`; a run started with `hpcrl run` has no job and shows `local`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

from hpcrl.launch.scheduler import JobRecord, query_jobs, record_from_events, slurm_state_note
from hpcrl.launch.slurm import JOBS_FILE
from hpcrl.launch.sweep import read_index


@dataclass(frozen=True)
class TaskStatus:
    run_dir: str
    job_id: str | None
    state: str
    source: str               # scontrol | sacct | files | local | none
    step: int | None
    total: int | None
    reward_mean: float | None
    restarts: int | None
    reason: str | None = None
    problem: str | None = None   # what in the run's files could not be read

    @property
    def progress(self) -> str:
        if self.step is None and self.total is None:
            return "-"
        return f"{self.step if self.step is not None else 0}/{self.total if self.total is not None else '?'}"


def _progress(run_dir: Path) -> tuple[int | None, int | None, float | None, str | None]:
    """(last step, total steps, last reward_mean, problem) from the run's metrics and job.yaml; the
    problem says what in them could not be read."""
    from hpcrl.config import load_job
    from hpcrl.metrics import METRICS_FILE, read_metrics

    total = None
    if (run_dir / "job.yaml").is_file():
        try:
            total = load_job(run_dir / "job.yaml").train.steps
        except ValueError:
            total = None
    step = reward = problem = None
    metrics = run_dir / METRICS_FILE
    if metrics.is_file():
        try:
            records = [r for r in read_metrics(metrics) if isinstance(r.get("step"), int)]
        except (OSError, ValueError) as exc:
            records, problem = [], str(exc)
        if records:
            last = max(records, key=lambda r: r["step"])
            step = last["step"]
            value = last.get("reward_mean")
            reward = float(value) if isinstance(value, (int, float)) else None
    return step, total, reward, problem


def _last_job(run_root: Path) -> dict | None:
    path = run_root / JOBS_FILE
    try:
        records = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, json.JSONDecodeError):
        return None
    return records[-1] if records else None


def run_status(run_root: str | Path, env: Mapping[str, str] | None = None) -> list[TaskStatus]:
    """One row per job or array task of the run's newest submission (one row for a run without a job)."""
    run_root = Path(run_root)
    job = _last_job(run_root)
    if job is None:
        step, total, reward, problem = _progress(run_root)
        state = "finished" if step is not None and total is not None and step >= total else "-"
        return [TaskStatus(str(run_root), None, state, "local", step, total, reward, None, problem=problem)]
    job_id, kind, tasks = str(job["job_id"]), job.get("kind", "single"), int(job.get("tasks", 1))
    if kind == "single":
        targets = [(job_id, run_root)]
    elif kind == "sweep":
        index = {t["index"]: t["run_dir"] for t in read_index(run_root)}
        targets = [(f"{job_id}_{i}", run_root / index.get(i, f"sweep-{i}")) for i in range(tasks)]
    else:  # chain: every link runs in the same directory
        targets = [(f"{job_id}_{i}", run_root) for i in range(tasks)]
    records = query_jobs(job_id, env)
    rows = []
    for task_id, run_dir in targets:
        record: JobRecord | None = records.get(task_id) or record_from_events(run_dir, task_id)
        step, total, reward, problem = _progress(run_dir)
        if record is None:
            rows.append(TaskStatus(str(run_dir), task_id, "UNKNOWN", "none", step, total, reward, None,
                                   problem=problem))
            continue
        reason = record.reason if record.reason not in (None, "None") else None
        rows.append(TaskStatus(str(run_dir), task_id, record.state, record.source, step, total, reward,
                               record.restarts, reason, problem))
    return rows


def find_runs(root: Path = Path("runs")) -> list[Path]:
    """Run directories under `root`: those with a Slurm submission, metrics or a resolved job."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and any(
        (d / name).exists() for name in (JOBS_FILE, "metrics.jsonl", "job.yaml")))


def _fmt_reward(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_status(rows: list[TaskStatus], note: str | None = None) -> str:
    header = ("RUN", "JOB", "STATE", "STEP", "REWARD", "RESTARTS")
    table = [header]
    marked = False
    for row in rows:
        state = row.state + ("*" if row.source == "files" else "")
        marked |= row.source == "files"
        if row.reason and row.state == "PENDING":
            state += f" ({row.reason})"
        table.append((_short(row.run_dir), row.job_id or "-", state, row.progress, _fmt_reward(row.reward_mean),
                      "-" if row.restarts is None else str(row.restarts)))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    if marked:
        lines.append("* from the run's job_events.jsonl: Slurm has no record of the job "
                     f"({note or 'it ended more than MinJobAge ago and sacct is unavailable'})")
    lines += [f"warning: {problem}" for problem in dict.fromkeys(r.problem for r in rows if r.problem)]
    return "\n".join(lines)


def _short(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


def status_main(run_dirs: list[str], as_json: bool = False, env: Mapping[str, str] | None = None) -> int:
    """The `hpcrl status` command; returns its exit code."""
    if run_dirs:
        roots = [Path(d) for d in run_dirs]
        missing = [str(d) for d in roots if not d.is_dir()]
        if missing:
            print(f"hpcrl: error: no such run directory: {', '.join(missing)}")
            return 2
    else:
        roots = find_runs()
        if not roots:
            print("hpcrl: no runs under runs/ (start one with `hpcrl run` or `hpcrl submit`)")
            return 0
    rows = [row for root in roots for row in run_status(root, env)]
    if as_json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
        return 0
    note = slurm_state_note(env)
    print(format_status(rows, note))
    if note and any(r.job_id for r in rows):
        print(f"(no Slurm columns from the scheduler: {note})")
    return 0
