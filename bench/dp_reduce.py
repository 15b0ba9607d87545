"""All-reduce over two ranks of this machine: gloo (torch.distributed on CPU) against MPI, the
path hpcrl.engines.dp_reduce takes for a CPU data-parallel group's counts and gradients.

Prints microseconds per all-reduce of 1 number (the trainers' token and micro-batch counts), 1000,
75k (the tiny job's 300 KB gradient) and 1M float32 values, and gloo's time over MPI's.

    .venv/bin/python bench/dp_reduce.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SIZES = (1, 1000, 75_000, 1_000_000)


def measure(repeats: int) -> None:
    """The MPI program: both reductions of each size, timed on rank 0."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcrl.runtime.mpi_world import init_torch_distributed

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_torch_distributed("gloo")

    def timed(reduce) -> float:
        for _ in range(10):
            reduce()
        comm.Barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            reduce()
        return (time.perf_counter() - started) / repeats * 1e6

    if comm.Get_rank() == 0:
        print(f"{'values':>10}{'gloo us':>10}{'MPI us':>10}{'gloo/MPI':>10}")
    for size in SIZES:
        tensor = torch.ones(size)
        array = np.ones(size, np.float32)
        gloo = timed(lambda: dist.all_reduce(tensor))
        mpi = timed(lambda: comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM))
        if comm.Get_rank() == 0:
            print(f"{size:>10}{gloo:>10.0f}{mpi:>10.0f}{gloo / mpi:>10.1f}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure(args.repeats)
        return 0
    from hpcrl.launch.local import mpiexec_path

    return subprocess.run([mpiexec_path(), "-n", "2", sys.executable, __file__, "--child", "--repeats",
                           str(args.repeats)], env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


if __name__ == "__main__":
    sys.exit(main())
