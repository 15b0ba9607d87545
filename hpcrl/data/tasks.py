"""Prompt sources: the built-in verifiable tasks and local prompt files, as (prompt, reference, domain)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from hpcrl.config.job import JobConfig


@dataclass(frozen=True)
class Prompt:
    text: str          # empty for an env's episode
    answer: str        # the reference the domain's reward compares with; an env's episode seed
    domain: str        # the dataset's tag (a built-in task's name)


def addition_prompts(digits: int, modulus: int | None = None) -> list[Prompt]:
    """Every `a+b=` with operands of up to `digits` digits, in a fixed order (the sampler shuffles).
    With a modulus the answer is (a+b) mod it, which spreads the answers evenly over the prompts."""
    limit = 10**digits
    return [Prompt(f"{a}+{b}=", str((a + b) % modulus if modulus else a + b), "addition")
            for a in range(limit) for b in range(limit)]


def repeat_prompts(max_count: int) -> list[Prompt]:
    """Every `d*n=` -> d written n times, n up to `max_count`, the prompt for n listed about
    max_count/n times: answer lengths (and so response lengths) are long-tailed, mostly short, a
    few of `max_count` tokens, which is what makes a rollout wait for its slowest sample."""
    return [Prompt(f"{d}*{n}=", str(d) * n, "repeat")
            for d in range(10) for n in range(1, max_count + 1) for _ in range(max(1, round(max_count / n)))]


def task_prompts(task) -> list[Prompt]:
    """A built-in task's prompts (job.task)."""
    if task.name == "repeat":
        return repeat_prompts(task.max_count)
    return addition_prompts(task.digits, task.modulus)


def load_prompts(job: JobConfig, tokenizer) -> tuple[dict[str, list[Prompt]], dict[str, list[Prompt]]]:
    """(training, evaluation) prompts by domain. Without `eval.datasets` each domain's evaluation
    prompts are `eval.holdout` of its own, drawn with the job's seed and left out of training."""
    from hpcrl.data.datasets import dataset_prompts   # Hugging Face datasets: imported when files are read

    if job.env is not None:   # an episode per seed: the rollout's env renders its first observation
        return {job.env.name: [Prompt("", str(seed), job.env.name) for seed in range(job.env.seeds)]}, {}
    if job.task is not None:
        train = {job.task.name: task_prompts(job.task)}
    else:
        train = {config.tag: dataset_prompts(config, tokenizer) for config in job.datasets}
    if job.eval.datasets is not None:
        return train, {config.tag: dataset_prompts(config, tokenizer) for config in job.eval.datasets}
    held = {}
    if job.eval.every:
        for domain, prompts in train.items():
            order = list(range(len(prompts)))
            random.Random(job.seed).shuffle(order)
            keep = min(job.eval.holdout, len(prompts) - 1)
            held[domain] = [prompts[i] for i in sorted(order[:keep])]
            train[domain] = [prompts[i] for i in sorted(order[keep:])]
    return train, held


def fit_context(prompts: list[Prompt], encode: Callable[[str], list[int]], context: int, max_new_tokens: int
                ) -> tuple[list[Prompt], int]:
    """The prompts that leave room for a whole response (`max_new_tokens`) in the model's context
    (`context` positions), and how many did not: a longer one would be cut off mid-generation, or
    run past the positions the model was trained for."""
    room = context - max_new_tokens
    kept = [p for p in prompts if len(encode(p.text)) <= room]
    return kept, len(prompts) - len(kept)
