"""What Slurm knows about a job: `scontrol show job` first, then `sacct`, then the run's own files.

`scontrol` answers for pending and running jobs and for jobs that ended less than MinJobAge (300 s
by default) ago, with the restart count; `sacct` answers for older ones where accounting runs
(not on the local test cluster: no slurmdbd). When neither knows the job, the batch script's
RUN_DIR/job_events.jsonl still tells how it ended.

Job ids are the ones users type: `12` for a plain job, `12_3` for task 3 of array job 12.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from submitit.slurm.slurm import SlurmInfoWatcher, read_job_id

EVENTS_FILE = "job_events.jsonl"
# After these a job does not run again (a requeued job passes through PENDING, REQUEUED, ...).
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                             "BOOT_FAIL", "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
                             "STOPPED", "REFUSED"})   # the last two: hpcrl's own, from the batch script's events
_KV = re.compile(r"(\w[\w:/]*)=(\S*)")


@dataclass(frozen=True)
class JobRecord:
    """One job (or array task) as the scheduler or the run's files describe it."""

    job_id: str
    state: str
    source: str                      # scontrol | sacct | files
    restarts: int | None = None
    reason: str | None = None
    start: str | None = None
    end: str | None = None
    exit_code: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL_STATES


def _environ(env: Mapping[str, str] | None) -> dict[str, str]:
    return dict(os.environ if env is None else env)


def find_tool(name: str, env: Mapping[str, str] | None = None) -> str | None:
    return shutil.which(name, path=_environ(env).get("PATH", os.defpath))


def run_tool(args: list[str], env: Mapping[str, str] | None, timeout: float = 30) -> subprocess.CompletedProcess | None:
    """Run a Slurm client command; None when it is not installed here or does not answer."""
    tool = find_tool(args[0], env)
    if tool is None:
        return None
    try:
        return subprocess.run([tool, *args[1:]], capture_output=True, text=True, timeout=timeout,
                              env=_environ(env), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _task_ids(array_job: str, tasks: str) -> list[str]:
    """`12` + `1-3%1` -> ['12_1', '12_2', '12_3'] (submitit's parser of Slurm's array notation)."""
    ids = []
    for parsed in read_job_id(f"{array_job}_[{tasks}]"):
        if len(parsed) == 3:
            ids += [f"{parsed[0]}_{i}" for i in range(int(parsed[1]), int(parsed[2]) + 1)]
        else:
            ids.append("_".join(parsed[:2]))
    return ids


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def parse_scontrol(text: str) -> dict[str, JobRecord]:
    """`scontrol show job -o` output: one record per job or array task, keyed by the user-facing id."""
    records: dict[str, JobRecord] = {}
    for line in text.splitlines():
        fields = dict(_KV.findall(line))
        if "JobId" not in fields:
            continue
        array_job, task = fields.get("ArrayJobId"), fields.get("ArrayTaskId")
        ids = _task_ids(array_job, task) if array_job and task else [fields["JobId"]]
        for job_id in ids:
            records[job_id] = JobRecord(
                job_id=job_id, state=fields.get("JobState", "UNKNOWN"), source="scontrol",
                restarts=_int(fields.get("Restarts")), reason=fields.get("Reason"),
                start=fields.get("StartTime"), end=fields.get("EndTime"), exit_code=fields.get("ExitCode"))
    return records


def parse_sacct(text: str) -> dict[str, JobRecord]:
    """`sacct -X --parsable2 -o JobID,State,ExitCode,Start,End` output (parsed by submitit's watcher)."""
    records = {}
    for job_id, stats in SlurmInfoWatcher().read_info(text).items():
        state = (stats.get("State") or "UNKNOWN").split()[0]   # "CANCELLED by 0" -> CANCELLED
        records[job_id] = JobRecord(job_id=job_id, state=state, source="sacct", start=stats.get("Start"),
                                    end=stats.get("End"), exit_code=stats.get("ExitCode"))
    return records


def query_jobs(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, JobRecord]:
    """Every record Slurm has for `job_id` (all tasks of its array); empty when Slurm has none."""
    base = str(job_id).split("_")[0]
    proc = run_tool(["scontrol", "show", "job", "-o", base], env)
    if proc is not None and proc.returncode == 0:
        records = parse_scontrol(proc.stdout)
        if records:
            return records
    proc = run_tool(["sacct", "-X", "--parsable2", "-o", "JobID,State,ExitCode,Start,End", "-j", base], env)
    if proc is not None and proc.returncode == 0:
        return parse_sacct(proc.stdout)
    return {}


def slurm_state_note(env: Mapping[str, str] | None = None) -> str | None:
    """Why Slurm cannot be asked at all (no client tools here), or None."""
    if find_tool("scontrol", env) is None:
        return "scontrol not found on this machine"
    return None


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


_ACTION_STATE = {"finished": "COMPLETED", "finished-earlier": "COMPLETED", "next-link": "COMPLETED",
                 "requeue": "REQUEUED", "restart": "REQUEUED", "failed": "FAILED", "failed-to-start": "FAILED",
                 "stopped": "STOPPED",
                 "refused": "REFUSED"}


def record_from_events(run_dir: Path, job_id: str) -> JobRecord | None:
    """What the batch script wrote about `job_id` in RUN_DIR/job_events.jsonl, as a record (source 'files')."""
    mine = [e for e in read_events(run_dir) if str(e.get("job_id")) == str(job_id)]
    if not mine:
        return None
    starts = sum(1 for e in mine if e.get("event") == "start")
    last = [e for e in mine if e.get("event") != "signal"][-1]
    if last.get("event") == "start":
        state = "STARTED"  # nothing written since: still running, or killed (time limit, node failure)
    else:
        state = _ACTION_STATE.get(str(last.get("action")), "UNKNOWN")
    code = last.get("code")
    return JobRecord(job_id=str(job_id), state=state, source="files", restarts=max(0, starts - 1),
                     start=next((e.get("time") for e in reversed(mine) if e.get("event") == "start"), None),
                     end=last.get("time") if last.get("event") != "start" else None,
                     exit_code=None if code is None else f"{code}:0")


def job_record(job_id: str, run_dir: Path | None = None, env: Mapping[str, str] | None = None) -> JobRecord:
    """The best answer for one job: Slurm's, else the run's files, else state UNKNOWN."""
    found = query_jobs(job_id, env).get(str(job_id))
    if found is not None:
        return found
    if run_dir is not None:
        from_files = record_from_events(run_dir, job_id)
        if from_files is not None:
            return from_files
    return JobRecord(job_id=str(job_id), state="UNKNOWN", source="none")
