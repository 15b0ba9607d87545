"""The local Slurm cluster (scripts/slurm-local) really runs what hpcrl's jobs need:
batch jobs, job arrays, requeue after SIGUSR1, and MPI ranks started by srun --mpi=pmi2 or by
hydra's mpiexec inside the allocation."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_cluster import job_info, job_output_lines, sbatch, slurm_cmd, slurm_env, wait_job  # noqa: F401

PYTHON = sys.executable
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")

MPI_SCRIPT = textwrap.dedent(
    """\
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank() + 1, op=MPI.SUM)
    print(f"rank={comm.Get_rank()} size={comm.Get_size()} sum={total}", flush=True)
    """
)


def _wait_for_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)


def test_wrap_job_completes(slurm_env, tmp_path):
    out = tmp_path / "wrap-%j.out"
    job = sbatch(["-o", str(out), "-D", str(tmp_path), "--wrap",
                  "echo hello from job $SLURM_JOB_ID on $SLURM_JOB_PARTITION"], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=20)
    assert info["JobState"] == "COMPLETED", info
    assert info["ExitCode"] == "0:0"
    assert (tmp_path / f"wrap-{job}.out").read_text().strip() == f"hello from job {job} on debug"
    # sacct cannot answer here (no slurmdbd); the job-completion log records the job instead
    jobcomp = Path(slurm_env["HPCRL_SLURM_DIR"], "log", "jobcomp.txt").read_text()
    assert f"JobId={job} " in jobcomp and "JobState=COMPLETED" in jobcomp


def test_sacct_is_unavailable_locally(slurm_env):
    with pytest.raises(RuntimeError, match="accounting storage is disabled"):
        slurm_cmd(["sacct", "-n", "-X"], slurm_env)


def test_job_array_runs_every_task(slurm_env, tmp_path):
    job = sbatch(["--array=0-2", "-o", str(tmp_path / "arr-%A_%a.out"), "-D", str(tmp_path),
                  "--wrap", "echo task=$SLURM_ARRAY_TASK_ID of=$SLURM_ARRAY_TASK_COUNT"], slurm_env)
    info = wait_job(job, slurm_env, timeout=30)
    assert sorted(j["ArrayTaskId"] for j in info) == ["0", "1", "2"]
    assert {j["JobState"] for j in info} == {"COMPLETED"}
    for task in range(3):
        text = (tmp_path / f"arr-{job}_{task}.out").read_text().strip()
        assert text == f"task={task} of=3"


def test_requeue_after_usr1_resumes_with_restart_count(slurm_env, tmp_path):
    # As a checkpointing job does on a preemption notice: trap SIGUSR1, save, requeue itself,
    # then on the second run (SLURM_RESTART_COUNT=1) resume from what it saved and finish.
    script = tmp_path / "requeue.sh"
    script.write_text(textwrap.dedent(
        """\
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --open-mode=append
        #SBATCH --time=2
        restart=${SLURM_RESTART_COUNT:-0}
        echo "start restart=$restart"
        if [ "$restart" -ge 1 ]; then
            echo "resumed from: $(cat marker)"
            exit 0
        fi
        trap 'echo "checkpoint at restart=$restart" > marker; scontrol requeue "$SLURM_JOB_ID"; echo requeued; exit 0' USR1
        touch ready
        for i in $(seq 1 200); do sleep 0.1 & wait $!; done
        echo "no USR1 arrived"
        exit 1
        """
    ))
    out = tmp_path / "requeue.out"
    job = sbatch(["-o", str(out), "-D", str(tmp_path), str(script)], slurm_env)
    _wait_for_file(tmp_path / "ready", timeout=20)
    slurm_cmd(["scancel", "--signal=USR1", "--batch", job], slurm_env)
    # a requeued job may start again after AuthInfo cred_expire (5 s in slurm-local)
    (info,) = wait_job(job, slurm_env, timeout=40)
    assert info["JobState"] == "COMPLETED", info
    assert info["Restarts"] == "1"
    assert (tmp_path / "marker").read_text().strip() == "checkpoint at restart=0"
    # `scontrol requeue` ends the running script itself (slurmstepd logs "CANCELLED ... DUE TO
    # JOB REQUEUE" and sends SIGTERM): whatever the job must save has to be saved before it.
    lines = [ln for ln in job_output_lines(out.read_text()) if ln != "requeued"]
    assert lines == ["start restart=0", "start restart=1",
                     "resumed from: checkpoint at restart=0"], out.read_text()


def _mpi_job(slurm_env, tmp_path, name: str, launch: str) -> list[str]:
    pytest.importorskip("mpi4py")
    script = tmp_path / "allreduce.py"
    script.write_text(MPI_SCRIPT)
    out = tmp_path / f"{name}.out"
    job = sbatch(["-n", "4", "--time=2", "-o", str(out), "-D", str(tmp_path),
                  "--wrap", f"{launch} {PYTHON} {script}"], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=40)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", f"{info}\n{text}"
    # hydra forwards the ranks' stdout without keeping lines apart: match records, not lines
    return sorted(re.findall(r"rank=\d+ size=\d+ sum=\d+", text))


def test_srun_pmi2_starts_one_mpi_world(slurm_env, tmp_path):
    # Slurm's PMI2 plugin wires up the pip `mpich` wheel's ranks: this is how hpcrl launches.
    lines = _mpi_job(slurm_env, tmp_path, "pmi2", "srun --mpi=pmi2 -n 4")
    assert lines == [f"rank={r} size=4 sum=10" for r in range(4)]


def test_mpiexec_inside_allocation_starts_one_mpi_world(slurm_env, tmp_path):
    # hydra's mpiexec (from the wheel) reads the allocation and starts its proxy through srun.
    if not os.access(MPIEXEC, os.X_OK):
        pytest.skip(f"no mpiexec beside {PYTHON}")
    lines = _mpi_job(slurm_env, tmp_path, "hydra", f"{MPIEXEC} -n 4")
    assert lines == [f"rank={r} size=4 sum=10" for r in range(4)]


def test_srun_without_mpi_plugin_gives_singletons(slurm_env, tmp_path):
    # The pitfall to guard against: MpiDefault=none, so plain `srun -n 4` starts four
    # unconnected MPI worlds of size 1. Launchers must pass --mpi explicitly and the runtime
    # should check that the world size matches SLURM_NTASKS.
    lines = _mpi_job(slurm_env, tmp_path, "none", "srun -n 4")
    assert lines == ["rank=0 size=1 sum=1"] * 4
