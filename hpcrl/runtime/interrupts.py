"""Ending a generation round early: after `rollout.max_round_s`, or when the controller says so.

With `rollout.partial_rollout` and K>0 the controller interrupts a round that training is not
waiting for (only later batches' rows) as soon as the trainer has staged newer weights (ROLL's and
AReaL's partial rollout): the replicas stop between two decoding steps and return what they have,
the weights are pushed, and the next round continues the unfinished responses with them. An interrupt names its round, (batch, round index): one that arrives
after its round has ended is read by the next round and ignored there. A round that also starts the
batch after next ends by itself when the next batch's rows have all ended (per-sample hand-out).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hpcrl.runtime.messages import TAG_INTERRUPT
from hpcrl.runtime.mpi_world import CONTROLLER, poll_recv, send

RoundKey = tuple[int, int]   # (batch, round index)


def interrupt(ranks: list[int], key: RoundKey) -> None:
    """Controller: ask the replicas (their result ranks) to end round `key` now."""
    for rank in ranks:
        send(key, rank, TAG_INTERRUPT)


def drain_interrupts() -> list[RoundKey]:
    """Worker: read every interrupt that has arrived (at shutdown too: MPICH's finalize fails on a
    message never read, and an interrupt may cross its round's reply)."""
    keys = []
    while (message := poll_recv(source=CONTROLLER, tag=TAG_INTERRUPT, timeout=0)) is not None:
        keys.append(tuple(message[0]))
    return keys


def _interrupted(key: RoundKey) -> bool:
    """Worker: whether an interrupt of round `key` has arrived (dropping any older one)."""
    return key in drain_interrupts()


def round_stop(max_round_s: float | None, key: RoundKey | None,
               needed: np.ndarray | None = None) -> Callable[[np.ndarray], bool] | None:
    """Worker: the `stop(finished)` test a generation engine checks between decoding steps: true once
    the round's time is up, the controller interrupted round `key` (None: an uninterruptible call),
    or every row marked `needed` has ended (the batch training takes next is complete; the other
    rows, of a later batch, continue in the next round)."""
    if needed is not None and not needed.any():
        needed = None   # a round of later batches only: it runs to its end
    if max_round_s is None and key is None and needed is None:
        return None
    deadline = None if max_round_s is None else time.monotonic() + max_round_s
    stopped = False

    def stop(finished: np.ndarray) -> bool:
        nonlocal stopped
        stopped = (stopped or (deadline is not None and time.monotonic() > deadline)
                   or (needed is not None and bool(finished[needed].all()))
                   or (key is not None and _interrupted(key)))
        return stopped

    return stop
