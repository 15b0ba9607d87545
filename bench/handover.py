"""A call's hand-over between two ranks of this machine: the round trip of a small message through
hpcrl's waiting receive (mpi_world.poll_recv: probe, then sleep with back-off), with and without the
doorbells (hpcrl.runtime.doorbell), after the receiver has waited 0, 3 and 20 ms (the back-off has
grown by then, as a worker's has while the controller prepares its next call).

Prints the median and 90th percentile round trip in ms, and the ratio without/with doorbells.

    .venv/bin/python bench/handover.py [--repeats 200]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GAPS_S = (0.0, 0.003, 0.02)


def measure(repeats: int, bells: bool) -> list[tuple[float, float]]:
    """The MPI program: rank 0 sends, rank 1 answers at once; round trips timed on rank 0."""
    from hpcrl.runtime.mpi_world import COMM, open_doorbells, poll_recv, send

    if bells:
        open_doorbells()
    rank, found = COMM.Get_rank(), []
    for gap in GAPS_S:
        times = []
        for i in range(repeats):
            if rank == 0:
                time.sleep(gap)
                started = time.perf_counter()
                send(i, 1, 5)
                poll_recv(source=1, tag=6)
                times.append((time.perf_counter() - started) * 1e3)
            else:
                poll_recv(source=0, tag=5)
                send(i, 0, 6)
        times.sort()
        if rank == 0:
            found.append((times[len(times) // 2], times[int(len(times) * 0.9)]))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--child", choices=("poll", "bells"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        found = measure(args.repeats, args.child == "bells")
        if found:   # rank 0
            print(json.dumps(found), flush=True)
        return 0
    from hpcrl.launch.local import mpiexec_path

    results = {}
    for mode in ("poll", "bells"):
        out = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, __file__, "--child", mode, "--repeats",
                              str(args.repeats)], env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                             capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    print(f"{'waited ms':>10}{'poll median':>13}{'p90':>8}{'bells median':>14}{'p90':>8}{'poll/bells':>12}")
    for gap, (poll, poll90), (bell, bell90) in zip(GAPS_S, results["poll"], results["bells"]):
        print(f"{gap * 1e3:>10.0f}{poll:>13.3f}{poll90:>8.3f}{bell:>14.3f}{bell90:>8.3f}{poll / bell:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
