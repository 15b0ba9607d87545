"""Rule-based reward for tasks whose answer is a number: the exact answer, then a stop, earns 1.0.

Partial credit per position right (the stop counts as a position after the last digit) gives a
random policy a little reward and GRPO a gradient to climb before the first exact answer is found.
"""
from __future__ import annotations

import numpy as np

from hpcrl.ragged import Ragged

STOP = "\0"


def answer_reward(response: str, answer: str, stopped: bool, partial_credit: float = 0.5) -> float:
    """1.0 for the exact answer followed by a stop; else `partial_credit` times the share of positions right."""
    if response == answer and stopped:
        return 1.0
    got = response + (STOP if stopped else "")
    want = answer + STOP
    hits = sum(1 for g, w in zip(got, want) if g == w)
    return partial_credit * hits / max(len(got), len(want))


def score_responses(tokenizer, responses: Ragged, answers: list[str]) -> np.ndarray:
    """Rewards (float64) for a batch of generated token ids (a response stopped if it ends with `<eos>`)."""
    return np.array([answer_reward(tokenizer.decode(r.tolist()), a,
                                   stopped=len(r) > 0 and int(r[-1]) == tokenizer.eos_token_id)
                     for r, a in zip(responses, answers)], dtype=np.float64)
