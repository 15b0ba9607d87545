"""The MPI world and the torch.distributed world over it, and how a failure takes both down."""
from __future__ import annotations

import functools
import os
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcrl.runtime import doorbell
from hpcrl.runtime.messages import TAG_ERROR, ErrorReport

COMM = MPI.COMM_WORLD
CONTROLLER = 0


_PICKLE = MPI.Pickle()
_SEND_LOCK = threading.Lock()   # a framed message's parts leave together, whichever thread sends
_SENDING: list[tuple[list[MPI.Request], tuple]] = []   # sends in progress, and the buffers they read


@dataclass
class Traffic:
    """Bytes and messages this rank has sent over MPI (headers, pickles and out-of-band buffers)."""

    bytes: int = 0
    messages: int = 0


TRAFFIC = Traffic()
# The longest sleep between two probes of a waiting receive: every call's hand-over waits up to this
# on each side. Tiny job, 100 steps, 4 ranks on 2 cores: 5 ms 1580 samples/s, 1 ms 1940, 0.3 ms 1710
# (the probing itself then takes the cores the busy ranks need).
POLL_MAX_SLEEP_S = 1e-3
# How long an aborting rank waits between printing its cause and MPI_Abort. The launcher forwards a
# rank's stderr and its abort request on separate channels (hydra: a pipe and the PMI socket), and
# it may end the world before it forwards the line: the CI once lost the controller's cause of a
# killed rank, leaving only "the cause is printed above by rank 0" with nothing above it.
ABORT_FLUSH_S = 0.5


def send(obj: Any, dest: int, tag: int, wait: bool = False) -> int:
    """Send `obj` as one framed message: its pickle (protocol 5) and, out of band, every buffer it
    holds (numpy arrays: token columns) as raw MPI messages, with no copy into the pickle. Returns
    the bytes sent. The sends are non-blocking (a large message to a busy rank would otherwise hold
    the controller until that rank reads it) and `poll_recv` completes them; `wait` completes this
    one before returning (a worker's reply: its next call may leave MPI alone for a long time, and
    the controller is reading). Thread-safe: a worker's threads send too."""
    data, buffers = _PICKLE.dumps_oob(obj)
    views = [memoryview(b).cast("B") for b in buffers]
    header = np.array([len(data)] + [v.nbytes for v in views], dtype=np.int64)
    with _SEND_LOCK:
        requests = [COMM.Isend(part, dest=dest, tag=tag) for part in (header, data, *views)]
        entry = (requests, (header, data, views))
        _SENDING.append(entry)
        sent = header.nbytes + int(header.sum())
        TRAFFIC.bytes += sent
        TRAFFIC.messages += 1
    doorbell.ring(dest, tag)
    _progress()
    while wait and any(e is entry for e in _SENDING):
        time.sleep(1e-4)
        _progress()
    return sent


def _progress() -> None:
    """Let go of the sends that have completed (and of the buffers they kept alive)."""
    with _SEND_LOCK:
        _SENDING[:] = [(requests, kept) for requests, kept in _SENDING if not MPI.Request.Testall(requests)]


def wait_sends() -> None:
    """Complete every send in progress (before the world ends)."""
    with _SEND_LOCK:
        for requests, _ in _SENDING:
            MPI.Request.Waitall(requests)
        _SENDING.clear()


def poll_recv(source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG,
              timeout: float | None = None) -> tuple[Any, int, int] | None:
    """Receive one framed message (see `send`) without spinning: probe, then sleep with back-off
    up to POLL_MAX_SLEEP_S. Returns (object, source, tag), or None when `timeout` seconds pass first.

    Ranks are often oversubscribed (4 ranks on 2 cores here, or idle ranks beside busy ones on a
    GPU node); a blocking MPI receive busy-polls and would steal the CPU the busy ranks need. The
    sleep ends early when a rank on this host sends (hpcrl.runtime.doorbell).
    The rest of a message is received from the header's source and tag: MPI keeps messages from
    one sender on one tag in order, and each (source, tag) has one receiving thread.
    """
    status = MPI.Status()
    delay = 1e-4
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        # twice: MPICH's probe first moves what has arrived into its queues, and only a second one
        # matches it (one probe a wake-up saw a reply on the third wake: 3.3 ms a round trip, not 1.1)
        message = (COMM.Improbe(source=source, tag=tag, status=status)
                   or COMM.Improbe(source=source, tag=tag, status=status))
        if message is not None:
            break
        if _SENDING:
            _progress()
        if deadline is not None and time.monotonic() >= deadline:
            return None
        doorbell.wait(tag, delay)
        delay = 1e-4 if _SENDING else min(delay * 2, POLL_MAX_SLEEP_S)   # sends in progress need MPI's attention
    source, tag = status.Get_source(), status.Get_tag()
    header = np.empty(status.Get_count(MPI.INT64_T), dtype=np.int64)
    message.Recv(header)
    parts = [bytearray(int(n)) for n in header]
    for part in parts:
        COMM.Recv(part, source=source, tag=tag)
    return _PICKLE.loads_oob(parts[0], parts[1:]), source, tag


def barrier() -> None:
    """MPI_Barrier without spinning (see poll_recv): ranks that arrive early sleep, so the one still
    working (writing the initial weights, importing its engine) gets the cores."""
    request = COMM.Ibarrier()
    delay = 1e-4
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def queued(source: int = MPI.ANY_SOURCE, tag: int = MPI.ANY_TAG) -> bool:
    """Whether a message is waiting to be received (probed twice, as in poll_recv)."""
    return bool(COMM.Iprobe(source=source, tag=tag) or COMM.Iprobe(source=source, tag=tag))


def abort(message: str, code: int = 1) -> None:
    """Print on this rank and end every rank of the world now."""
    print(message, file=sys.stderr, flush=True)
    time.sleep(ABORT_FLUSH_S)
    COMM.Abort(code)
    os._exit(code)  # MPI_Abort may return before the process manager kills this rank: never go on


def leave(code: int | None) -> None:
    """End this rank once its work is done, without the collector's pass over every object at
    interpreter exit: with torch and transformers loaded that teardown took 0.85 s a process (0.15 s
    frozen), and the tiny job's 4 ranks on 2 cores spent 1.7 s after their last word. MPI is
    finalized as usual, at exit (ending a rank with os._exit, even after MPI_Finalize, made
    mpiexec kill the world)."""
    import gc

    gc.disable()
    gc.freeze()
    sys.exit(code)


def report_and_wait(role: str, method: str) -> None:
    """On a worker: send the current exception to the controller, which aborts the world.

    If the controller does not abort within 20 s (it may be stuck itself), abort from here.
    """
    report = ErrorReport(COMM.Get_rank(), role, method, traceback.format_exc())
    send(report, CONTROLLER, TAG_ERROR)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:   # keep the report's send going while the controller reads it
        _progress()
        time.sleep(0.05)
    abort(report.describe())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def require_threads() -> None:
    """The weight server and the heartbeat use MPI from threads of their own: MPI must allow it."""
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("this MPI library gives less than MPI_THREAD_MULTIPLE, which hpcrl's threads need "
                           "(the heartbeat, the weight server); for Cray MPICH set MPICH_MAX_THREAD_SAFETY=multiple, "
                           "for Open MPI use a build with thread support")


def init_torch_distributed(backend: str, timeout_s: float = 300.0) -> None:
    """Start torch.distributed on the same ranks as MPI; rank 0 publishes the rendezvous address."""
    import torch.distributed as dist

    address = None
    if COMM.Get_rank() == CONTROLLER:
        address = (socket.gethostname() if COMM.Get_size() > 1 else "127.0.0.1", free_port())
    host, port = COMM.bcast(address, root=CONTROLLER)
    if _same_host_everywhere():
        host = "127.0.0.1"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=COMM.Get_rank(),
                            world_size=COMM.Get_size(), timeout=timedelta(seconds=timeout_s))


@functools.cache
def _placement() -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Every rank's host name (by name: MPI's shared-memory split is not reliable under every
    launcher; with srun's PMI2 and the pip MPICH it put each rank on its own) and the cores it may
    run on, in rank order. Gathered once: the first call is collective, and every rank makes it at
    the same point of its start (the doorbells, the threads per rank and the rendezvous address all
    ask)."""
    cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return tuple(COMM.allgather((socket.gethostname(), cores)))


def _hosts() -> tuple[str, ...]:
    return tuple(host for host, _ in _placement())


def _same_host_everywhere() -> bool:
    return len(set(_hosts())) == 1


def open_doorbells() -> None:
    """Collective: from now on a message sent to a rank on the same host wakes it at once
    (hpcrl.runtime.doorbell); the bells are named after a world id rank 0 draws. Linux only (its
    abstract socket namespace); elsewhere waiting receives probe and sleep as before."""
    world = COMM.bcast(uuid.uuid4().hex[:16] if COMM.Get_rank() == CONTROLLER else None, root=CONTROLLER)
    hosts, here = _hosts(), socket.gethostname()
    if sys.platform.startswith("linux"):
        try:
            doorbell.install(doorbell.Doorbells(world, COMM.Get_rank(), {r for r, h in enumerate(hosts) if h == here},
                                                MPI.ANY_TAG))
        except OSError:   # no Unix sockets here (a sandbox): probe and sleep
            pass


def worker_cores(index: int, workers: int, cores: tuple[int, ...]) -> tuple[int, ...] | None:
    """The cores of the `index`-th of `workers` worker ranks that share `cores`: an equal contiguous
    share each, or None (left to the OS) where the workers outnumber the cores."""
    share = len(cores) // workers
    return cores[index * share:(index + 1) * share] if share else None


def bind_workers_to_cores(bind: bool) -> None:
    """A CPU run's worker ranks each on cores of their own, where the host has a core per worker
    and the launcher bound none (mpiexec here; srun --cpu-bind binds itself). The tiny colocated
    job's step: 52.4 against 55.1 ms unbound (seven alternated pairs, 5 of them faster). The
    controller (rank 0, which takes no slot) runs wherever a core is free, and so does a worker
    whose child processes need the other cores (`bind` false: env pools, reward sandboxes). Where
    the workers outnumber the cores the OS balances them better: the long-tail job at
    max_staleness 1, its rollout rank sharing a core with a trainer, made 7% fewer samples/s bound.
    Binds the calling thread and the threads it starts later (torch's intra-op pool among them); the
    heartbeat thread started before keeps every core. Collective (where it makes the first gather of
    the ranks' placement)."""
    rank, placement = COMM.Get_rank(), _placement()
    if rank == CONTROLLER or not bind or not hasattr(os, "sched_setaffinity"):
        return
    here, mine = placement[rank]
    workers = [r for r, (host, _) in enumerate(placement) if host == here and r != CONTROLLER]
    if any(placement[r][1] != mine for r in workers):   # bound already
        return
    cores = worker_cores(workers.index(rank), len(workers), mine)
    if cores is not None:
        os.sched_setaffinity(0, cores)


def set_cpu_threads() -> None:
    """Share this rank's cores among the ranks of its host that may run on them too, so
    oversubscribed ranks don't thrash: under mpiexec every rank may use every core (cores / ranks
    each), under srun --cpus-per-task=N each has N of its own (N each, as OMP_NUM_THREADS=N in a
    profile means). Either way a rank's count is its share of the cores, so a run on a host
    computes the same under both launchers."""
    import torch

    placement = _placement()
    here, mine = placement[COMM.Get_rank()]
    cores = len(mine) or os.cpu_count() or 1   # no affinity masks on this platform: the host's cores
    torch.set_num_threads(max(1, cores // sharing_ranks(placement, here, mine)))


def sharing_ranks(placement: Sequence[tuple[str, tuple[int, ...]]], host: str, cores: tuple[int, ...]) -> int:
    """How many ranks (this one among them) may run on `cores` of `host` (no cores: a platform
    without affinity masks, where every rank of the host may run anywhere)."""
    return sum(1 for other_host, theirs in placement if other_host == host and (not cores or set(theirs) & set(cores)))
