"""hpcrl.launch without a running Slurm: the rendered batch scripts (golden files), quoting of hostile
values, sweeps and chains, `--dry-run` on a machine without Slurm, status from the run's files.

Regenerate the golden scripts after an intended template change with
    HPCRL_UPDATE_GOLDEN=1 pytest tests/test_launch.py -k golden
and review the diff of tests/golden/.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import jinja2
import pytest

import hpcrl
from hpcrl.config import REPO_ROOT, ClusterProfile, ConfigError, load_job, load_profile, validate
from hpcrl.config.constants import EXIT_REQUEUE
from hpcrl.config.cluster import time_limit_seconds
from hpcrl.launch.local import runtime_command
from hpcrl.launch.sbatch import _environment, ranks_per_node
from hpcrl.launch.scheduler import parse_sacct, parse_scontrol, record_from_events
from hpcrl.launch.slurm import prepare_submission
from hpcrl.launch.status import run_status
from hpcrl.placement import compile_plan

REPO = REPO_ROOT
GOLDEN = Path(__file__).parent / "golden"
TINY = "jobs/tiny_grpo.yaml"
SLURM_LOCAL = "clusters/slurm-local.yaml"
# Stand-ins for machine-specific paths, so that the golden files do not depend on the checkout.
GOLDEN_PYTHON = "/opt/hpcrl/venv/bin/python"
GOLDEN_REPO = "/home/user/hpcrl"

GOLDEN_CASES = {
    # name: (job, profile, overrides, chain)
    "slurm-local": (TINY, SLURM_LOCAL, [], 1),
    "slurm-local-chain": (TINY, SLURM_LOCAL, ["train.steps=200"], 3),
    "slurm-local-sweep": (TINY, SLURM_LOCAL, ["sweep={seed: [1, 2], train.lr: [0.001, 0.003]}"], 1),
    "example-4x8-h100": ("jobs/qwen2.5-7b-grpo.yaml", "clusters/example-4x8-h100.yaml", [], 1),
    "example-16x8-h100": ("jobs/qwen2.5-72b-grpo.yaml", "clusters/example-16x8-h100.yaml", [], 1),
    "example-2x4-a100-container": (TINY, "clusters/example-2x4-a100-container.yaml",
                                   ["roles.actor_train.parallel.dp=4", "roles.actor_infer.parallel.dp=4"], 1),
}


def golden_text(job: str, profile: str, overrides: list[str], chain: int) -> str:
    name = load_job(REPO / job).name
    submission = prepare_submission(job, profile, overrides, chain=chain, run_dir=f"/scratch/runs/{name}", cwd=REPO)
    text = submission.script.replace(sys.executable, GOLDEN_PYTHON).replace(str(REPO), GOLDEN_REPO)
    return text.replace(submission.spec.lock_token, "0" * 32)   # new for every submission


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_scripts(case):
    text = golden_text(*GOLDEN_CASES[case])
    path = GOLDEN / f"{case}.sbatch"
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}: run HPCRL_UPDATE_GOLDEN=1 pytest {__file__} -k golden"
    assert text == path.read_text(), (f"{path.name} differs from the rendered script; if the change is intended, "
                                      "regenerate with HPCRL_UPDATE_GOLDEN=1 and review the diff")


def test_srun_with_pmix_is_refused_where_the_ranks_mpich_speaks_none(tmp_path):
    """The pip MPICH (hpcrl's MPI) aborts in MPI_Init under srun --mpi=pmix, given PMIx's variables
    as Slurm's pmix plugin sets them; every rank would die, and the script requeue the job."""
    launched = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True,
                              env={**os.environ, "PMIX_NAMESPACE": "slurm.pmix.1.0", "PMIX_RANK": "0"}, timeout=120)
    assert launched.returncode != 0 and "PMIx" in launched.stderr, launched
    profile = (REPO / "clusters/example-4x8-h100.yaml").read_text()
    (tmp_path / "pmix.yaml").write_text(re.sub(r"\n  mpi: pmi2[^\n]*", "\n  mpi: pmix", profile))
    with pytest.raises(ConfigError, match=r"pmix.yaml: slurm.mpi: pmix, but the ranks' MPI \(MPICH [0-9.]+, from "
                                          r".*aborts in MPI_Init under srun --mpi=pmix; set mpi: pmi2"):
        prepare_submission("jobs/qwen2.5-7b-grpo.yaml", tmp_path / "pmix.yaml", cwd=REPO, run_dir=tmp_path / "run")


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_rendered_scripts_are_valid_bash(case, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(golden_text(*GOLDEN_CASES[case]))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    # every #SBATCH line comes before the first command (sbatch stops reading them there)
    lines = text.splitlines()
    first_command = next(i for i, ln in enumerate(lines[1:], 1) if ln and not ln.startswith("#"))
    assert all(i < first_command for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))


def test_slurm_local_script_starts_the_planned_world():
    sub = prepare_submission(TINY, SLURM_LOCAL, ["train.steps=3"], run_dir="/scratch/runs/t", cwd=REPO)
    text = sub.script
    assert sub.plan.world_size == 4
    for line in ("#SBATCH --job-name=tiny-grpo", "#SBATCH --partition=debug", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks=4", "#SBATCH --cpus-per-task=1", "#SBATCH --signal=B:USR2@60",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --output=/scratch/runs/t/slurm-%j.out",
                 f"#SBATCH --chdir={REPO}", f"EXIT_REQUEUE={EXIT_REQUEUE}", "MAX_RESTARTS=1", "RANKS_PER_NODE=(4)",
                 'scontrol requeue "$SLURM_JOB_ID"', "trap 'hpcrl_warning USR2' USR2",
                 "trap 'hpcrl_warning USR1' USR1", "trap 'hpcrl_stop' TERM",
                 f"export HPCRL_RUN_LOCK={sub.spec.lock_token}", "--kill-on-bad-exit=1 --wait=15"):
        assert line in text.splitlines() or line in text, line
    assert "--gpus-per-node" not in text and "--array" not in text
    # the step: srun with the profile's MPI plugin, the plan's world size, the explicit host list, in background
    srun = _command_block(text, "SLURM_HOSTFILE=")
    words = shlex.split(srun)
    assert words[:6] == ['SLURM_HOSTFILE=$HOSTFILE', "srun", "--mpi=pmi2", "--ntasks=4", "--distribution=arbitrary",
                         "--cpus-per-task=1"]
    expected = runtime_command(sys.executable, Path("$RUN_DIR/job.yaml"), "$RUN_DIR/cluster.yaml", Path("$RUN_DIR"))
    assert words[-len(expected) - 1:] == [*expected, "&"]


def _command_block(text: str, start: str) -> str:
    """The command starting at the line beginning with `start`, continuation lines joined."""
    lines = text.splitlines()
    i = next(n for n, ln in enumerate(lines) if ln.startswith(start))
    out = []
    while True:
        out.append(lines[i].rstrip("\\").rstrip())
        if not lines[i].endswith("\\"):
            return " ".join(out)
        i += 1


def test_uneven_multi_node_layout_and_container_flags():
    case = GOLDEN_CASES["example-2x4-a100-container"]
    sub = prepare_submission(case[0], case[1], case[2], run_dir="/scratch/runs/t", cwd=REPO)
    assert sub.plan.world_size == 9
    assert ranks_per_node(sub.plan) == [5, 4]  # the controller and 4 workers, then 4 workers
    text = sub.script
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks=9\n#SBATCH --ntasks-per-node=5\n" in text
    assert "#SBATCH --gpus-per-node=a100:4" in text
    words = shlex.split(_command_block(text, "SLURM_HOSTFILE="))
    assert "--mpi=pmix" in words
    assert "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in words
    assert ("--container-mounts=/scratch/my-project:/scratch/my-project,/datasets:/datasets:ro,"
            "/scratch/runs/t:/scratch/runs/t") in words
    assert words[words.index("--container-workdir=/scratch/my-project/hpcrl") + 1] == "python3"


def test_big_job_layout():
    job, profile = load_job(REPO / "jobs/qwen2.5-7b-grpo.yaml"), load_profile(REPO / "clusters/example-4x8-h100.yaml")
    assert ranks_per_node(compile_plan(job, profile)) == [9, 8, 8, 8]


def test_unused_first_node_is_not_requested(tmp_path):
    # a role placed on node 1 only: one node is allocated, and it hosts the controller too
    job = tmp_path / "j.yaml"
    job.write_text(textwrap.dedent("""\
        name: placed
        task: {name: addition}
        roles:
          actor_train: {parallel: {dp: 4}, placement: {nodes: "1"}}
          actor_infer: {colocate_with: actor_train}
        """))
    sub = prepare_submission(job, "clusters/example-2x4-a100-container.yaml", run_dir="/scratch/runs/p", cwd=REPO)
    assert ranks_per_node(sub.plan) == [5]
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=5\n" in sub.script


def test_mpiexec_launcher_writes_a_hydra_host_file(tmp_path):
    profile = tmp_path / "p.yaml"
    profile.write_text((REPO / SLURM_LOCAL).read_text().replace("launcher: srun", "launcher: mpiexec"))
    sub = prepare_submission(TINY, profile, run_dir="/scratch/runs/t", cwd=REPO)
    text = sub.script
    assert 'echo "${HOSTS[i]}:${RANKS_PER_NODE[i]}"' in text and "srun" not in text.split("STEP_PID=\"\"")[1]
    words = shlex.split(_command_block(text, shlex.quote(sub.spec.mpiexec)))
    assert words[:5] == [sub.spec.mpiexec, "-f", "$HOSTFILE", "-n", "4"]
    assert Path(sub.spec.mpiexec).name == "mpiexec"


# --- hostile values -------------------------------------------------------------------------------

BASE_PROFILE = {"name": "p", "scheduler": "slurm", "nodes": 1, "devices_per_node": 4, "device": "cpu",
                "device_memory_gb": 4, "slurm": {"partition": "debug"}}
HOSTILE_SLURM_VALUES = [
    ("partition", "debug;rm -rf /"), ("account", "$(id)"), ("qos", "normal high"), ("time", "1:00;reboot"),
    ("signal", "B:USR1@300;id"), ("mem", "10G`id`"), ("gpu_type", "a100 --exclusive"),
    ("modules", ["gcc; rm -rf /"]), ("modules", ["$(reboot)"]), ("modules", ["cuda\nid"]), ("modules", ["cuda\n"]),
    ("env", {"A;B": "x"}), ("env", {"PATH=/tmp": "x"}),
    ("container_image", "img;rm -rf /"), ("container_image", "$(curl evil)"), ("container_image", "a b"),
    ("container_mounts", ["/a:/b;rm -rf /"]), ("container_mounts", ["/a:/b,/c:/d"]), ("container_mounts", ["a:/b"]),
    ("container_workdir", "/w; id"), ("extra_flags", ["--exclusive; rm"]), ("extra_flags", ["--comment=$(id)"]),
    ("extra_flags", ["-o /etc/passwd"]), ("mpiexec", "x"),
]


@pytest.mark.parametrize("key,value", HOSTILE_SLURM_VALUES, ids=[f"{k}={v!r}" for k, v in HOSTILE_SLURM_VALUES])
def test_hostile_profile_values_are_rejected_by_the_schema(key, value):
    data = json.loads(json.dumps(BASE_PROFILE))
    data["slurm"][key] = value
    if key == "container_workdir" or key == "container_mounts":
        data["slurm"]["container_image"] = "ubuntu:22.04"
    with pytest.raises(ConfigError, match=f"slurm.{key}|slurm:"):
        validate(ClusterProfile, data, "hostile.yaml")


@pytest.mark.parametrize("time,seconds", [("120", 7200), ("90:30", 5430), ("168:00:00", 604800), ("2-12", 216000),
                                          ("1-02:03", 93780), ("0", 0), ("UNLIMITED", 0), ("infinite", 0)])
def test_every_time_limit_form_sbatch_takes_is_accepted(time, seconds):
    data = json.loads(json.dumps(BASE_PROFILE))
    data["slurm"].update(time=time, signal="B:USR2@30")
    assert time_limit_seconds(validate(ClusterProfile, data, "p.yaml").slurm.time) == seconds


@pytest.mark.parametrize("signal", ["B:TERM@60", "TERM@60"])
def test_term_is_refused_as_the_warning_signal_since_it_means_stop(signal):
    # the script's own TERM trap (stop, no requeue) would replace the warning's: the run would end unrequeued
    data = json.loads(json.dumps(BASE_PROFILE))
    data["slurm"]["signal"] = signal
    with pytest.raises(ConfigError, match="slurm.signal"):
        validate(ClusterProfile, data, "p.yaml")


@pytest.mark.parametrize("name", ["x;rm -rf /", "$(id)", "a b", "`id`", "x\nid"])
def test_hostile_job_names_are_rejected(name):
    with pytest.raises(ConfigError, match="name"):
        load_job(REPO / TINY, [f"name={json.dumps(name)}"])


HOSTILE_VALUE = "$(touch PWNED) `touch PWNED` ' \" ; rm -rf / # \\ \n second line $HOME"
HOSTILE_PYTHON = "/opt/my env/$(touch PWNED)/bin/python"


def _hostile_profile(tmp_path: Path) -> Path:
    profile = dict(BASE_PROFILE, slurm={
        "partition": "debug", "modules": ["gcc/12.3.0", "cuda/12.4"], "env": {"HOSTILE": HOSTILE_VALUE, "OK": "1"},
        "python": HOSTILE_PYTHON, "container_image": "nvcr.io#nvidia/pytorch:24.05-py3",
        "container_mounts": ["/data:/data:ro"]})
    path = tmp_path / "hostile.yaml"
    path.write_text(json.dumps(profile))
    return path


def test_hostile_values_are_quoted_when_rendered(tmp_path):
    # A job file whose *path* carries a newline and a command: it only ever appears in comments.
    (tmp_path / "jobs\ntouch PWNED").mkdir()
    (tmp_path / "jobs\ntouch PWNED" / "job.yaml").write_text((REPO / TINY).read_text())
    sub = prepare_submission("jobs\ntouch PWNED/job.yaml", _hostile_profile(tmp_path), run_dir=tmp_path / "run",
                             cwd=tmp_path)
    text = sub.script
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "jobs\ntouch PWNED" not in text and "#   job:     jobs\\ntouch PWNED/job.yaml" in text
    # Run the environment section in a real bash (with `module` as a recording function: no Lmod here)
    # and read back what the variables and the module arguments became.
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("if ! command -v module"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("# The hosts of each rank"))
    section = "\n".join(lines[start:end])
    harness = (f"cd {shlex.quote(str(tmp_path))}\n"
               "module() { printf 'module:%s\\0' \"$@\" >>modules.out; }\n"
               "hpcrl_log() { echo \"$*\"; }\n"
               f"{section}\n"
               "printf '%s' \"$HOSTILE\" >hostile.out\n")
    proc = subprocess.run(["bash", "-c", harness], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "hostile.out").read_text() == HOSTILE_VALUE
    assert (tmp_path / "modules.out").read_text().split("\0")[:-1] == [
        "module:load", "module:gcc/12.3.0", "module:load", "module:cuda/12.4"]
    assert not list(tmp_path.rglob("PWNED")) and not Path("PWNED").exists()
    # The step command: the interpreter path stays one word, the container flags are single words.
    words = shlex.split(_command_block(text, "SLURM_HOSTFILE="))
    assert HOSTILE_PYTHON in words and "--container-image=nvcr.io#nvidia/pytorch:24.05-py3" in words


@pytest.mark.parametrize("run_dir", ["/tmp/a b", "/tmp/x%j", "/tmp/$(id)", "/tmp/q'uote", "/tmp/new\nline"])
def test_run_dirs_that_sbatch_lines_cannot_carry_are_rejected(run_dir):
    with pytest.raises(ConfigError, match="#SBATCH lines"):
        prepare_submission(TINY, SLURM_LOCAL, run_dir=run_dir, cwd=REPO)


def test_template_is_strict():
    with pytest.raises(jinja2.UndefinedError):
        _environment().from_string("{{ nothing_here }}").render()
    with pytest.raises(ValueError, match="#SBATCH line"):
        _environment().from_string("{{ 'a b' | sbatch }}").render()
    assert _environment().from_string("{{ x | comment }}").render(x="a\nb") == "a\\nb"


# --- sweeps and chains -----------------------------------------------------------------------------

def _job_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "job.yaml"
    path.write_text((REPO / TINY).read_text() + extra)
    return path


def test_sweep_is_a_cartesian_product_in_stable_order(tmp_path):
    job = _job_file(tmp_path, "sweep:\n  train.lr: [0.001, 0.003]\n  seed: [1, 2, 3]\n")
    sub = prepare_submission(job, SLURM_LOCAL, run_dir=tmp_path / "run", cwd=REPO)
    assert sub.kind == "sweep" and sub.spec.array == "0-5"
    got = [(t.job.train.lr, t.job.seed) for t in sub.sweep]
    assert got == [(0.001, 1), (0.001, 2), (0.001, 3), (0.003, 1), (0.003, 2), (0.003, 3)]
    assert "#SBATCH --array=0-5" in sub.script
    assert 'RUN_DIR="$RUN_ROOT/sweep-${SLURM_ARRAY_TASK_ID:?' in sub.script
    assert f"#SBATCH --output={tmp_path}/run/sweep-%a/slurm-%A_%a.out" in sub.script
    sub.write()
    index = json.loads((tmp_path / "run" / "sweep.json").read_text())
    assert index["keys"] == ["train.lr", "seed"]
    assert index["tasks"][4] == {"index": 4, "run_dir": "sweep-4", "overrides": {"train.lr": 0.003, "seed": 2}}
    for i, (lr, seed) in enumerate(got):
        task = load_job(tmp_path / "run" / f"sweep-{i}" / "job.yaml")
        assert (task.train.lr, task.seed, task.sweep) == (lr, seed, None)
        assert (tmp_path / "run" / f"sweep-{i}" / "plan.json").is_file()
        assert load_profile(tmp_path / "run" / f"sweep-{i}" / "cluster.yaml").name == "slurm-local"
    assert not (tmp_path / "run" / "job.yaml").exists()


def test_sweep_from_the_command_line():
    sub = prepare_submission(TINY, SLURM_LOCAL, ["sweep={seed: [1, 2, 3]}"], run_dir="/scratch/runs/s", cwd=REPO)
    assert [t.job.seed for t in sub.sweep] == [1, 2, 3]


@pytest.mark.parametrize("sweep,message", [
    ("{train.lr: [0.001, -1]}", r"sweep task 1: train.lr=-1\).*train.lr: expected a positive number"),
    ("{train.lrr: [1]}", r"sweep task 0.*train.lrr: unknown key; did you mean 'lr'"),
    ("{name: [a, b]}", "sweep.name: cannot be swept"),
    ("{seed: []}", "sweep.seed: the list of values is empty"),
    ("{roles.actor_train.parallel.dp: [1, 2]}", "one job array has one allocation size"),
])
def test_bad_sweeps_are_rejected_before_submission(sweep, message):
    with pytest.raises(ConfigError, match=message):
        prepare_submission(TINY, SLURM_LOCAL, [f"sweep={sweep}"], run_dir="/scratch/runs/s", cwd=REPO)


def test_sweep_plus_chain_is_rejected():
    with pytest.raises(ConfigError, match="already runs as one job array"):
        prepare_submission(TINY, SLURM_LOCAL, ["sweep={seed: [1, 2]}"], chain=2, run_dir="/scratch/r", cwd=REPO)


def test_chain_runs_array_tasks_one_at_a_time():
    sub = prepare_submission(TINY, SLURM_LOCAL, chain=4, run_dir="/scratch/runs/c", cwd=REPO)
    assert sub.spec.array == "0-3%1"
    assert "#SBATCH --array=0-3%1" in sub.script and "#SBATCH --output=/scratch/runs/c/slurm-%A.out" in sub.script
    assert 'if [ "$SLURM_ARRAY_TASK_ID" -lt "$SLURM_ARRAY_TASK_MAX" ]; then' in sub.script
    assert [h.job_id for h in sub.handles("7")] == ["7_0", "7_1", "7_2", "7_3"]
    with pytest.raises(ConfigError, match="--chain"):
        prepare_submission(TINY, SLURM_LOCAL, chain=0, run_dir="/scratch/runs/c", cwd=REPO)


def test_submit_needs_a_slurm_profile():
    with pytest.raises(ConfigError, match="needs a Slurm profile"):
        prepare_submission(TINY, "clusters/local.yaml", run_dir="/scratch/r", cwd=REPO)


# --- without Slurm on the machine -------------------------------------------------------------------

def _no_slurm_env(tmp_path: Path) -> dict[str, str]:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = str(empty)  # no sbatch, squeue, scontrol, sacct
    return env


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_dry_run_without_slurm_prints_script_and_plan(tmp_path):
    proc = _cli(["submit", str(REPO / TINY), "--cluster", str(REPO / SLURM_LOCAL), "--dry-run",
                 "--set", "train.steps=3"], tmp_path, _no_slurm_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("#!/bin/bash\n")
    assert "#SBATCH --ntasks=4" in out and "srun --mpi=pmi2" in out
    assert "world_size 4: rank 0 is the controller" in out          # the plan, as `hpcrl plan` prints it
    assert "dry run: nothing written or submitted (sbatch not found on this machine)" in out
    assert not (tmp_path / "runs").exists()


def test_submit_without_slurm_says_what_to_do(tmp_path):
    proc = _cli(["submit", str(REPO / TINY), "--cluster", str(REPO / SLURM_LOCAL)], tmp_path,
                _no_slurm_env(tmp_path))
    assert proc.returncode == 1
    assert "sbatch not found on this machine" in proc.stderr and "--dry-run" in proc.stderr


def test_python_api_dry_run(tmp_path):
    handles = hpcrl.submit(REPO / TINY, REPO / SLURM_LOCAL, ["sweep={seed: [1, 2]}"], dry_run=True, cwd=tmp_path)
    assert [(h.job_id, h.run_dir.name, h.task) for h in handles] == [(None, "sweep-0", 0), (None, "sweep-1", 1)]
    assert handles[0].state() == "NOT_SUBMITTED"
    assert not (tmp_path / "runs").exists()


def test_status_without_slurm_reads_the_run_files(tmp_path):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "job.yaml").write_text("name: r\ntask: {name: addition}\ntrain: {steps: 3}\n"
                                  "roles: {actor_train: {}, actor_infer: {colocate_with: actor_train}}\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in (1, 2, 3)))
    (run / "slurm_jobs.json").write_text(json.dumps([{"job_id": "41", "kind": "single", "tasks": 1}]))
    events = [{"job_id": "41", "event": "start", "code": None, "action": "started"},
              {"job_id": "41", "event": "end", "code": 3, "action": "restart"},
              {"job_id": "41", "event": "start", "code": None, "action": "started"},
              {"job_id": "41", "event": "end", "code": 0, "action": "finished"}]
    (run / "job_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    local = tmp_path / "runs" / "local-run"
    local.mkdir()
    (local / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")

    (row,) = run_status(run, env=_no_slurm_env(tmp_path))
    assert (row.job_id, row.state, row.source, row.progress, row.reward_mean, row.restarts) == (
        "41", "COMPLETED", "files", "3/3", 0.3, 1)
    proc = _cli(["status"], tmp_path, _no_slurm_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()[1:] if ln.startswith("runs/")}
    assert rows["runs/r"][1:] == ["41", "COMPLETED*", "3/3", "0.3000", "1"]
    assert rows["runs/local-run"][1:] == ["-", "-", "1/?", "0.5000", "-"]
    assert "scontrol not found on this machine" in proc.stdout


# --- parsing what Slurm prints -------------------------------------------------------------------

SCONTROL = (  # `scontrol show job -o` of a chain (array 13, %1) with task 0 running, as Slurm 22.05 prints it
    "JobId=14 ArrayJobId=13 ArrayTaskId=1%1 ArrayTaskThrottle=1 JobName=mini UserId=root(0) JobState=PENDING "
    "Reason=JobArrayTaskLimit Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 ExitCode=0:0 StartTime=Unknown "
    "EndTime=Unknown\n"
    "JobId=13 ArrayJobId=13 ArrayTaskId=0 ArrayTaskThrottle=1 JobName=mini UserId=root(0) JobState=RUNNING "
    "Reason=None Requeue=1 Restarts=2 BatchFlag=1 ExitCode=0:0 StartTime=2026-12-02T17:25:20 "
    "EndTime=2026-12-02T17:40:20\n")
SACCT = ("JobID|State|ExitCode|Start|End\n"
         "20_0|COMPLETED|0:0|2026-12-02T17:25:20|2026-12-02T17:26:34\n"
         "20_[1-2]|PENDING|0:0|Unknown|Unknown\n"
         "21|CANCELLED by 0|0:15|2026-12-02T17:25:20|2026-12-02T17:26:34\n")


def test_parse_scontrol_expands_pending_array_tasks():
    records = parse_scontrol(SCONTROL)
    assert records["13_0"].state == "RUNNING" and records["13_0"].restarts == 2
    assert records["13_1"].state == "PENDING" and records["13_1"].reason == "JobArrayTaskLimit"


def test_parse_sacct():
    records = parse_sacct(SACCT)
    assert {k: r.state for k, r in records.items()} == {
        "20_0": "COMPLETED", "20_1": "PENDING", "20_2": "PENDING", "21": "CANCELLED"}


def test_record_from_events_states(tmp_path):
    def state_after(*actions):
        (tmp_path / "job_events.jsonl").write_text("".join(
            json.dumps({"job_id": "5", "event": "start" if a == "started" else "end", "action": a,
                        "code": None if a == "started" else 0}) + "\n" for a in actions))
        return record_from_events(tmp_path, "5").state

    assert state_after("started") == "STARTED"
    assert state_after("started", "requeue") == "REQUEUED"
    assert state_after("started", "failed") == "FAILED"
    assert state_after("started", "next-link") == "COMPLETED"
    assert record_from_events(tmp_path, "6") is None


def test_golden_files_cover_every_slurm_profile():
    shipped = {p.stem for p in (REPO / "clusters").glob("*.yaml") if load_profile(p).scheduler == "slurm"}
    assert shipped <= set(GOLDEN_CASES), f"add a golden case for {shipped - set(GOLDEN_CASES)}"
    assert re.fullmatch(r"\d+", str(EXIT_REQUEUE))


def test_handle_wait_without_a_slurm_record_ends_on_the_run_files(tmp_path):
    from hpcrl.launch.slurm import SubmittedJob

    env = _no_slurm_env(tmp_path)
    (tmp_path / "job_events.jsonl").write_text(json.dumps({"job_id": "8", "event": "start", "action": "started"}) + "\n")
    assert SubmittedJob("8", tmp_path, env=env).wait(timeout=10, poll=0) == "STARTED"
    with open(tmp_path / "job_events.jsonl", "a") as f:
        f.write(json.dumps({"job_id": "8", "event": "end", "code": 0, "action": "finished"}) + "\n")
    assert SubmittedJob("8", tmp_path, env=env).state() == "COMPLETED"
