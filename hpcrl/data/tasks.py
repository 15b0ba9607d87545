"""Prompt sources: the built-in verifiable tasks and local prompt files, as (prompt, answer) pairs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcrl.config.job import JobConfig


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: str


def addition_prompts(digits: int, modulus: int | None = None) -> list[Prompt]:
    """Every `a+b=` with operands of up to `digits` digits, in a fixed order (the sampler shuffles).
    With a modulus the answer is (a+b) mod it, which spreads the answers evenly over the prompts."""
    limit = 10**digits
    return [Prompt(f"{a}+{b}=", str((a + b) % modulus if modulus else a + b)) for a in range(limit) for b in range(limit)]


def file_prompts(path: str, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Rows of a jsonl (or parquet, with pyarrow installed) file holding a prompt and its answer."""
    source = Path(path)
    if source.suffix == ".parquet":
        import pyarrow.parquet as pq  # optional: only for parquet datasets

        rows = pq.read_table(source).to_pylist()
    else:
        rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    missing = [i for i, row in enumerate(rows) if prompt_key not in row or answer_key not in row]
    if missing:
        raise ValueError(f"{path}: row {missing[0] + 1} lacks '{prompt_key}' or '{answer_key}'")
    return [Prompt(str(row[prompt_key]), str(row[answer_key])) for row in rows]


def load_prompts(job: JobConfig) -> list[Prompt]:
    if job.task is not None:
        return addition_prompts(job.task.digits, job.task.modulus)
    assert job.dataset is not None
    return file_prompts(job.dataset.path, job.dataset.prompt_key, job.dataset.answer_key)


def fit_context(prompts: list[Prompt], encode: Callable[[str], list[int]], context: int, max_new_tokens: int
                ) -> tuple[list[Prompt], int]:
    """The prompts that leave room for a whole response (`max_new_tokens`) in the model's context
    (`context` positions), and how many did not: a longer one would be cut off mid-generation, or
    run past the positions the model was trained for."""
    room = context - max_new_tokens
    kept = [p for p in prompts if len(encode(p.text)) <= room]
    return kept, len(prompts) - len(kept)
