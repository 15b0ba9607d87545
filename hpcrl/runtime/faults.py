"""Deliberate failures for testing recovery: `HPCRL_INJECT_FAULT=RANK:METHOD:N[:KIND]`.

The N-th call of METHOD on rank RANK raises (KIND `raise`, the default), kills the process
(`exit`: no Python cleanup, as a segfault or OOM kill would) or never returns (`hang`: the rank
stays alive and keeps its heartbeat, as in a deadlocked collective), once: a world restarted after it
(AUTOMATIC_RESTART_ENV) injects nothing, or one that starts over from step 0 would fail again at the
same call. Used by the fault-tolerance tests and by operators rehearsing a failure on a real cluster;
unset, it costs one dict lookup.
`HPCRL_INJECT_DECODE_DELAY_S=S` slows the native sampler by S seconds per decoding step, so that
tests can make a generation round outlast a timeout. `HPCRL_INJECT_BEHAVIOUR_SHIFT=D` adds D to
every behaviour log-probability rollout reports: a rollout engine whose numbers differ from the
trainer's at the same weights (as vLLM's kernels do), for the mismatch-correction tests.
"""
from __future__ import annotations

import os
import time
from collections import Counter

from hpcrl.config.constants import AUTOMATIC_RESTART_ENV

_calls: Counter[str] = Counter()


def maybe_fail(rank: int, method: str) -> None:
    spec = os.environ.get("HPCRL_INJECT_FAULT")
    if not spec or os.environ.get(AUTOMATIC_RESTART_ENV) == "1":
        return
    parts = spec.split(":")
    if len(parts) not in (3, 4) or int(parts[0]) != rank or parts[1] != method:
        return
    _calls[method] += 1
    if _calls[method] == int(parts[2]):
        if len(parts) == 4 and parts[3] == "exit":
            os._exit(3)
        if len(parts) == 4 and parts[3] == "hang":
            while True:
                time.sleep(60)
        raise RuntimeError(f"injected fault: call {parts[2]} of {method} on rank {rank} (HPCRL_INJECT_FAULT)")


def decode_delay_s() -> float:
    return float(os.environ.get("HPCRL_INJECT_DECODE_DELAY_S", "0"))


def behaviour_shift() -> float:
    return float(os.environ.get("HPCRL_INJECT_BEHAVIOUR_SHIFT", "0"))
