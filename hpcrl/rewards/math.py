"""Rule-based reward for tasks whose answer is a number: the exact answer, then a stop, earns 1.0.

Partial credit counts digits right in their place value (aligned from the units), which gives a
random policy a little reward and GRPO a gradient before the first exact answer is found, without
a prompt-independent shortcut: the units digit of a sum is spread evenly over the prompts, whereas
left-aligned credit would reward always answering "1" (the first digit of every sum from 10 on).
"""
from __future__ import annotations


def answer_reward(response: str, answer: str, stopped: bool, partial_credit: float = 0.5) -> float:
    """1.0 for the exact answer followed by a stop; else `partial_credit` times the share of places right."""
    if response == answer and stopped:
        return 1.0
    hits = sum(1 for got, want in zip(reversed(response), reversed(answer)) if got == want)
    return partial_credit * hits / max(len(response), len(answer), 1)
