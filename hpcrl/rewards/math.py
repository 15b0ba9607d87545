"""Math rewards: the built-in tasks' exact number, and answers checked for equivalence with math-verify.

`number` (the addition task): the exact answer, then a stop, earns 1.0. Partial credit per position
right (the stop counts as a position after the last digit) gives a random policy a little reward
and GRPO a gradient to climb before the first exact answer is found.

`math` (datasets): the final answer (`\\boxed{}`, `####`, else the last answer math-verify reads in
a response with LaTeX math, as TRL's accuracy reward does, else the last number of plain text)
against the reference, equal when math-verify finds them mathematically equivalent (fractions,
decimals, LaTeX, units, sets), as verl's and TRL's math rewards do.
"""
from __future__ import annotations

import logging
import re
from fractions import Fraction

from hpcrl.rewards.answers import extract_answer, has_latex_math
from hpcrl.rewards.base import Response, Scored

STOP = "\0"
_PLAIN_NUMBER = re.compile(r"-?\d+(\.\d+)?")


def answer_reward(response: str, answer: str, stopped: bool, partial_credit: float = 0.5) -> float:
    """1.0 for the exact answer followed by a stop; else `partial_credit` times the share of positions right."""
    if response == answer and stopped:
        return 1.0
    got = response + (STOP if stopped else "")
    want = answer + STOP
    hits = sum(1 for g, w in zip(got, want) if g == w)
    return partial_credit * hits / max(len(got), len(want))


def number_reward(response: Response, reference: str, partial_credit: float = 0.5, require_stop: bool = False
                  ) -> Scored:
    """`answer_reward` of the built-in tasks, as a registered reward; with `require_stop` a response
    that did not stop scores 0 (task.stop_at_answer_length cuts only responses longer than their
    answer, and partial credit for their digits would pay a policy that never stops)."""
    if require_stop and not response.stopped:
        return Scored(0.0, "cut")
    reward = answer_reward(response.text, reference, response.stopped, partial_credit)
    return Scored(reward, "ok" if reward == 1.0 else "wrong")


def math_reward(response: Response, reference: str) -> Scored:
    """1.0 when the response's final answer is equivalent to `reference`; 0 otherwise ("wrong"), or
    when it gives none ("no_answer"). math-verify's own signal timeouts are off: the caller's
    time limit (base.TimeLimits) bounds the call."""
    from math_verify import parse, verify

    answer = extract_answer(response.text)
    if answer is None:
        return Scored(0.0, "no_answer")
    if _PLAIN_NUMBER.fullmatch(answer) and _PLAIN_NUMBER.fullmatch(reference.strip()):
        # the common case, 100x faster than sympy: two plain numbers are equal or not (exactly: as
        # floats, 12345678901234567891 would equal 12345678901234567890)
        return Scored(1.0, "ok") if Fraction(answer) == Fraction(reference) else Scored(0.0, "wrong")
    logging.getLogger("math_verify").setLevel(logging.ERROR)   # its notice that its own timeouts are off
    gold = parse(_as_latex(reference), parsing_timeout=None)
    found = parse(_as_latex(answer), parsing_timeout=None)
    if not found:
        return Scored(0.0, "no_answer")
    return Scored(1.0, "ok") if verify(gold, found, timeout_seconds=None) else Scored(0.0, "wrong")


number_reward.deterministic = math_reward.deterministic = True   # score_batch scores a repeat once


def _as_latex(answer: str) -> str:
    """math-verify reads LaTeX math between delimiters; an answer without any is wrapped so it parses as one."""
    answer = answer.strip()
    return answer if has_latex_math(answer) else f"${answer}$"
