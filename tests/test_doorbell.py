"""Doorbells (hpcrl.runtime.doorbell): a ring wakes the thread waiting on its tag, and no other."""
from __future__ import annotations

import sys
import threading
import time
import uuid

import pytest

from hpcrl.runtime.doorbell import Doorbells

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's abstract sockets")
ANY_TAG = -1


def _waiter(bells: Doorbells, tag: int) -> threading.Event:
    """A thread asleep on `tag` for a minute; the event is set when it wakes."""
    woke = threading.Event()

    def wait() -> None:
        bells.wait(tag, 60.0)
        woke.set()

    threading.Thread(target=wait, daemon=True).start()
    return woke


def _ring_until(woke: threading.Event, ring, seconds: float) -> bool:
    """Ring every 10 ms (the waiter may not have bound its bell yet) until it wakes or time is up."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ring()
        if woke.wait(0.01):
            return True
    return False


def test_a_ring_wakes_the_rank_waiting_on_that_tag_or_on_any_tag_and_no_other():
    world = uuid.uuid4().hex
    sender = Doorbells(world, 0, {0, 1, 2}, ANY_TAG)
    receiver, other = Doorbells(world, 1, {0, 1, 2}, ANY_TAG), Doorbells(world, 2, {0, 1, 2}, ANY_TAG)
    on_five, on_any, other_on_five = _waiter(receiver, 5), _waiter(other, ANY_TAG), _waiter(other, 5)
    # a ring on another tag, for another rank's bell, or to an unbound bell wakes nobody and never raises
    assert not _ring_until(on_five, lambda: (sender.ring(1, 6), sender.ring(3, 5)), 0.5)
    assert not other_on_five.is_set()
    assert _ring_until(on_five, lambda: sender.ring(1, 5), 30)
    assert not other_on_five.is_set() and not on_any.is_set()
    assert _ring_until(on_any, lambda: sender.ring(2, 7), 30)   # a message on tag 7 rings rank 2's any-tag bell
    assert not other_on_five.is_set()


def test_a_rank_on_another_host_is_not_rung():
    world = uuid.uuid4().hex
    sender, receiver = Doorbells(world, 0, {0}, ANY_TAG), Doorbells(world, 1, {1}, ANY_TAG)
    woke = _waiter(receiver, 5)
    assert not _ring_until(woke, lambda: sender.ring(1, 5), 0.5)


def test_a_bell_past_selects_descriptor_range_still_wakes_its_rank():
    """A bell made late in a process with many files open (NCCL, vLLM) waits with poll()."""
    import resource
    import socket

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("fewer than 1200 open files allowed")
    world = uuid.uuid4().hex
    filler = socket.socket()
    held = [filler.dup() for _ in range(1100)]   # the next descriptors are past 1024
    try:
        sender, receiver = Doorbells(world, 0, {0, 1}, ANY_TAG), Doorbells(world, 1, {0, 1}, ANY_TAG)
        woke = _waiter(receiver, 5)
        assert _ring_until(woke, lambda: sender.ring(1, 5), 30)
    finally:
        for sock in held:
            sock.close()
        filler.close()
