"""Doorbells: a rank waiting for an MPI message wakes as soon as a rank on its host sends one.

A waiting receive probes and sleeps (mpi_world.poll_recv), because MPI's blocking receive spins and
ranks share cores; but then every hand-over waits for the receiver's next probe, up to the back-off
cap on each side, and the tiny job has four hand-overs a step. So the sender of a message also
rings the receiver's doorbell, a Unix datagram socket in Linux's abstract namespace (no file, gone
with the process), and the receiver sleeps in select() on it instead of time.sleep: it wakes when
the message is there, and still after its back-off, to probe for messages from other hosts (which
ring no bell) or for a ring another thread read.

A bell per (rank, tag waited on): each (source, tag) has one receiving thread, so a ring is read
by the thread it is for (a worker's calls and its weight server's wait on different tags). A
message on tag t rings the receiver's bell for t and its bell for any tag; a bell nobody waits on
is not bound, and ringing it costs one refused system call.
"""
from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

_FD_SETSIZE = 1024   # glibc's: select() refuses a descriptor at or past it


class Doorbells:
    """This rank's bells, and the ringing of its peers' on the same host."""

    def __init__(self, world: str, rank: int, local_ranks: set[int], any_tag: int):
        """`world`: a name no other MPI world on the host uses; `local_ranks`: the ranks on this host."""
        self.world, self.rank, self.local_ranks, self.any_tag = world, rank, local_ranks, any_tag
        self._ringer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ringer.setblocking(False)
        self._bells: dict[int, Callable[[float], None]] = {}   # tag -> its wait
        self._lock = threading.Lock()

    def _address(self, rank: int, tag: int) -> str:
        return f"\0hpcrl-{self.world}-{rank}-{tag}"

    def ring(self, dest: int, tag: int) -> None:
        """Wake `dest` if it waits on `tag` or on any tag (after the message's send is posted)."""
        if dest not in self.local_ranks:
            return
        for waited in (tag, self.any_tag):
            try:
                self._ringer.sendto(b"\1", self._address(dest, waited))
            except OSError:   # no one waits on that bell (refused), or its queue is full: it rings already
                pass

    def wait(self, tag: int, seconds: float) -> None:
        """Sleep up to `seconds`, less if a message on `tag` is rung in meanwhile."""
        wait = self._bells.get(tag)
        if wait is None:
            with self._lock:
                wait = self._bells.get(tag) or self._bind(tag)
        wait(seconds)

    def _bind(self, tag: int) -> Callable[[float], None]:
        """The wait on `tag`'s bell, bound now (a plain sleep where this host refuses the socket).
        select() sleeps to the microsecond but takes no descriptor past FD_SETSIZE, which a bell made
        late in a process with many files open (NCCL, vLLM) may have; poll() then, to the millisecond."""
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            bell.bind(self._address(self.rank, tag))
        except OSError:
            bell.close()
            self._bells[tag] = time.sleep
            return time.sleep
        bell.setblocking(False)
        if bell.fileno() < _FD_SETSIZE:
            def rung(seconds: float) -> bool:
                return bool(select.select([bell], [], [], seconds)[0])
        else:
            poller = select.poll()
            poller.register(bell, select.POLLIN)

            def rung(seconds: float) -> bool:
                return bool(poller.poll(seconds * 1000))

        def wait(seconds: float) -> None:
            if rung(seconds):
                try:
                    while bell.recv(64):   # every ring so far: one wake-up answers them all
                        pass
                except BlockingIOError:
                    pass

        self._bells[tag] = wait
        return wait


_doorbells: Doorbells | None = None


def install(doorbells: Doorbells) -> None:
    global _doorbells
    _doorbells = doorbells


def ring(dest: int, tag: int) -> None:
    if _doorbells is not None:
        _doorbells.ring(dest, tag)


def wait(tag: int, seconds: float) -> None:
    """Sleep up to `seconds`, woken early by a ring on `tag` (plain sleep before `install`)."""
    if _doorbells is None:
        time.sleep(seconds)
    else:
        _doorbells.wait(tag, seconds)
