"""The life of a rollout sample: queued -> generating -> rewarded -> (filtered) -> consumed.

Samples move in prompt groups (GRPO compares the responses of one prompt), and every group
records the policy version that generated it, which is what the staleness bound is checked on.
A generation round may be cut before a response ends (`rollout.max_round_s`, or new weights with
`rollout.partial_rollout`): the response keeps its tokens and continues in a later round, possibly
with newer weights. Every token records the version that sampled it (its behaviour log-prob is that
version's), and the group keeps the oldest, which the staleness bound is checked on. A group is
scored once all its responses have ended.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from hpcrl.ragged import Ragged

_EMPTY_IDS = np.zeros(0, np.int32)
_EMPTY_LOGPROBS = np.zeros(0, np.float32)
_EMPTY_IDS.flags.writeable = _EMPTY_LOGPROBS.flags.writeable = False


class SampleState(Enum):
    QUEUED = "queued"
    GENERATING = "generating"  # some response has not ended yet
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
    """One prompt and its `size` responses, produced for the train step `batch`."""

    group_id: int
    batch: int
    prompt_ids: np.ndarray                      # int32
    answer: str                                 # the reference its domain's reward compares with
    size: int
    domain: str                                 # which dataset (reward, metrics) the prompt is from
    state: SampleState = SampleState.QUEUED
    version: int = -1                           # oldest policy version that generated any of its tokens
    response_ids: list[np.ndarray] = field(default_factory=list)        # per sample, int32
    behaviour_logprobs: list[np.ndarray] = field(default_factory=list)  # per sample, float32
    token_versions: list[np.ndarray] = field(default_factory=list)      # per sample, int32: who sampled each token
    finished: np.ndarray | None = None                                  # per sample: the response has ended
    loss_masks: list[np.ndarray] | None = None                          # per sample, bool: an env's trajectories
    token_rewards: list[np.ndarray] | None = None                       # per sample, float32: an env's turn rewards
    routed_experts: list[np.ndarray] | None = None                      # per sample: its routing (router replay)
    rewards: np.ndarray | None = None                                   # per sample, float64, once scored
    outcomes: np.ndarray | None = None                                  # per sample: the verifier's, before shaping
    codes: list[str] | None = None                                      # per sample: the reward's outcome code

    def move(self, state: SampleState) -> None:
        if state not in ALLOWED[self.state]:
            raise LifecycleError(f"group {self.group_id}: {self.state.value} -> {state.value} is not allowed")
        self.state = state

    def start(self, version: int) -> None:
        """Queued -> generating with weights of `version`: every response starts empty."""
        self.move(SampleState.GENERATING)
        self.version = version
        # empty arrays shared by every response (read-only: extend replaces them), not 3 new ones a
        # sample (768 a step for the tiny job, 40% of the time it took to start a round's groups)
        self.response_ids = [_EMPTY_IDS] * self.size
        self.behaviour_logprobs = [_EMPTY_LOGPROBS] * self.size
        self.token_versions = [_EMPTY_IDS] * self.size
        self.finished = np.zeros(self.size, dtype=bool)
        self.routed_experts = None

    def extend(self, sample: int, ids: np.ndarray, logprobs: np.ndarray, finished: bool, versions: np.ndarray,
               loss_mask: np.ndarray | None = None, token_rewards: np.ndarray | None = None,
               routed_experts: np.ndarray | None = None) -> None:
        """Append one round's tokens, sampled by weights of `versions` (one per token), to a response.
        A trajectory's `loss_mask` is 0 on the env's observation tokens (they are context, not the
        policy's), and its `token_rewards` hold each turn's reward on the last token of its action.
        `routed_experts`, the round's routing of the whole sequence (a continuation prefills its
        prefix again), replaces the response's. A response's first tokens are kept as given: views of
        the round's reply, which nothing writes to and which they keep alive (a few bytes a token,
        until the group is trained); later ones are appended to a copy."""
        for name, values, dtype in (("loss_masks", loss_mask, bool), ("token_rewards", token_rewards, np.float32)):
            if values is not None:
                if getattr(self, name) is None:
                    setattr(self, name, [np.zeros(len(r), dtype) for r in self.response_ids])
                getattr(self, name)[sample] = np.concatenate([getattr(self, name)[sample], np.asarray(values, dtype)])
        self.response_ids[sample] = _appended(self.response_ids[sample], ids)
        self.behaviour_logprobs[sample] = _appended(self.behaviour_logprobs[sample], logprobs)
        self.token_versions[sample] = _appended(self.token_versions[sample], versions)
        self.finished[sample] = finished
        if routed_experts is not None:
            if self.routed_experts is None:
                self.routed_experts = [np.zeros(0, routed_experts.dtype) for _ in range(self.size)]
            self.routed_experts[sample] = np.array(routed_experts)   # a copy: not a view keeping the round's reply

    @property
    def done(self) -> bool:
        """Every response has ended (the group can be scored)."""
        return self.finished is not None and bool(self.finished.all())

    def unfinished(self) -> list[int]:
        return [] if self.finished is None else np.flatnonzero(~self.finished).tolist()

    def responses(self) -> Ragged:
        return Ragged.from_arrays(self.response_ids, np.int32)

    def logprobs(self) -> Ragged:
        return Ragged.from_arrays(self.behaviour_logprobs, np.float32)


def _appended(start: np.ndarray, more: np.ndarray) -> np.ndarray:
    return np.concatenate([start, more]) if len(start) else more


def routing_column(samples: list[tuple[Group, int]]) -> dict[str, Ragged]:
    """{"routed_experts": each sample's routing} when some group of `samples` (group, sample index)
    recorded one (router replay); a sample without (none recorded before a resume) has an empty row,
    and the trainer routes it itself. {} otherwise."""
    recorded = [g.routed_experts for g, _ in samples if g.routed_experts is not None]
    if not recorded:
        return {}
    empty = np.zeros(0, recorded[0][0].dtype)
    return {"routed_experts": Ragged.from_arrays([g.routed_experts[i] if g.routed_experts is not None else empty
                                                  for g, i in samples], empty.dtype)}
