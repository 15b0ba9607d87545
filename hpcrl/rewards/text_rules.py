"""Rewards that check the form of a response: a multiple-choice letter, a required structure, and
instruction-following rules (IFEval-style), each a plain function of the text."""
from __future__ import annotations

import json
import re

from hpcrl.rewards.base import Response, Scored

# as OLMES and MMLU-Pro: the words in any case, the letter a capital standing alone ("the answer is
# definitely B" is not D, nor "answer: each" E)
_CHOICE = re.compile(r"(?i:answer is|answer:)\s*\(?([A-J])\b")
_LETTER = re.compile(r"\b([A-J])\b")
THINK = r"(?s)<think>.+?</think>\s*\S.*"   # reasoning in <think> tags, then an answer


def choice_reward(response: Response, reference: str) -> Scored:
    """1.0 when the chosen letter ("the answer is (B)", else the last standalone capital A-J) is the
    reference's."""
    found = _CHOICE.findall(response.text) or _LETTER.findall(response.text)
    if not found:
        return Scored(0.0, "no_answer")
    return Scored(1.0, "ok") if found[-1] == reference.strip().upper() else Scored(0.0, "wrong")


def format_reward(response: Response, reference: str, pattern: str = THINK, require_stop: bool = True) -> Scored:
    """1.0 when the whole response matches `pattern` (default: `<think>...</think>` then an answer)
    and, with `require_stop`, ended by itself rather than at the token budget."""
    if require_stop and not response.stopped:
        return Scored(0.0, "truncated")
    return Scored(1.0, "ok") if re.fullmatch(pattern, response.text.strip()) else Scored(0.0, "wrong_format")


def _words(text: str) -> list[str]:
    return re.findall(r"\b\w+\b", text)


RULES = {   # rule name -> check(text, **its arguments)
    "max_words": lambda text, n: len(_words(text)) <= n,
    "min_words": lambda text, n: len(_words(text)) >= n,
    "contains": lambda text, word: word.lower() in text.lower(),
    "excludes": lambda text, word: word.lower() not in text.lower(),
    "lowercase": lambda text: text == text.lower(),
    "uppercase": lambda text: text == text.upper(),
    "ends_with": lambda text, suffix: text.rstrip().endswith(suffix),
    "starts_with": lambda text, prefix: text.lstrip().startswith(prefix),
    "max_sentences": lambda text, n: len([s for s in re.split(r"[.!?]+", text) if s.strip()]) <= n,
    "json": lambda text: _is_json(text),
}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def ifeval_reward(response: Response, reference: str) -> Scored:
    """The share of the reference's rules the response keeps. The reference is JSON: a list of
    {"rule": name, ...arguments} with names from RULES, e.g. [{"rule": "max_words", "n": 20}]."""
    rules = json.loads(reference)
    kept = [RULES[rule["rule"]](response.text, **{k: v for k, v in rule.items() if k != "rule"}) for rule in rules]
    share = sum(kept) / max(1, len(kept))
    return Scored(share, "ok" if share == 1.0 else "broke_rules")


choice_reward.deterministic = format_reward.deterministic = ifeval_reward.deterministic = True   # see score_batch
