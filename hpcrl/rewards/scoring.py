"""Scoring a batch of responses, each by its domain's reward, with a per-sample outcome code.

A reward function that raises or runs past its domain's `reward_timeout_s` costs its sample
reward 0 and the code `reward_error` or `reward_timeout` (a non-finite reward is an error too);
the run goes on. Only the sandbox failing to start at all (a machine without bubblewrap) stops
it, with the reason. The codes are counted per domain in the step's metrics.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcrl.config.job import JobConfig
from hpcrl.ragged import Ragged
from hpcrl.rewards.base import Response, RewardFunction, RewardTimeout, Scored, TimeLimits
from hpcrl.rewards.registry import reward_function
from hpcrl.rewards.sandbox import SandboxUnavailable


@dataclass(frozen=True)
class RewardSpec:
    function: RewardFunction
    args: dict = field(default_factory=dict)
    timeout_s: float = 30.0


def reward_specs(job: JobConfig) -> dict[str, RewardSpec]:
    """Each domain's reward: the datasets' (training and evaluation), or the built-in task's `number`."""
    if job.task is not None:
        specs = {job.task.name: RewardSpec(reward_function("number"),
                                           {"require_stop": True} if job.task.stop_at_answer_length else {})}
    else:
        specs = {}
    for config in (job.datasets or []) + (job.eval.datasets or []):
        specs[config.tag] = RewardSpec(reward_function(config.reward), dict(config.reward_args),
                                       config.reward_timeout_s)
    return specs


_reported: set[tuple[str, type]] = set()


def _report(spec: RewardSpec, exc: Exception) -> None:
    """Say once per reward function and kind of error what went wrong (the metrics count every sample)."""
    name = getattr(spec.function, "__name__", str(spec.function))
    if (name, type(exc)) not in _reported:
        _reported.add((name, type(exc)))
        print(f"hpcrl: reward {name} raised {exc!r}: its samples score 0 with the code reward_error (said once "
              "per error type; reward_codes/<domain>/reward_error counts them)", file=sys.stderr, flush=True)


def _score_one(limits: TimeLimits, spec: RewardSpec, response: Response, reference: str) -> Scored:
    try:
        result = limits.run(spec.timeout_s, spec.function, response, reference, **spec.args)
    except RewardTimeout:
        return Scored(0.0, "reward_timeout")
    except SandboxUnavailable:
        raise
    except Exception as exc:   # a user's reward with a bug, a malformed reference: this sample only
        _report(spec, exc)
        return Scored(0.0, "reward_error")
    return result if isinstance(result, Scored) else Scored(float(result))


def _score_many(limits: TimeLimits, spec: RewardSpec, responses: list[Response], references: list[str]
                ) -> list[Scored]:
    """A batched reward (a judge) over a domain's samples at once, under one time limit."""
    try:
        results = limits.run(spec.timeout_s, spec.function, responses, references, **spec.args)
        if len(results) != len(responses):
            raise ValueError(f"it returned {len(results)} scores for {len(responses)} responses")
        return [r if isinstance(r, Scored) else Scored(float(r)) for r in results]
    except RewardTimeout:
        return [Scored(0.0, "reward_timeout")] * len(responses)
    except Exception as exc:
        _report(spec, exc)
        return [Scored(0.0, "reward_error")] * len(responses)


def score_batch(tokenizer, responses: Ragged, references: Sequence[str], domains: Sequence[str],
                specs: dict[str, RewardSpec], prompts: Ragged | None = None) -> tuple[np.ndarray, list[str]]:
    """(rewards float64, outcome codes) of decoded responses (stopped: the last token is one of the
    tokenizer's `stop_token_ids`);
    `prompts`: their prompts' ids, decoded for the rewards that read them (judges).

    A deterministic reward scores each distinct (prompt, response, reference) once: a group's samples
    often repeat a response (a short answer, a policy that has converged), and a response that
    hangs the reward costs its time limit once, not once per copy."""
    rows = list(responses)
    prompt_rows = list(prompts) if prompts is not None else None
    prompt_texts: dict[bytes, str] = {}   # a group's samples share their prompt: decoded once

    def decoded(i: int) -> Response:
        ids = rows[i]
        prompt = ""
        if prompt_rows is not None:
            key = prompt_rows[i].tobytes()
            if key not in prompt_texts:
                prompt_texts[key] = tokenizer.decode(prompt_rows[i].tolist(), until_stop=False)
            prompt = prompt_texts[key]
        return Response(tokenizer.decode(ids.tolist()), len(ids) > 0 and int(ids[-1]) in tokenizer.stop_token_ids,
                        prompt)

    scored: list[Scored | None] = [None] * len(rows)
    with TimeLimits() as limits:
        for domain in dict.fromkeys(domains):
            spec, mine = specs[domain], [i for i, d in enumerate(domains) if d == domain]
            if getattr(spec.function, "batched", False):
                results = _score_many(limits, spec, [decoded(i) for i in mine], [references[i] for i in mine])
            else:   # a sample's own index is its key unless the reward is deterministic
                pure = getattr(spec.function, "deterministic", False)
                known: dict = {}
                results = []
                for i in mine:
                    key = (rows[i].tobytes(), references[i],
                           b"" if prompt_rows is None else prompt_rows[i].tobytes()) if pure else i
                    if key not in known:
                        known[key] = _score_one(limits, spec, decoded(i), references[i])
                    results.append(known[key])
            for i, result in zip(mine, results):
                scored[i] = result if math.isfinite(result.reward) else Scored(0.0, "reward_error")
    return np.array([s.reward for s in scored], dtype=np.float64), [s.code for s in scored]


def code_counts(domains: Sequence[str], codes: Sequence[str]) -> dict[str, float]:
    """`reward_codes/<domain>/<code>`: each outcome's share of the domain's samples."""
    per_domain = Counter(domains)
    return {f"reward_codes/{d}/{c}": n / per_domain[d] for (d, c), n in sorted(Counter(zip(domains, codes)).items())}
