"""Evaluation on held-out prompts: greedy and sampled decoding by the current policy, per domain.

Before the first step (recorded as step 0), every `eval.every` steps and after the last, rollout
(holding the trainer's weights of that step) answers each evaluation prompt once greedily and
`eval.samples` times at the rollout temperature; the responses are scored by their domain's reward. Per domain the metrics get the mean greedy
and sampled rewards and pass@1 and pass@k (a response is correct when its reward is 1), with the
unbiased estimator of Chen et al. 2021.
"""
from __future__ import annotations

from collections.abc import Callable
from math import comb
from statistics import fmean

import numpy as np

from hpcrl.config.job import JobConfig
from hpcrl.data.tasks import Prompt
from hpcrl.ragged import Ragged
from hpcrl.runtime.scoring import correct

EVAL_ATTEMPT = 1 << 20   # sampling streams of evaluation rounds, apart from training's (runtime.roles.sample_generator)


def pass_at_k(n: int, correct: int, k: int) -> float:
    """P(at least one of k responses drawn from n, of which `correct` are correct, is correct)."""
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


class Evaluator:
    def __init__(self, job: JobConfig, prompts: dict[str, list[Prompt]], encode: Callable[[str], list[int]]):
        limit = job.eval.max_prompts
        self.job = job
        self.prompts = [p for domain in prompts.values() for p in domain[:limit]]
        self.ids = Ragged.from_rows([encode(p.text) for p in self.prompts], np.int32)

    def due(self, step: int) -> bool:
        """At step 0 (the starting policy), every `eval.every` steps, and after the last."""
        every = self.job.eval.every
        return bool(self.prompts) and every > 0 and (step % every == 0 or step == self.job.train.steps)

    def run(self, step: int, generate, score) -> dict[str, float]:
        """`generate(batch, attempt, greedy) -> response ids`; `score(prompts, responses, answers, domains)
        -> rewards`: the verifier's, before any training shaping (DAPO's overlong penalty would make a
        correct long answer count as wrong in pass@k)."""
        k = self.job.eval.samples
        budget = self.job.rollout.max_new_tokens
        rows = np.arange(len(self.prompts))
        answers = [p.answer for p in self.prompts]
        domains = [p.domain for p in self.prompts]
        greedy = generate({"prompt_ids": self.ids, "budgets": np.full(len(rows), budget)}, EVAL_ATTEMPT, True)
        greedy_rewards = score(self.ids, greedy, answers, domains)
        repeated = np.repeat(rows, k)
        sampled = generate({"prompt_ids": self.ids.take(repeated), "budgets": np.full(len(repeated), budget)},
                           EVAL_ATTEMPT + 1 + step, False)
        sampled_rewards = score(self.ids.take(repeated), sampled, [answers[i] for i in repeated],
                                [domains[i] for i in repeated]).reshape(-1, k)
        metrics = {}
        for domain in dict.fromkeys(domains):
            mine = [i for i, d in enumerate(domains) if d == domain]
            right = correct(sampled_rewards[mine]).sum(axis=1)
            metrics[f"eval/{domain}/greedy_reward"] = float(greedy_rewards[mine].mean())
            metrics[f"eval/{domain}/sampled_reward"] = float(sampled_rewards[mine].mean())
            metrics[f"eval/{domain}/pass@1"] = fmean(pass_at_k(k, int(c), 1) for c in right)
            metrics[f"eval/{domain}/pass@{k}"] = fmean(pass_at_k(k, int(c), k) for c in right)
        return metrics
