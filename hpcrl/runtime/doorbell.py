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


class Doorbells:
    """This rank's bells, and the ringing of its peers' on the same host."""

    def __init__(self, world: str, rank: int, local_ranks: set[int], any_tag: int):
        """`world`: a name no other MPI world on the host uses; `local_ranks`: the ranks on this host."""
        self.world, self.rank, self.local_ranks, self.any_tag = world, rank, local_ranks, any_tag
        self._ringer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._ringer.setblocking(False)
        self._bells: dict[int, socket.socket] = {}
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
        bell = self._bells.get(tag)
        if bell is None:
            with self._lock:
                bell = self._bells.get(tag) or self._bind(tag)
        if select.select([bell], [], [], seconds)[0]:
            try:
                while bell.recv(64):   # every ring so far: one wake-up answers them all
                    pass
            except BlockingIOError:
                pass

    def _bind(self, tag: int) -> socket.socket:
        bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        bell.bind(self._address(self.rank, tag))
        bell.setblocking(False)
        self._bells[tag] = bell
        return bell


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
