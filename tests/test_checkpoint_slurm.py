"""Preemption end to end on the real local Slurm: SIGUSR1 -> checkpoint -> requeue -> resume.

Separate from test_checkpoint.py because starting the cluster takes a while (skipped without it).
"""
from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

from slurm_cluster import job_output_lines, sbatch, slurm_cmd, slurm_env, wait_job  # noqa: F401

REPO = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent(
    """\
    import os, sys, time
    from pathlib import Path
    from hpcrl.checkpoint import EXIT_REQUEUE, CheckpointStore, PreemptionSignal, requeue_slurm_job

    flag = PreemptionSignal().install()
    store = CheckpointStore(Path.cwd() / "run", keep=2)
    latest = store.latest_valid("cfg")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if latest is not None:
        print(f"restart={restart} resumed at step {latest.step} ({latest.manifest.extra['reason']})", flush=True)
        sys.exit(0)
    Path("ready").touch()
    step = 0
    while not flag.requested and step < 300:
        step += 1
        time.sleep(0.1)
    tmp = store.begin(step)
    (tmp / "state.txt").write_text(str(step))
    store.commit(step, tmp, "cfg", {"world": 1}, {"reason": flag.signal_name})
    print(f"restart={restart} checkpointed on {flag.signal_name}", flush=True)
    print(f"requeued={requeue_slurm_job()}", flush=True)
    sys.exit(EXIT_REQUEUE)
    """
)


def test_sigusr1_checkpoints_requeues_and_resumes(slurm_env, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    # python is the batch shell itself (exec), so `scancel --batch` signals it and nothing else
    (tmp_path / "job.sh").write_text(f"#!/bin/bash\nexport PYTHONPATH={REPO}\nexec {sys.executable} job.py\n")
    out = tmp_path / "job.out"
    job = sbatch(["--requeue", "--open-mode=append", "--time=2", "-o", str(out), "-D", str(tmp_path),
                  str(tmp_path / "job.sh")], slurm_env)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline, f"the job did not start: {out.read_text() if out.exists() else ''}"
        time.sleep(0.1)
    slurm_cmd(["scancel", "--signal=USR1", "--batch", job], slurm_env)
    (info,) = wait_job(job, slurm_env, timeout=60)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text)
    lines = job_output_lines(text)
    assert lines[:2] == ["restart=0 checkpointed on SIGUSR1", "requeued=True"], text
    assert lines[-1].startswith("restart=1 resumed at step ") and lines[-1].endswith("(SIGUSR1)"), text
