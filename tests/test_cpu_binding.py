"""hpcrl.runtime.mpi_world.bind_workers_to_cores on a real MPI world of 3 ranks (the controller and
two workers): each worker on its own share of the host's cores where there is a core per worker,
the controller free; nothing bound where a launcher bound the ranks already."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import mpi_findings, run_mpi_program

from hpcrl.runtime.mpi_world import sharing_ranks, worker_cores

CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    return mpi_findings(__file__, 3, tmp_path_factory.mktemp("binding") / "findings.json", timeout=300)


def test_a_worker_takes_an_equal_share_of_the_cores_or_none_when_workers_outnumber_them():
    assert worker_cores(0, 2, (0, 1, 2, 3, 4)) == (0, 1)
    assert worker_cores(1, 2, (0, 1, 2, 3, 4)) == (2, 3)
    assert worker_cores(2, 3, (4, 5, 6)) == (6,)
    assert worker_cores(0, 3, (0, 1)) is None


def test_a_ranks_threads_share_its_cores_only_with_the_ranks_that_may_run_on_them():
    """set_cpu_threads divides a rank's cores by this count: under srun --cpus-per-task=8 each rank
    is bound to 8 cores of its own and keeps 8 threads (it divided them by the 9 ranks of the node,
    1 thread each); under mpiexec every rank of a host may run on every core."""
    own = [("node0", tuple(range(8 * i, 8 * i + 8))) for i in range(9)] + [("node1", tuple(range(8)))]
    assert sharing_ranks(own, "node0", tuple(range(8))) == 1
    shared = [("node0", (0, 1))] * 4 + [("node1", (0, 1))]
    assert sharing_ranks(shared, "node0", (0, 1)) == 4


@pytest.mark.skipif(len(CORES) < 2, reason="two workers need two cores to be bound")
def test_each_worker_runs_on_cores_of_its_own_and_the_controller_anywhere(findings):
    before, after = findings["unbound"]["before"], findings["unbound"]["after"]
    assert after[0] == before[0] == CORES, "the controller keeps every core"
    share = len(CORES) // 2
    assert after[1] == CORES[:share] and after[2] == CORES[share:2 * share], after


def test_ranks_a_launcher_bound_stay_as_it_bound_them(findings):
    before, after = findings["bound"]["before"], findings["bound"]["after"]
    assert after == before and before[2] == CORES[-1:], findings["bound"]


def test_a_worker_whose_processes_need_the_cores_is_not_bound(findings):
    after = findings["not_binding"]["after"]
    assert after[1] == CORES, after


def _scenario(rank: int, bind: bool, restrict: bool) -> dict:
    from hpcrl.runtime import mpi_world

    os.sched_setaffinity(0, CORES)
    if restrict and rank == 2:   # as srun --cpu-bind would
        os.sched_setaffinity(0, CORES[-1:])
    mpi_world._placement.cache_clear()
    before = sorted(os.sched_getaffinity(0))
    mpi_world.bind_workers_to_cores(bind)
    return {"before": before, "after": sorted(os.sched_getaffinity(0))}


def _rank(rank: int) -> dict:
    return {"unbound": _scenario(rank, True, False), "bound": _scenario(rank, True, True),
            "not_binding": _scenario(rank, rank != 1, False)}


def _merge(everyone: list[dict]) -> dict:
    return {name: {key: [found[name][key] for found in everyone] for key in ("before", "after")}
            for name in everyone[0]}


if __name__ == "__main__":
    run_mpi_program(_rank, _merge, Path(sys.argv[1]))
