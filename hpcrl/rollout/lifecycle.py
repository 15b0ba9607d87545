"""The life of a rollout sample: queued -> generating -> rewarded -> (filtered) -> consumed.

Samples move in prompt groups (GRPO compares the responses of one prompt), and every sample
records the policy version that generated it, which is what the staleness bound is checked on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SampleState(Enum):
    QUEUED = "queued"
    GENERATING = "generating"
    REWARDED = "rewarded"
    FILTERED = "filtered"      # dynamic sampling dropped its group (all rewards equal)
    CONSUMED = "consumed"      # trained on
    ABORTED = "aborted"        # no longer needed (its batch was complete without it)


ALLOWED = {
    SampleState.QUEUED: {SampleState.GENERATING, SampleState.ABORTED},
    SampleState.GENERATING: {SampleState.REWARDED, SampleState.ABORTED},
    SampleState.REWARDED: {SampleState.FILTERED, SampleState.CONSUMED, SampleState.ABORTED},
    SampleState.FILTERED: set(),
    SampleState.CONSUMED: set(),
    SampleState.ABORTED: set(),
}


class LifecycleError(RuntimeError):
    pass


@dataclass
class Group:
    """One prompt and its `group_size` responses, produced for the train step `batch`."""

    group_id: int
    batch: int
    prompt_ids: list[int]
    answer: str
    size: int
    state: SampleState = SampleState.QUEUED
    version: int = -1                          # policy version of the weights that generated it
    response_ids: list[list[int]] = field(default_factory=list)
    behaviour_logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    def move(self, state: SampleState) -> None:
        if state not in ALLOWED[self.state]:
            raise LifecycleError(f"group {self.group_id}: {self.state.value} -> {state.value} is not allowed")
        self.state = state
