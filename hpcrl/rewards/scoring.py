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
from hpcrl.rewards.base import Response, RewardFunction, RewardTimeout, Scored, time_limit
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
        specs = {job.task.name: RewardSpec(reward_function("number"))}
    else:
        specs = {}
    for config in (job.datasets or []) + (job.eval.datasets or []):
        specs[config.tag] = RewardSpec(reward_function(config.reward), dict(config.reward_args),
                                       config.reward_timeout_s)
    return specs


def score_one(spec: RewardSpec, response: Response, reference: str) -> Scored:
    try:
        with time_limit(spec.timeout_s):
            result = spec.function(response, reference, **spec.args)
    except RewardTimeout:
        return Scored(0.0, "reward_timeout")
    except SandboxUnavailable:
        raise
    except Exception as exc:   # a user's reward with a bug, a malformed reference: this sample only
        print(f"hpcrl: reward {getattr(spec.function, '__name__', spec.function)} raised {exc!r}; reward 0",
              file=sys.stderr, flush=True)
        return Scored(0.0, "reward_error")
    scored = result if isinstance(result, Scored) else Scored(float(result))
    return scored if math.isfinite(scored.reward) else Scored(0.0, "reward_error")


def score_batch(tokenizer, responses: Ragged, references: Sequence[str], domains: Sequence[str],
                specs: dict[str, RewardSpec]) -> tuple[np.ndarray, list[str]]:
    """(rewards float64, outcome codes) of decoded responses (stopped: the last token is <eos>)."""
    rewards, codes = np.zeros(len(references), dtype=np.float64), []
    for index, (ids, reference, domain) in enumerate(zip(responses, references, domains)):
        stopped = len(ids) > 0 and int(ids[-1]) == tokenizer.eos_token_id
        scored = score_one(specs[domain], Response(tokenizer.decode(ids.tolist()), stopped), reference)
        rewards[index] = scored.reward
        codes.append(scored.code)
    return rewards, codes


def code_counts(domains: Sequence[str], codes: Sequence[str]) -> dict[str, float]:
    """`reward_codes/<domain>/<code>`: each outcome's share of the domain's samples."""
    per_domain = Counter(domains)
    return {f"reward_codes/{d}/{c}": n / per_domain[d] for (d, c), n in sorted(Counter(zip(domains, codes)).items())}
