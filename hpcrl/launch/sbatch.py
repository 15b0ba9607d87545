"""Render templates/job.sbatch.j2: the batch script that starts one hpcrl MPI world inside a Slurm allocation.

Nothing from a YAML file reaches the shell unquoted: shell words go through the `q` filter
(shlex.quote), values on `#SBATCH` lines through `sbatch` (plain tokens only: sbatch does not parse
shell quoting there, so anything else is refused), and text in comments through `comment`.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import jinja2

from hpcrl.config import REPO_ROOT, ClusterProfile, ConfigError
from hpcrl.config.cluster import SlurmSettings
from hpcrl.config.constants import (AUTOMATIC_RESTART_ENV, EXIT_REFUSED, EXIT_REQUEUE, EXIT_STOPPED, RANK_EXITS_DIR,
                                    REFUSED_MARKER, WORLD_MARKER)
from hpcrl.launch.lock import TOKEN_ENV
from hpcrl.placement import Plan

if TYPE_CHECKING:
    from hpcrl.launch.local import ResumeOptions

TEMPLATE_DIR = REPO_ROOT / "templates"
TEMPLATE = "job.sbatch.j2"
SCRIPT_NAME = "job.sbatch"

# What may stand on an #SBATCH line: sbatch splits it on whitespace and takes quotes literally,
# and expands %j/%A/%a in file names (which the launcher adds itself, never taken from a path).
_SBATCH_VALUE = re.compile(r"^[A-Za-z0-9._,:@/+=%-]+$")
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._,:@/+=-]*$")
RUN_DIR_VAR = "@RUN_DIR@"  # placeholder for "$RUN_DIR" in the runtime command (a shell variable there)


class TemplateError(ValueError):
    """A value that cannot be written into the batch script safely."""


def _quote(value: Any) -> str:
    return shlex.quote(str(value))


def _sbatch_value(value: Any) -> str:
    text = str(value)
    if text.startswith("--"):  # a whole flag from extra_flags: --exclusive, --constraint=a100
        name, _, rest = text.partition("=")
        if re.fullmatch(r"--[a-z][a-z-]*", name) and (not rest or _SBATCH_VALUE.fullmatch(rest)):
            return text
    elif _SBATCH_VALUE.fullmatch(text):
        return text
    raise TemplateError(f"{text!r} cannot be written on an #SBATCH line (only letters, digits and ._,:@/+=-)")


def _comment(value: Any) -> str:
    """One printable line: a newline in a comment would end it and start a command."""
    text = str(value)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_sbatch_path(path: Path, what: str) -> Path:
    """An absolute path that can stand on an #SBATCH line, or a ConfigError that says why not."""
    text = str(path)
    if not _SAFE_PATH.fullmatch(text):
        bad = sorted({c for c in text if not re.fullmatch(r"[A-Za-z0-9._,:@/+=-]", c)})
        raise ConfigError(what, [f"{text!r} contains {' '.join(repr(c) for c in bad)}: Slurm's #SBATCH lines "
                                 "cannot carry it (no quoting there, and % is a file-name pattern); use a "
                                 "directory whose path has only letters, digits and ._,:@/+=-"])
    return path


@dataclass(frozen=True)
class ScriptSpec:
    """Everything the template needs; built by `script_spec`, rendered by `render_script`."""

    job_name: str
    profile: ClusterProfile
    plan: Plan
    run_root: Path                    # absolute
    workdir: Path                     # absolute: the ranks' working directory (relative paths in the job)
    python: str
    kind: str = "single"              # single | sweep | chain
    tasks: int = 1                    # array tasks (sweep combinations or chain links)
    job_source: str = ""
    profile_source: str = ""
    mpiexec: str = "mpiexec"
    description: tuple[str, ...] = field(default_factory=tuple)
    lock_token: str = ""              # the run directory lock's token, for the ranks (hpcrl.launch.lock)
    resume: "ResumeOptions | None" = None   # --restart / --allow-config-change for the ranks

    @property
    def array(self) -> str | None:
        if self.kind == "sweep":
            return f"0-{self.tasks - 1}"
        if self.kind == "chain":
            return f"0-{self.tasks - 1}%1"
        return None

    @property
    def output(self) -> Path:
        """The Slurm log (append mode: a requeued job keeps writing to the same file)."""
        if self.kind == "sweep":
            return self.run_root / "sweep-%a" / "slurm-%A_%a.out"
        if self.kind == "chain":
            return self.run_root / "slurm-%A.out"
        return self.run_root / "slurm-%j.out"


def ranks_per_node(plan: Plan) -> list[int]:
    """Ranks on each allocated node, in rank order: the controller (rank 0) and the workers of the
    first used node, then the workers of each further used node. Unused nodes are not requested."""
    used_nodes = sorted({plan.node_of_slot(plan.slot_of_rank(r)) for r in range(1, plan.world_size)})
    counts = [0] * max(1, len(used_nodes))
    counts[0] = 1  # the controller
    for rank in range(1, plan.world_size):
        counts[used_nodes.index(plan.node_of_slot(plan.slot_of_rank(rank)))] += 1
    return counts


def gpus_per_node(profile: ClusterProfile) -> str | None:
    if profile.device != "cuda":
        return None
    gpu_type = profile.slurm.gpu_type if profile.slurm else None
    return f"{gpu_type}:{profile.devices_per_node}" if gpu_type else str(profile.devices_per_node)


def warning_signals(signal: str) -> list[str]:
    """The signals that ask the batch script for a checkpoint and a requeue: the warning signal (when
    it goes to the script) and USR1, the way to ask by hand (`scancel --batch --signal=USR1`)."""
    names = [signal.removeprefix("B:").split("@")[0]] if signal.startswith("B:") else []
    return names + ["USR1"] if "USR1" not in names else names


def requeue_deadline_s(slurm: SlurmSettings, kind: str) -> int | None:
    """Seconds after the time limit's warning at which the batch script requeues a job whose ranks
    are still in their step: a step that outlasts the warning's lead would end TIMEOUT, which Slurm
    does not requeue. The margin (a quarter of the lead, at most 30 s) leaves `scontrol requeue`
    time to act before the limit. None where the script cannot or need not: the warning goes to the
    ranks (no B:), requeue is off, or a chain (its next link starts after a TIMEOUT too)."""
    if not slurm.signal.startswith("B:") or not slurm.requeue or kind == "chain":
        return None
    return slurm.warning_lead_s - min(30, max(1, slurm.warning_lead_s // 4))


def shell_command(words: Sequence[str]) -> str:
    """Quote a command for the script; a word starting with RUN_DIR_VAR becomes "$RUN_DIR"<rest>."""
    out = []
    for word in words:
        word = str(word)
        if word.startswith(RUN_DIR_VAR):
            rest = word[len(RUN_DIR_VAR):]
            out.append('"$RUN_DIR"' + (_quote(rest) if rest else ""))
        else:
            out.append(_quote(word))
    return " ".join(out)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False,
                             comment_start_string="{##", comment_end_string="##}")  # bash has ${#array[@]}
    env.filters.update(q=_quote, sbatch=_sbatch_value, comment=_comment)
    return env


def render_script(spec: ScriptSpec) -> str:
    """The batch script text for `spec`."""
    from hpcrl.launch.local import runtime_command

    profile, plan = spec.profile, spec.plan
    if profile.slurm is None:
        raise ConfigError(spec.profile_source or profile.name, ["the profile has no 'slurm' section"])
    check_sbatch_path(spec.run_root, "run directory")
    check_sbatch_path(spec.workdir, "working directory")
    run_dir = Path(RUN_DIR_VAR)
    command = runtime_command(spec.python, Path(f"{RUN_DIR_VAR}/job.yaml"), f"{RUN_DIR_VAR}/cluster.yaml", run_dir,
                              spec.resume)
    mounts = [*profile.slurm.container_mounts, f"{spec.run_root}:{spec.run_root}"]
    template = _environment().get_template(TEMPLATE)
    return template.render(
        job_name=spec.job_name, profile_name=profile.name, job_source=spec.job_source,
        profile_source=spec.profile_source, description=list(spec.description), kind=spec.kind, tasks=spec.tasks,
        slurm=profile.slurm, max_restarts=profile.max_restarts, exit_requeue=EXIT_REQUEUE,
        exit_stopped=EXIT_STOPPED, exit_refused=EXIT_REFUSED,
        world_size=plan.world_size, ranks_per_node=ranks_per_node(plan), gpus_per_node=gpus_per_node(profile),
        run_root=str(spec.run_root), workdir=str(spec.workdir), output=str(spec.output), array=spec.array,
        script_path=str(spec.run_root / SCRIPT_NAME), warning_signals=warning_signals(profile.slurm.signal),
        warning_lead_s=profile.slurm.warning_lead_s, requeue_deadline_s=requeue_deadline_s(profile.slurm, spec.kind),
        container_mounts=mounts, mpiexec=spec.mpiexec, command=shell_command(command), lock_token=spec.lock_token,
        lock_env=TOKEN_ENV, python=spec.python, rank_exits_dir=RANK_EXITS_DIR, refused_marker=REFUSED_MARKER,
        world_marker=WORLD_MARKER, restart_env=AUTOMATIC_RESTART_ENV,
    )
