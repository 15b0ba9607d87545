"""Pulling the final answer out of a response: `\\boxed{...}`, GSM8K's `#### x`, the LaTeX of the
response for math-verify to read, or the last number of plain text."""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_HASHES = re.compile(r"####\s*([^\n]+)")
_LATEX_MATH = re.compile(r"(?<!\\)\$|\\\(|\\\[")   # $, \( or \[ opening math; not an escaped \$


def has_latex_math(text: str) -> bool:
    return _LATEX_MATH.search(text) is not None


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for index in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[open_at + 1:index]
    return None


def extract_answer(text: str) -> str | None:
    """The response's final answer: the last boxed expression, else what follows `####`, else the
    whole text where it has LaTeX math (math-verify reads its last answer: the last number of
    `$\\frac{3}{2}$` would be 2), else the last number; None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    if has_latex_math(text):
        return text
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None
