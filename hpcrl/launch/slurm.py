"""`hpcrl submit`: validate, plan, render the batch script, sbatch it, remember the job id.

    job YAML + cluster profile ──> compile_plan ──> templates/job.sbatch.j2 ──> RUN_DIR/job.sbatch ──> sbatch
                                                                                      │
    RUN_DIR/job.yaml, plan.json, cluster.yaml (what the ranks load)                   └──> RUN_DIR/slurm_jobs.json

A job with a `sweep:` block becomes one job array, task i running combination i in RUN_DIR/sweep-i;
`chain=K` makes K array tasks that run one after another in the same RUN_DIR, each resuming from the
newest checkpoint there.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Mapping, Sequence

from hpcrl.config import ClusterProfile, ConfigError, JobConfig, load_profile
from hpcrl.launch.local import ResumeOptions
from hpcrl.launch.lock import Holder, RunLockError, acquire, release, update
from hpcrl.launch.sbatch import SCRIPT_NAME, ScriptSpec, check_sbatch_path, ranks_per_node, render_script
from hpcrl.launch.scheduler import find_tool, job_record
from hpcrl.launch.sweep import SweepTask, describe_overrides, load_job_and_sweep, write_index
from hpcrl.placement import Plan, compile_plan

JOBS_FILE = "slurm_jobs.json"
PROFILE_COPY = "cluster.yaml"


class SubmitError(RuntimeError):
    """sbatch is missing or refused the job; the message says what to do."""


@dataclass
class SubmittedJob:
    """A handle on one submitted job or array task (`12`, or `12_3` for task 3 of array job 12)."""

    job_id: str | None            # None after a dry run
    run_dir: Path
    array_job_id: str | None = None
    task: int | None = None
    log: Path | None = None
    env: Mapping[str, str] | None = field(default=None, repr=False)

    def state(self) -> str:
        """Slurm's state (PENDING, RUNNING, COMPLETED, ...), from scontrol, sacct or the run's files."""
        if self.job_id is None:
            return "NOT_SUBMITTED"
        return job_record(self.job_id, self.run_dir, self.env).state

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Block until the job reached a final state (a requeued job is waited for again); return it."""
        if self.job_id is None:
            raise RuntimeError("a dry run submitted nothing: there is nothing to wait for")
        deadline = None if timeout is None else time.monotonic() + timeout
        unknown_to_slurm = 0
        while True:
            record = job_record(self.job_id, self.run_dir, self.env)
            if record.finished:
                return record.state
            # Slurm forgot the job (or cannot be asked): the run's files say the last thing known
            unknown_to_slurm = unknown_to_slurm + 1 if record.source in ("files", "none") else 0
            if unknown_to_slurm >= 3:
                return record.state
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.job_id} still {record.state} after {timeout:.0f} s "
                                   f"(reason: {record.reason or '-'}); follow it with `hpcrl status {self.run_dir}`")
            time.sleep(poll)


@dataclass(frozen=True)
class Submission:
    """A validated, planned and rendered submission; `write()` puts it on disk, `sbatch()` submits it."""

    job: JobConfig
    job_path: Path
    profile: ClusterProfile
    profile_path: Path
    plan: Plan
    sweep: tuple[SweepTask, ...]
    plans: tuple[Plan, ...]           # one per sweep task (empty without a sweep)
    chain: int
    run_root: Path
    spec: ScriptSpec
    script: str
    overrides: tuple[str, ...]

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def script_path(self) -> Path:
        return self.run_root / SCRIPT_NAME

    def run_dirs(self) -> list[Path]:
        if self.sweep:
            return [self.run_root / t.dirname for t in self.sweep]
        return [self.run_root]

    def submit(self, env: Mapping[str, str] | None = None) -> str:
        """Take the run directory's lock (refused while another run holds it), write it and sbatch the
        script; the lock then names the job, which keeps it (the ranks carry its token). Returns the
        job id and any note about a stale lock that was taken over (printed to stderr)."""
        holder = Holder.here("submit", token=self.spec.lock_token)
        try:
            note = acquire(self.run_root, holder, env)
        except RunLockError as exc:
            raise SubmitError(str(exc)) from None
        if note:
            print(f"hpcrl: {note}", file=sys.stderr)
        try:
            self.write()
            job_id = self.sbatch(env)
        except BaseException:
            release(self.run_root, holder)
            raise
        update(self.run_root, replace(holder, slurm_job_id=job_id))
        return job_id

    def write(self) -> Path:
        """Write the run directory (or one per sweep task) and the batch script; return the script's path."""
        from hpcrl.launch.local import prepare_run_dir

        self.run_root.mkdir(parents=True, exist_ok=True)
        if self.sweep:
            for task, plan, run_dir in zip(self.sweep, self.plans, self.run_dirs()):
                prepare_run_dir(task.job, plan, run_dir)
                shutil.copyfile(self.profile_path, run_dir / PROFILE_COPY)
            write_index(self.run_root, list(self.sweep))
        else:
            prepare_run_dir(self.job, self.plan, self.run_root)
            shutil.copyfile(self.profile_path, self.run_root / PROFILE_COPY)
        self.script_path.write_text(self.script)
        self.script_path.chmod(0o755)
        return self.script_path

    def sbatch(self, env: Mapping[str, str] | None = None) -> str:
        """Submit the written script with `sbatch --parsable`; return the job id."""
        sbatch = find_tool("sbatch", env)
        if sbatch is None:
            raise SubmitError("sbatch not found on this machine: run `hpcrl submit` on a Slurm login node "
                              "(or add --dry-run to only see the script and the plan)")
        environ = dict(os.environ if env is None else env)
        try:
            proc = subprocess.run([sbatch, "--parsable", str(self.script_path)], capture_output=True, text=True,
                                  env=environ, cwd=str(self.spec.workdir), timeout=120, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SubmitError("sbatch did not answer within 120 s: is slurmctld reachable? (`sinfo`)") from None
        if proc.returncode != 0:
            raise SubmitError(f"sbatch refused the job (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()}\n"
                              f"The script is {self.script_path}; fix the cluster profile "
                              f"({self.profile_path}) and submit again")
        job_id = proc.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SubmitError(f"sbatch printed no job id: {proc.stdout.strip()!r} {proc.stderr.strip()!r}")
        self._record(job_id)
        return job_id

    def _record(self, job_id: str) -> None:
        path = self.run_root / JOBS_FILE
        try:
            records = json.loads(path.read_text()) if path.is_file() else []
        except json.JSONDecodeError:
            records = []
        records.append({
            "job_id": job_id, "kind": self.kind, "tasks": self.spec.tasks, "array": self.spec.array,
            "submitted": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "job": str(self.job_path), "cluster": str(self.profile_path), "overrides": list(self.overrides),
            "world_size": self.plan.world_size, "nodes": len(ranks_per_node(self.plan)),
            "script": SCRIPT_NAME, "log": str(self.spec.output.relative_to(self.run_root)),
        })
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(records, indent=1) + "\n")
        os.replace(tmp, path)

    def handles(self, job_id: str | None, env: Mapping[str, str] | None = None) -> list[SubmittedJob]:
        """One handle per job or array task."""
        def log(task: int | None) -> Path | None:
            if job_id is None:
                return None
            text = str(self.spec.output).replace("%j", job_id).replace("%A", job_id)
            return Path(text.replace("%a", str(task)) if task is not None else text)

        if self.kind == "single":
            return [SubmittedJob(job_id, self.run_root, log=log(None), env=env)]
        return [SubmittedJob(None if job_id is None else f"{job_id}_{i}", run_dir, array_job_id=job_id, task=i,
                             log=log(i), env=env)
                for i, run_dir in enumerate(self.run_dirs() if self.sweep else [self.run_root] * self.chain)]


def _mpiexec_for(python: str, configured: str | None) -> str:
    if configured:
        return configured
    beside = Path(python).parent / "mpiexec"
    if Path(python).is_absolute() and beside.exists():
        return str(beside)
    return "mpiexec"


def _pmi_refusals(profile: ClusterProfile, python: str) -> list[str]:
    """srun --mpi=pmix hands the ranks PMIx, which the pip mpich wheel (hpcrl's own MPI, built
    without it) refuses in MPI_Init: every rank would abort, and the script requeue the job to abort
    again. Checked where the ranks' interpreter is here to ask (not in a container); a site's own
    MPICH (Cray's, one built --with-pmix) is left to the site."""
    slurm = profile.slurm
    if slurm.launcher != "srun" or slurm.mpi != "pmix" or slurm.container_image or not Path(python).is_file():
        return []
    probe = subprocess.run([python, "-c", "import mpi4py; mpi4py.rc.initialize = False\n"
                            "from mpi4py import MPI; print(MPI.Get_library_version())"],
                           capture_output=True, text=True, timeout=120)
    library = probe.stdout
    if probe.returncode or "pypi.org/p/mpich/" not in library or "pmix" in library.lower():
        return []
    return [f"slurm.mpi: pmix, but the ranks' MPI (MPICH {library.splitlines()[0].split(':', 1)[-1].strip()}, "
            f"from {python}) was built without PMIx and aborts in MPI_Init under srun --mpi=pmix; "
            "set mpi: pmi2"]


def _same_layout(plans: Sequence[Plan], tasks: Sequence[SweepTask], source: str) -> None:
    first = (plans[0].world_size, ranks_per_node(plans[0]))
    for plan, task in zip(plans[1:], tasks[1:]):
        layout = (plan.world_size, ranks_per_node(plan))
        if layout != first:
            raise ConfigError(source, [
                f"sweep task {task.index} ({task.describe()}) needs {layout[0]} ranks laid out {layout[1]} per node, "
                f"task 0 ({tasks[0].describe()}) {first[0]} laid out {first[1]}: one job array has one allocation "
                "size; sweep only values that keep the device map, or submit the variants as separate jobs"])


def prepare_submission(job_path: str | Path, cluster_path: str | Path, overrides: Sequence[str] = (),
                       chain: int = 1, run_dir: str | Path | None = None,
                       cwd: str | Path | None = None, resume: ResumeOptions | None = None) -> Submission:
    """Load and validate the job (every sweep combination) and the profile, compile the plan(s), render the
    script. Touches no file and runs no Slurm command."""
    from hpcrl.placement import PlacementError

    if chain < 1:
        raise ConfigError("--chain", [f"{chain}: give the number of links, 1 or more"])
    cwd = Path(cwd or os.getcwd()).resolve()
    job_path, cluster_path = Path(job_path), Path(cluster_path)
    profile = load_profile(cluster_path if cluster_path.is_absolute() else cwd / cluster_path)
    if profile.scheduler != "slurm" or profile.slurm is None:
        raise ConfigError(str(cluster_path), [f"scheduler is {profile.scheduler!r}: `hpcrl submit` needs a Slurm "
                                              "profile (e.g. clusters/slurm-local.yaml); `hpcrl run` runs a job here"])
    job, sweep = load_job_and_sweep(job_path if job_path.is_absolute() else cwd / job_path, list(overrides))
    if sweep and chain > 1:
        raise ConfigError("--chain", [f"the job has a sweep: block ({len(sweep)} combinations), which already runs "
                                      "as one job array; --chain K chains K array tasks over ONE run. Submit the "
                                      "sweep without --chain, or chain each combination on its own (--set seed=...)"])
    try:
        if sweep:
            plans = tuple(compile_plan(task.job, profile) for task in sweep)
            _same_layout(plans, sweep, str(job_path))
            plan = plans[0]
        else:
            plans = ()
            plan = compile_plan(job, profile)
    except PlacementError as exc:
        raise ConfigError(str(job_path), [f"no device map on {profile.name}: {exc}"]) from None
    run_root = Path(run_dir) if run_dir is not None else Path("runs") / job.name
    run_root = (run_root if run_root.is_absolute() else cwd / run_root).resolve()
    check_sbatch_path(run_root, "--run-dir")
    check_sbatch_path(cwd, "the working directory")
    python = profile.slurm.python or sys.executable
    refused = _pmi_refusals(profile, python)
    if refused:
        raise ConfigError(str(cluster_path), refused)
    kind = "sweep" if sweep else "chain" if chain > 1 else "single"
    description = []
    if overrides:
        description.append("overrides: " + " ".join(f"--set {o}" for o in overrides))
    if sweep:
        description.append(f"sweep: {len(sweep)} combinations of {', '.join(sweep[0].overrides)}, one array task "
                           "each in RUN_ROOT/sweep-<task> (index: sweep.json)")
    if kind == "chain":
        description.append(f"chain: {chain} array tasks, one at a time, each resuming from the newest checkpoint")
    spec = ScriptSpec(
        job_name=job.name, profile=profile, plan=plan, run_root=run_root, workdir=cwd, python=python, kind=kind,
        tasks=len(sweep) if sweep else chain, job_source=str(job_path), profile_source=str(cluster_path),
        mpiexec=_mpiexec_for(python, profile.slurm.mpiexec), description=tuple(description),
        lock_token=uuid.uuid4().hex, resume=resume)
    script = render_script(spec)
    return Submission(job=job, job_path=(cwd / job_path).resolve(), profile=profile,
                      profile_path=(cwd / cluster_path).resolve(), plan=plan, sweep=tuple(sweep), plans=plans,
                      chain=chain, run_root=run_root, spec=spec, script=script, overrides=tuple(overrides))


def submit(job_path: str | Path, cluster_path: str | Path, overrides: Sequence[str] = (), dry_run: bool = False,
           chain: int = 1, run_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
           cwd: str | Path | None = None) -> list[SubmittedJob]:
    """Submit a job to Slurm as `hpcrl submit` does; return one handle per job or array task.

    `overrides` are `--set` strings (`train.steps=20`); `chain=K` runs K array tasks one after another,
    each resuming from the newest checkpoint; `run_dir` defaults to runs/<job name> under `cwd`;
    `env` is the environment of the Slurm commands (default: this process's). With `dry_run` nothing
    is written or submitted and the handles have `job_id` None.
    """
    submission = prepare_submission(job_path, cluster_path, overrides, chain, run_dir, cwd)
    if dry_run:
        return submission.handles(None, env)
    return submission.handles(submission.submit(env), env)


def describe_submission(submission: Submission, job_id: str) -> str:
    """What `hpcrl submit` prints after sbatch accepted the job: where it runs and how to follow it."""
    run_root = submission.run_root
    shown = _short(run_root)
    nodes = len(ranks_per_node(submission.plan))
    what = {"single": "", "sweep": f", a job array of {len(submission.sweep)} sweep tasks",
            "chain": f", a chain of {submission.chain} array tasks run one at a time"}[submission.kind]
    lines = [f"hpcrl: submitted job {job_id}{what}: {submission.job.name} on {submission.profile.name}, "
             f"{submission.plan.world_size} ranks on {nodes} node(s)" + (" per task" if what else "")]
    if submission.sweep:
        for task in submission.sweep:
            lines.append(f"  {job_id}_{task.index}  {shown}/{task.dirname}  {task.describe()}")
    log = str(submission.spec.output).replace("%A", job_id).replace("%j", job_id)
    log = log.replace("%a", "*")
    estimate = submission.plan.checkpoint
    if estimate is not None and estimate.too_slow:
        lines.append(f"  warning: a checkpoint takes about {estimate.seconds:.0f} s here and the warning signal comes "
                     f"{estimate.window_s} s before the time limit (see `hpcrl plan`)")
    lines += [f"  run dir: {shown}", f"  script:  {_short(submission.script_path)}",
              f"  watch:   hpcrl status {shown}", f"           tail -f {_short(Path(log))}",
              f"  cancel:  hpcrl cancel {shown}   (or scancel {job_id}: the ranks save a checkpoint if they can)"]
    return "\n".join(lines)


def _short(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def describe_sweep(tasks: Sequence[SweepTask]) -> str:
    return "\n".join(f"  task {t.index}: sweep-{t.index}  {describe_overrides(t.overrides)}" for t in tasks)
