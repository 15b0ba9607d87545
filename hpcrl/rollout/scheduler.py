"""The rollout scheduler on the controller (ROLL's sample lifecycle, TianJi's relaxed dependencies).

Production and consumption are decoupled: batch b (the data of train step b, which trains policy
version b-1) may be generated with any policy version v >= b-1-K, K = `rollout.max_staleness`.
So with K=0 a batch waits for the weights of the previous step (the synchronous pipeline), and with
K>0 rollout generates while the trainer trains. Production is throttled to balance consumption:
rollout works only on the batch training will take next, so at most one finished batch waits. One
generation round runs at a time, so a deeper queue would not raise throughput (the slower side is
busy all the time either way); it would only make every sample older. With rollout and training
overlapping, samples are then one version old, and K bounds what a slow sync or refill may add.
Dynamic sampling drops groups whose rewards are all equal and refills the batch from the queue.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from hpcrl.algos import nonzero_variance_groups
from hpcrl.config.job import JobConfig
from hpcrl.data import ResumableSampler
from hpcrl.rollout.lifecycle import Group, SampleState

Scorer = Callable[[list[list[int]], list[str]], list[float]]


class StalenessError(RuntimeError):
    pass


class RolloutScheduler:
    def __init__(self, job: JobConfig, sampler: ResumableSampler, encode: Callable[[str], list[int]]):
        self.job = job
        self.sampler = sampler
        self.encode = encode
        self.max_staleness = job.rollout.max_staleness
        self.groups_per_batch = job.train.prompts_per_step
        self.group_size = job.algorithm.group_size
        self.groups: dict[int, Group] = {}
        self.attempts: Counter[int] = Counter()      # batch -> production rounds so far
        self.next_group_id = 0
        self.next_batch = 1                          # the batch training takes next
        self.counts: Counter[str] = Counter()        # lifecycle totals, for the metrics

    # -- production ---------------------------------------------------------------------------
    def may_produce(self, batch: int, rollout_version: int) -> bool:
        """Weights of version `rollout_version` may generate batch `batch` (the staleness bound)."""
        return batch - 1 - rollout_version <= self.max_staleness and batch <= self.job.train.steps

    def missing(self, batch: int) -> int:
        """Groups batch `batch` still needs: kept ones and ones on their way count as present."""
        live = (SampleState.QUEUED, SampleState.GENERATING, SampleState.REWARDED)
        return self.groups_per_batch - sum(1 for g in self.groups.values() if g.batch == batch and g.state in live)

    def next_round(self, rollout_version: int) -> tuple[int, int, list[Group]] | None:
        """The next generation round, (batch, attempt, groups), for the batch training takes next, if
        it still needs groups and weights of `rollout_version` may produce it; None otherwise."""
        batch = self.next_batch
        if not self.may_produce(batch, rollout_version):
            return None
        missing = self.missing(batch)
        if missing <= 0:
            return None
        # A refill round is a full round (as in DAPO): when few groups survive the filter,
        # asking for just the missing ones would take many small rounds; extras are aborted.
        count = missing if self.attempts[batch] == 0 else self.groups_per_batch
        attempt, groups = self._start_round(batch, count, rollout_version)
        return batch, attempt, groups

    def _start_round(self, batch: int, count: int, version: int) -> tuple[int, list[Group]]:
        attempt = self.attempts[batch]
        if attempt > self.job.rollout.max_refills:
            raise RuntimeError(f"dynamic sampling: batch {batch} still lacks {count} groups with varied rewards "
                               f"after {attempt} rounds (rollout.max_refills): the task is solved or out of reach; "
                               "raise rollout.max_refills or set algorithm.dynamic_sampling=false")
        self.attempts[batch] += 1
        groups = []
        for prompt in self.sampler.next_batch(count):
            group = Group(self.next_group_id, batch, self.encode(prompt.text), prompt.answer, self.group_size)
            self.next_group_id += 1
            group.move(SampleState.GENERATING)
            group.version = version
            self.groups[group.group_id] = group
            groups.append(group)
        self.counts["generated"] += len(groups) * self.group_size
        return attempt, groups

    def finish_round(self, groups: list[Group], response_ids: list[list[int]], logprobs: list[list[float]],
                     rewards: list[float]) -> None:
        """Store a round's responses and rewards; apply dynamic sampling; abort what is not needed."""
        size = self.group_size
        for i, group in enumerate(groups):
            group.response_ids = response_ids[i * size:(i + 1) * size]
            group.behaviour_logprobs = logprobs[i * size:(i + 1) * size]
            group.rewards = rewards[i * size:(i + 1) * size]
            group.move(SampleState.REWARDED)
        if self.job.algorithm.dynamic_sampling:
            self._filter(groups)
        batch = groups[0].batch
        kept = [g for g in self.groups.values() if g.batch == batch and g.state is SampleState.REWARDED]
        for extra in kept[self.groups_per_batch:]:
            extra.move(SampleState.ABORTED)
            self.counts["aborted"] += size
            del self.groups[extra.group_id]

    def _filter(self, groups: list[Group]) -> None:
        import torch

        rewards = torch.tensor([r for g in groups for r in g.rewards])
        index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rewards])
        keep = nonzero_variance_groups(rewards, index).view(len(groups), -1)[:, 0].tolist()
        for group, kept in zip(groups, keep):
            if not kept:
                group.move(SampleState.FILTERED)
                self.counts["filtered"] += group.size
                del self.groups[group.group_id]

    # -- consumption --------------------------------------------------------------------------
    def ready(self, batch: int) -> bool:
        groups = [g for g in self.groups.values() if g.batch == batch]
        return len(groups) == self.groups_per_batch and all(g.state is SampleState.REWARDED for g in groups)

    def take(self, batch: int) -> tuple[list[Group], dict[str, float]]:
        """Hand batch `batch` to training; checks every sample's staleness against the bound."""
        if batch != self.next_batch or not self.ready(batch):
            raise RuntimeError(f"batch {batch} taken out of turn (next is {self.next_batch}) or before it is ready")
        self.next_batch += 1
        groups = sorted((g for g in self.groups.values() if g.batch == batch), key=lambda g: g.group_id)
        trained_version = batch - 1
        staleness = Counter()
        for group in groups:
            lag = trained_version - group.version
            if lag > self.max_staleness or lag < 0:
                raise StalenessError(f"group {group.group_id} of batch {batch} was generated by policy version "
                                     f"{group.version}, {lag} versions behind (bound {self.max_staleness})")
            staleness[lag] += group.size
            group.move(SampleState.CONSUMED)
            del self.groups[group.group_id]
        self.counts["consumed"] += sum(staleness.values())
        metrics = {f"staleness_{lag}": float(n) for lag, n in sorted(staleness.items())}
        metrics["staleness_max"] = float(max(staleness))
        metrics["queue_depth"] = float(sum(g.size for g in self.groups.values() if g.state is SampleState.REWARDED))
        return groups, metrics

    # -- checkpoints --------------------------------------------------------------------------
    def buffer(self) -> dict[str, list]:
        """Rewarded, not yet consumed groups as columns (one row per sample) for the checkpoint."""
        rows = [(g, i) for g in sorted(self.groups.values(), key=lambda g: g.group_id)
                if g.state is SampleState.REWARDED for i in range(g.size)]
        return {
            "group_id": [g.group_id for g, _ in rows],
            "batch": [g.batch for g, _ in rows],
            "version": [g.version for g, _ in rows],
            "prompt_ids": [g.prompt_ids for g, _ in rows],
            "answer": [[ord(c) for c in g.answer] for g, _ in rows],
            "response_ids": [g.response_ids[i] for g, i in rows],
            "behaviour_logprobs": [g.behaviour_logprobs[i] for g, i in rows],
            "rewards": [g.rewards[i] for g, i in rows],
        }

    def restore(self, step: int, buffer: dict[str, list], next_group_id: int, attempts: dict[int, int]) -> None:
        """State saved after train step `step`: the buffer and the counters."""
        self.next_batch = step + 1
        self.next_group_id = next_group_id
        self.attempts = Counter(attempts)
        for row in range(len(buffer.get("group_id", []))):
            gid = int(buffer["group_id"][row])
            if gid not in self.groups:
                answer = "".join(chr(c) for c in buffer["answer"][row])
                group = Group(gid, int(buffer["batch"][row]), list(buffer["prompt_ids"][row]), answer,
                              self.group_size, SampleState.REWARDED, int(buffer["version"][row]))
                self.groups[gid] = group
            group = self.groups[gid]
            group.response_ids.append(list(buffer["response_ids"][row]))
            group.behaviour_logprobs.append(list(buffer["behaviour_logprobs"][row]))
            group.rewards.append(float(buffer["rewards"][row]))
