"""Scoring rollout's responses: on the reward workers, asynchronously, or on the controller.

With a `reward` role the controller hands each finished round's responses to the reward workers
(split over their replicas) and goes on: rollout generates the next round and the trainer trains
while they score. Without one it scores in its own process at once (rule-based rewards are
cheap; code rewards start sandboxes, never run code in this process). Either way the reward
includes DAPO's overlong shaping when the algorithm asks for it, and every sample carries its
outcome code (hpcrl.rewards.scoring).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpcrl.algos import overlong_penalty
from hpcrl.config.job import JobConfig
from hpcrl.ragged import Ragged
from hpcrl.rewards import code_counts, reward_specs, score_batch
from hpcrl.runtime.dispatch import Dispatch, WorkerGroup


@dataclass
class Done:
    """A result already at hand, waitable like a Pending."""

    result: Any
    done: bool = True

    def value(self) -> Any:
        return self.result


class Scorer:
    def __init__(self, job: JobConfig, tokenizer, workers: WorkerGroup | None, enter_stage):
        """`workers`: the reward role's group (None: score here); `enter_stage`: the residency's
        stage change, made before the workers are called."""
        self.job, self.tokenizer, self.workers, self.enter_stage = job, tokenizer, workers, enter_stage
        self.specs = reward_specs(job) if workers is None else None

    def start(self, prompts: Ragged, responses: Ragged, answers: Sequence[str], domains: Sequence[str]):
        """Begin scoring; returns what to wait on (its value: {"rewards", "codes"} without shaping)."""
        if self.workers is None:
            rewards, codes = score_batch(self.tokenizer, responses, answers, domains, self.specs, prompts)
            return Done({"rewards": rewards, "codes": codes})
        self.enter_stage("reward")
        return self.workers.call("score", Dispatch.DP_SPLIT, {"prompt_ids": prompts, "response_ids": responses,
                                                              "answers": list(answers), "domains": list(domains)})

    def finish(self, pending, responses: Ragged) -> tuple[np.ndarray, list[str], np.ndarray]:
        """(rewards with the overlong shaping, outcome codes, the rewards without it) of a completed
        `start`: dynamic sampling judges a group on the latter, as DAPO does on accuracy."""
        result = pending.value()
        outcomes = np.asarray(result["rewards"], dtype=np.float64)
        algo, limit = self.job.algorithm, self.job.rollout.max_new_tokens
        if not algo.overlong_shaping:
            return outcomes, list(result["codes"]), outcomes
        rewards = outcomes + overlong_penalty(torch.from_numpy(responses.lengths), limit,
                                              algo.overlong_buffer(limit), algo.overlong_penalty).numpy()
        return rewards, list(result["codes"]), outcomes


def correct(outcomes: np.ndarray) -> np.ndarray:
    """Which samples count as right: the verifier's full marks (1), before any length shaping, so
    that a right answer in DAPO's overlong buffer still counts and a partial credit does not."""
    return np.asarray(outcomes) >= 1.0


def domain_metrics(groups) -> dict[str, float]:
    """Per domain of a step's groups: `reward_mean/<d>` (the shaped rewards training used),
    `accuracy/<d>` (`correct` outcomes) and the share of each outcome code (`reward_codes/<d>/<code>`)."""
    domains = [g.domain for g in groups for _ in range(g.size)]
    rewards = np.concatenate([g.rewards for g in groups]) if groups else np.zeros(0)
    right = correct(np.concatenate([g.outcomes for g in groups])) if groups else np.zeros(0, bool)
    metrics = {}
    for domain in dict.fromkeys(domains):
        mine = np.array([d == domain for d in domains])
        metrics[f"reward_mean/{domain}"] = float(rewards[mine].mean())
        metrics[f"accuracy/{domain}"] = float(right[mine].mean())
    return {**metrics, **code_counts(domains, [c for g in groups for c in (g.codes or ["ok"] * g.size)])}
