"""Ending a generation round early: after `rollout.max_round_s`, or when the controller says so.

With `rollout.partial_rollout` and K>0 the controller interrupts the round in flight as soon as the
trainer has staged newer weights (ROLL's and AReaL's partial rollout): the replicas stop between two
decoding steps and return what they have, the weights are pushed, and the next round continues the
unfinished responses with them. An interrupt names its round, (batch, round index): one that arrives
after its round has ended is read by the next round and ignored there.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from hpcrl.runtime.messages import TAG_INTERRUPT
from hpcrl.runtime.mpi_world import CONTROLLER, poll_recv, send

RoundKey = tuple[int, int]   # (batch, round index)


def interrupt(ranks: list[int], key: RoundKey) -> None:
    """Controller: ask the replicas (their result ranks) to end round `key` now."""
    for rank in ranks:
        send(key, rank, TAG_INTERRUPT)


def _interrupted(key: RoundKey) -> bool:
    """Worker: whether an interrupt of round `key` has arrived (reading, and dropping, any older one)."""
    hit = False
    while (message := poll_recv(source=CONTROLLER, tag=TAG_INTERRUPT, timeout=0)) is not None:
        hit = hit or tuple(message[0]) == key
    return hit


def round_stop(max_round_s: float | None, key: RoundKey | None) -> Callable[[], bool] | None:
    """Worker: the `stop` test a generation engine checks between decoding steps, true once the
    round's time is up or the controller interrupted round `key` (None: an uninterruptible call)."""
    if max_round_s is None and key is None:
        return None
    deadline = None if max_round_s is None else time.monotonic() + max_round_s
    stopped = False

    def stop() -> bool:
        nonlocal stopped
        stopped = stopped or (deadline is not None and time.monotonic() > deadline) or (
            key is not None and _interrupted(key))
        return stopped

    return stop
