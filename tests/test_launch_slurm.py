"""`hpcrl submit` / `hpcrl status` against the real local Slurm (scripts/slurm-local).

Two kinds of test:

- The real thing: tiny GRPO runs (1 controller + workers, torch on CPU) submitted with the command
  line, as one job, as a 3-task sweep array and as a 2-link chain. They are submitted together by one
  fixture, so that they share the node's 8 CPUs, and each test then waits for its own.
- The batch script's side of the preemption contract (the warning's request in RUN_DIR/control, requeue
  on exit 99, restarts after failures, chain links), driven by a STAND-IN for `python -m hpcrl.runtime`:
  a small bash program given as the profile's `python`. It trains nothing: it behaves as the contract
  says the runtime behaves (checkpoint file, exit 99 on a requeue request, resume on restart), in a
  second, so that the script's logic is tested in seconds and independently of the runtime's progress
  (the world marker included, RUN_DIR/ranks/world-<job id>).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import hpcrl
from hpcrl.config import REPO_ROOT
from hpcrl.launch.local import runtime_command
from hpcrl.launch.scheduler import read_events
from hpcrl.metrics import read_metrics
from slurm_cluster import job_info, slurm_cmd, slurm_env, slurm_environ, wait_job  # noqa: F401

REPO = REPO_ROOT
TINY = REPO / "jobs" / "tiny_grpo.yaml"
SLURM_LOCAL = REPO / "clusters" / "slurm-local.yaml"
FAST = ["--set", "train.prompts_per_step=4", "--set", "log.tensorboard=false"]

# The runtime saves a checkpoint on a warning (USR1/USR2), exits with EXIT_REQUEUE (99) and resumes from the newest
# checkpoint in its run directory, so the chain test interrupts link 0 and checks that link 1 continued from
# its checkpoint. HPCRL_TEST_RUNTIME_RESUME=0 falls back to checking only the order of the links (for a
# runtime without resume).
RUNTIME_CHECKPOINTS_ON_SIGNAL = os.environ.get("HPCRL_TEST_RUNTIME_RESUME", "1") == "1"

# More steps than link 0 makes before the request that interrupts it: it is sent while the ranks start and
# acted on at the end of step 1 (see interrupt_once_started).
CHAIN_STEPS = 24

# A job with 2 ranks (controller + one worker hosting both actor roles): quick, and three fit on the node.
SMALL_JOB = """\
name: small
seed: 1
task: {name: addition, digits: 1}
algorithm: {name: grpo, group_size: 4}
train: {steps: 2, prompts_per_step: 4, lr: 0.003}
rollout: {max_new_tokens: 3}
checkpoint: {every: 0, keep: 2}
log: {tensorboard: false}
roles:
  actor_train: {parallel: {dp: 1}}
  actor_infer: {colocate_with: actor_train}
"""


def cli(args: list[str], cwd: Path, slurm_env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=cwd, env=slurm_environ(slurm_env),
                          capture_output=True, text=True, timeout=timeout)


def submitted_id(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"submitted job (\d+)", proc.stdout)
    assert match, proc.stdout
    return match.group(1)


def status_rows(run_dir: Path, cwd: Path, slurm_env) -> list[list[str]]:
    proc = cli(["status", str(run_dir)], cwd, slurm_env)
    assert proc.returncode == 0, proc.stderr
    return [ln.split() for ln in proc.stdout.splitlines()[1:] if ln and not ln.startswith(("*", "("))]


def logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.rglob("slurm-*.out")))


# --- the real runtime ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_runs(slurm_env, tmp_path_factory):
    """Submit the single run, the sweep and the chain at once (they share the node), as a user would."""
    cwd = tmp_path_factory.mktemp("submit")
    (cwd / "small.yaml").write_text(SMALL_JOB)
    single = submitted_id(cli(["submit", str(TINY), "--cluster", str(SLURM_LOCAL), "--set", "train.steps=3", *FAST],
                              cwd, slurm_env))
    sweep = submitted_id(cli(["submit", "small.yaml", "--cluster", str(SLURM_LOCAL), "--run-dir", "runs/sweep",
                              "--set", "sweep={seed: [1, 2, 3]}"], cwd, slurm_env))
    chain = submitted_id(cli(["submit", "small.yaml", "--cluster", str(SLURM_LOCAL), "--run-dir", "runs/chain",
                              "--chain", "2", "--set", f"train.steps={CHAIN_STEPS}"], cwd, slurm_env))
    interrupter = None
    if RUNTIME_CHECKPOINTS_ON_SIGNAL:
        # interrupt link 0 as soon as its ranks start (from a thread: the tests wait for other jobs meanwhile)
        interrupter = threading.Thread(target=interrupt_once_started, daemon=True,
                                       args=(cwd / "runs" / "chain", f"{chain}_0", slurm_env))
        interrupter.start()
    yield {"cwd": cwd, "single": single, "sweep": sweep, "chain": chain, "interrupter": interrupter}
    if interrupter is not None:
        interrupter.join(timeout=5)


def interrupt_once_started(run_dir: Path, job_id: str, slurm_env, timeout: float = 300) -> None:
    """Send the batch script of `job_id` SIGUSR1 (by hand, as a user asks for a checkpoint) once it has started
    its ranks: the request waits in RUN_DIR/control through their start-up (seconds), and the controller acts
    on it at the end of step 1. Waiting for a recorded step instead raced the run's end: 24 steps take 0.5 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["job_id"] == job_id and e["event"] == "start" for e in read_events(run_dir)):
            slurm_cmd(["scancel", "--batch", "--signal=USR1", job_id], slurm_env)
            return
        time.sleep(0.1)


def test_submit_runs_to_completion_and_status_reports_it(real_runs, slurm_env):
    cwd, job = real_runs["cwd"], real_runs["single"]
    run_dir = cwd / "runs" / "tiny-grpo"
    (info,) = wait_job(job, slurm_env, timeout=300, poll=1)
    assert info["JobState"] == "COMPLETED", logs(run_dir)
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    assert info["NumTasks"] == "4" and info["Requeue"] == "1"
    assert (run_dir / "slurm_hostfile").read_text().split() == [info["BatchHost"]] * 4
    assert "the run finished" in (run_dir / f"slurm-{job}.out").read_text()
    assert json.loads((run_dir / "slurm_jobs.json").read_text())[-1]["job_id"] == job
    (row,) = status_rows(run_dir, cwd, slurm_env)
    assert row[1:4] == [job, "COMPLETED", "3/3"] and row[5] == "0", row
    assert float(row[4]) == pytest.approx(read_metrics(run_dir / "metrics.jsonl")[-1]["reward_mean"], abs=1e-4)


def test_sweep_runs_one_array_task_per_combination(real_runs, slurm_env):
    cwd, job = real_runs["cwd"], real_runs["sweep"]
    root = cwd / "runs" / "sweep"
    info = wait_job(job, slurm_env, timeout=300, poll=1)
    assert sorted(j["ArrayTaskId"] for j in info) == ["0", "1", "2"]
    assert {j["JobState"] for j in info} == {"COMPLETED"}, logs(root)
    index = json.loads((root / "sweep.json").read_text())["tasks"]
    for task, seed in enumerate((1, 2, 3)):
        run_dir = root / f"sweep-{task}"
        assert index[task] == {"index": task, "run_dir": f"sweep-{task}", "overrides": {"seed": seed}}
        assert f"\nseed: {seed}\n" in (run_dir / "job.yaml").read_text()
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
        assert (run_dir / f"slurm-{job}_{task}.out").is_file()
    rows = status_rows(root, cwd, slurm_env)
    assert [r[:4] for r in rows] == [[f"runs/sweep/sweep-{t}", f"{job}_{t}", "COMPLETED", "2/2"] for t in range(3)]


def test_chain_links_run_one_after_another(real_runs, slurm_env):
    cwd, job = real_runs["cwd"], real_runs["chain"]
    run_dir = cwd / "runs" / "chain"
    # with RUNTIME_CHECKPOINTS_ON_SIGNAL, link 0 is interrupted after its first step (see real_runs): it saves,
    # exits 99, and link 1 must continue from that checkpoint
    info = {j["ArrayTaskId"]: j for j in wait_job(job, slurm_env, timeout=300, poll=1)}
    assert {t: j["JobState"] for t, j in info.items()} == {"0": "COMPLETED", "1": "COMPLETED"}, logs(run_dir)
    # the batch script's events, in the order they happened (one file, appended)
    order = [(e["job_id"], e["event"], e["action"]) for e in read_events(run_dir) if e["event"] != "signal"]
    if RUNTIME_CHECKPOINTS_ON_SIGNAL:
        assert order == [(f"{job}_0", "start", "started"), (f"{job}_0", "end", "next-link"),
                         (f"{job}_1", "start", "started"), (f"{job}_1", "end", "finished")], logs(run_dir)
        log = (run_dir / f"slurm-{job}.out").read_text()
        assert re.search(r"hpcrl: resuming from \S+ \(step \d+\)", log), log
    else:
        # link 0 trains to the end; link 1 sees that and stops at once
        assert order == [(f"{job}_0", "start", "started"), (f"{job}_0", "end", "finished"),
                         (f"{job}_1", "skipped", "finished-earlier")], logs(run_dir)
    assert info["1"]["StartTime"] >= info["0"]["EndTime"]      # %1: never side by side
    # every step once: the resumed link cut the metrics back to its checkpoint before going on
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, CHAIN_STEPS + 1))
    rows = status_rows(run_dir, cwd, slurm_env)
    done = f"{CHAIN_STEPS}/{CHAIN_STEPS}"
    assert [r[1:4] for r in rows] == [[f"{job}_0", "COMPLETED", done], [f"{job}_1", "COMPLETED", done]]


# --- the batch script's side of the contract, with a stand-in runtime ---------------------------------

STAND_IN = r"""#!/bin/bash
# STAND-IN for `python -m hpcrl.runtime` (see the module docstring): one process per rank.
[ "$2" = hpcrl.launch.shm ] && exit 0   # the batch script's clean-up step after the ranks: nothing to clean here
run_dir=""
args=("$@")
while [ $# -gt 0 ]; do case "$1" in --run-dir) run_dir=$2; shift 2 ;; *) shift ;; esac; done
rank=${PMI_RANK:-${SLURM_PROCID:-0}}   # hydra ranks inherit the SLURM_PROCID of its proxy
restart=${SLURM_RESTART_COUNT:-0}
link=${SLURM_ARRAY_TASK_ID:-0}
cd "$run_dir" || exit 2
# as the controller does once MPI has joined every rank: a later failure is worth a restart
[ "$rank" = 0 ] && mkdir -p ranks && touch "ranks/world-$SLURM_JOB_ID"
[ "$rank" = 0 ] && printf '%s\0' "${args[@]}" >argv
printf '%s' "$HOSTILE" >"hostile.$rank"
echo "rank $rank restart $restart link $link mode $STANDIN_MODE" >>standin.log
wait_for_requeue() {   # the batch script writes the warning's request into RUN_DIR/control
  touch "ready.$rank.$restart.$link"
  for _ in $(seq 1 600); do [ "$(cut -d' ' -f1 control 2>/dev/null)" = requeue ] && return 0; sleep 0.1; done
  echo "rank $rank: no requeue request arrived" >>standin.log
  exit 1
}
case "$STANDIN_MODE" in
  preempt)   # first run: checkpoint on the warning and exit 99; after the requeue: resume and finish
    if [ "$restart" = 0 ]; then
      wait_for_requeue
      [ "$rank" = 0 ] && echo "saved by restart 0" >checkpoint
      exit 99
    fi
    [ "$rank" = 0 ] && echo "resumed from: $(cat checkpoint)" >>standin.log
    exit 0 ;;
  slow-step) # first run: a step that outlasts the warning's lead (SIGTERM only flags a request, as the ranks'
    if [ "$restart" = 0 ]; then
      trap '' TERM
      touch "ready.$rank.$restart.$link"
      sleep 120
      exit 1
    fi
    exit 0 ;;
  fail-once) [ "$restart" = 0 ] && [ "$rank" = 0 ] && exit 3; exit 0 ;;
  fail-always) [ "$rank" = 0 ] && exit 3; exit 0 ;;
  chain)     # link 0 is interrupted; link 1 continues from its checkpoint
    if [ "$link" = 0 ]; then
      wait_for_requeue
      [ "$rank" = 0 ] && echo "saved by link 0" >checkpoint
      exit 99
    fi
    [ "$rank" = 0 ] && echo "link $link resumed from: $(cat checkpoint)" >>standin.log
    exit 0 ;;
  *) exit 0 ;;
esac
"""

HOSTILE = "$(touch PWNED) `touch PWNED` ' \" ; exit 7 # \\ \n second line $HOME"


def stand_in_profile(tmp_path: Path, mode: str, launcher: str = "srun", max_restarts: int = 1,
                     signal: str = "B:USR2@60") -> Path:
    # the interpreter path has a space and a command substitution: it must reach srun as one word
    program = tmp_path / "stand in $(touch PWNED)" / "runtime"
    program.parent.mkdir(parents=True, exist_ok=True)
    program.write_text(STAND_IN)
    program.chmod(0o755)
    slurm = {"partition": "debug", "time": "00:05:00", "signal": signal, "mpi": "pmi2", "launcher": launcher,
             "python": str(program), "straggler_timeout": 30, "env": {"STANDIN_MODE": mode, "HOSTILE": HOSTILE}}
    if launcher == "mpiexec":
        slurm["mpiexec"] = str(Path(sys.executable).parent / "mpiexec")
    profile = {"name": f"stand-in-{mode}", "scheduler": "slurm", "nodes": 1, "devices_per_node": 4, "device": "cpu",
               "device_memory_gb": 4, "max_restarts": max_restarts, "slurm": slurm}
    path = tmp_path / "profile.yaml"
    path.write_text(json.dumps(profile))
    return path


def submit_stand_in(tmp_path: Path, slurm_env, mode: str, chain: int = 1, **profile_args):
    (tmp_path / "small.yaml").write_text(SMALL_JOB)
    (handle, *rest) = hpcrl.submit(tmp_path / "small.yaml", stand_in_profile(tmp_path, mode, **profile_args),
                                   chain=chain, run_dir=tmp_path / "run", env=slurm_environ(slurm_env), cwd=tmp_path)
    return [handle, *rest]


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.1)


def actions(run_dir: Path) -> list[tuple[str, int, str]]:
    return [(e["event"], e["restart"], e["action"]) for e in read_events(run_dir)]


def warned_once_ready(tmp_path: Path, slurm_env, mode: str, **profile_args):
    """Submit a stand-in job, send its batch script USR2 once both ranks run (as --signal=B:USR2@N would),
    and return its handle after it completed with one restart."""
    (handle,) = submit_stand_in(tmp_path, slurm_env, mode, **profile_args)
    wait_for(handle.run_dir / "ready.0.0.0")
    wait_for(handle.run_dir / "ready.1.0.0")
    slurm_cmd(["scancel", "--batch", "--signal=USR2", handle.job_id], slurm_env)
    assert handle.wait(timeout=90, poll=0.5) == "COMPLETED", logs(handle.run_dir)
    (info,) = job_info(handle.job_id, slurm_env)
    assert info["Restarts"] == "1", logs(handle.run_dir)
    return handle


def test_the_warning_reaches_the_ranks_and_exit_99_requeues(slurm_env, tmp_path):
    handle = warned_once_ready(tmp_path, slurm_env, "preempt")
    run_dir = handle.run_dir
    assert actions(run_dir) == [("start", 0, "started"), ("signal", 0, "USR2"), ("end", 0, "requeue"),
                                ("start", 1, "started"), ("end", 1, "finished")]
    assert "resumed from: saved by restart 0" in (run_dir / "standin.log").read_text()
    # the ranks got exactly the launcher's runtime command, the hostile env value arrived intact
    argv = (run_dir / "argv").read_text().split("\0")[:-1]
    assert argv == runtime_command("", run_dir / "job.yaml", f"{run_dir}/cluster.yaml", run_dir)[1:]
    for rank in (0, 1):
        assert (run_dir / f"hostile.{rank}").read_text() == HOSTILE
    assert not list(tmp_path.rglob("PWNED"))
    rows = status_rows(run_dir, tmp_path, slurm_env)
    assert rows[0][1:3] == [handle.job_id, "COMPLETED"] and rows[0][-1] == "1"


def test_a_step_that_outlasts_the_warning_is_requeued_before_the_time_limit(slurm_env, tmp_path):
    # at the limit Slurm would end it TIMEOUT, never requeued: the batch script requeues it first, and the
    # newest checkpoint stands (the warning comes 8 s before the limit: the script acts 6 s after it)
    handle = warned_once_ready(tmp_path, slurm_env, "slow-step", signal="B:USR2@8")
    run_dir = handle.run_dir
    happened = [a for a in actions(run_dir) if a[0] != "signal"]
    assert happened == [("start", 0, "started"), ("end", 0, "requeue-before-limit"),
                        ("start", 1, "started"), ("end", 1, "finished")], logs(run_dir)
    assert "6 s after the warning, 2 s before the time limit: requeueing now" in logs(run_dir)


def test_failures_restart_up_to_max_restarts(slurm_env, tmp_path):
    once, always = tmp_path / "once", tmp_path / "always"
    once.mkdir(), always.mkdir()
    (h_once,) = submit_stand_in(once, slurm_env, "fail-once", max_restarts=1)
    (h_always,) = submit_stand_in(always, slurm_env, "fail-always", max_restarts=1)
    assert h_once.wait(timeout=90, poll=0.5) == "COMPLETED", logs(h_once.run_dir)
    assert actions(h_once.run_dir) == [("start", 0, "started"), ("end", 0, "restart"),
                                       ("start", 1, "started"), ("end", 1, "finished")]
    assert h_always.wait(timeout=90, poll=0.5) == "FAILED", logs(h_always.run_dir)
    (info,) = job_info(h_always.job_id, slurm_env)
    assert info["ExitCode"] == "3:0" and info["Restarts"] == "1"
    assert actions(h_always.run_dir) == [("start", 0, "started"), ("end", 0, "restart"),
                                         ("start", 1, "started"), ("end", 1, "failed")]


def test_chain_link_hands_over_to_the_next_after_a_checkpoint(slurm_env, tmp_path):
    link0, link1 = submit_stand_in(tmp_path, slurm_env, "chain", chain=2)
    run_dir = link0.run_dir
    assert (link0.job_id, link1.job_id) == (f"{link0.array_job_id}_0", f"{link0.array_job_id}_1")
    wait_for(run_dir / "ready.0.0.0")
    wait_for(run_dir / "ready.1.0.0")
    assert link1.state() == "PENDING"                      # %1: the second link waits for the first
    slurm_cmd(["scancel", "--batch", "--signal=USR1", link0.job_id], slurm_env)
    assert link0.wait(timeout=60, poll=0.5) == "COMPLETED"
    assert link1.wait(timeout=60, poll=0.5) == "COMPLETED", logs(run_dir)
    assert [(e["job_id"], e["action"]) for e in read_events(run_dir) if e["event"] != "signal"] == [
        (link0.job_id, "started"), (link0.job_id, "next-link"), (link1.job_id, "started"), (link1.job_id, "finished")]
    assert "link 1 resumed from: saved by link 0" in (run_dir / "standin.log").read_text()


def test_mpiexec_launcher_inside_the_allocation(slurm_env, tmp_path):
    (handle,) = submit_stand_in(tmp_path, slurm_env, "plain", launcher="mpiexec")
    assert handle.wait(timeout=60, poll=0.5) == "COMPLETED", logs(handle.run_dir)
    hostname = (handle.run_dir / "slurm_hostfile").read_text().strip()
    assert re.fullmatch(r"\S+:2", hostname)
    for rank in (0, 1):
        assert (handle.run_dir / f"hostile.{rank}").read_text() == HOSTILE
