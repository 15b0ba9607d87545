"""Shared fixtures: paths, and the real local Slurm (see slurm_cluster.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import slurm_env  # noqa: F401  (a session fixture, re-exported for every test module)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    return REPO


def hpcrl(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `hpcrl` command line (as a user would) and capture its output."""
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=cwd or REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def random_files(job, tokenizer, directory: Path):
    """The job's seeded random model as HF files under `directory`, as the controller writes it."""
    from hpcrl.engines.model_files import ModelFiles, write_random_init

    return ModelFiles(write_random_init(job, tokenizer, directory))


def run_mpi_program(compute, merge, out: Path, root: int = 0) -> None:
    """The body of a test module's MPI program (what `mpi_findings` runs): torch.distributed over gloo
    on every rank, one thread each; `compute(rank)` on every rank (an exception is printed and aborts
    the world: the other ranks would wait in a collective forever); the ranks' results gathered to
    `root`, which writes `merge(results)` to `out` as JSON. Rank 0 hosts the rendezvous store, so
    every rank waits for the others before leaving. The ranks' temporary files go beside `out`, in
    pytest's temporary directory, which pytest prunes (not in /tmp, run after run)."""
    import json
    import tempfile

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcrl.runtime.mpi_world import init_torch_distributed

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    tempfile.tempdir = str(out.parent)
    torch.set_num_threads(1)
    init_torch_distributed("gloo")
    try:
        found = compute(rank)
    except BaseException:
        import traceback

        traceback.print_exc()
        comm.Abort(1)
        raise
    everyone = comm.gather(found, root=root)
    if rank == root:
        out.write_text(json.dumps(merge(everyone)))
    dist.barrier()
    dist.destroy_process_group()


def mpi_findings(script: str, ranks: int, out: Path, timeout: float = 600) -> dict:
    """Run `script` as a real MPI program of `ranks` ranks (it writes its findings to `out` as JSON,
    from one rank) and return them; a failed rank fails the test with the ranks' output."""
    import json

    from hpcrl.launch.local import mpiexec_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([mpiexec_path(), "-n", str(ranks), sys.executable, script, str(out)], capture_output=True,
                            text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return json.loads(out.read_text())
