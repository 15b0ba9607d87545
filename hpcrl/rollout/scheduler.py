"""The rollout scheduler on the controller (ROLL's sample lifecycle, TianJi's relaxed dependencies).

Production and consumption are decoupled: batch b (the data of train step b, which trains policy
version b-1) may be generated with any policy version v >= b-1-K, K = `rollout.max_staleness`.
So with K=0 a batch waits for the weights of the previous step (the synchronous pipeline), and with
K>0 rollout generates while the trainer trains. Production is throttled to balance consumption:
rollout works on the batch training will take next and, once all its groups are on their way and
the bound allows, on the one after it (per-sample hand-out: the slots that the next batch's long
responses leave free start the later batch's samples, and the round ends, handing the next batch
to training, as soon as the next batch's last response ends). A deeper queue would not raise
throughput (the slower side is busy all the time either way); it would only make every sample
older. With rollout and training overlapping, samples are then one version old, and K bounds what
a slow sync or refill may add.
Dynamic sampling drops groups whose rewards are all equal and refills the batch from the queue;
after `rollout.max_refills` refills the batch is trained short, on the groups it has (as DAPO
does), cut to a size the trainer's DP replicas and minibatches split evenly.
A round cut short leaves some responses unfinished; the next round continues them first (partial
rollout), then starts what the batch still misses. Rounds are cut by `rollout.max_round_s`, when the
next batch's rows have ended (above), and, with `rollout.partial_rollout` and K>0, when the trainer
has staged newer weights while a round runs that training is not waiting for (the controller
interrupts it): the continuation samples with the new weights, and each token keeps the version
that sampled it.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from hpcrl.algos import nonzero_variance_groups
from hpcrl.config.job import JobConfig
from hpcrl.data import DomainSampler
from hpcrl.ragged import Ragged
from hpcrl.rollout.lifecycle import Group, SampleState, routing_column

# an env's per-token columns: (checkpoint buffer column, Group attribute, dtype)
ENV_TOKEN_COLUMNS = (("loss_mask", "loss_masks", bool), ("token_rewards", "token_rewards", np.float32))


class StalenessError(RuntimeError):
    pass


def _groups_unit(job: JobConfig) -> int:
    """The fewest groups whose samples split evenly into every trained role's DP replicas x
    minibatches (so that no replica runs more micro-batches than another)."""
    shares = [getattr(job.roles, role).parallel.dp * job.train.minibatches
              for role in ("actor_train", "critic") if getattr(job.roles, role) is not None]
    samples = math.lcm(*shares)
    return samples // math.gcd(samples, job.algorithm.group_size)


@dataclass
class Round:
    """One generation call: which response of which group each row continues (or starts)."""

    batch: int
    index: int                          # rounds of this batch before it: seeds its sampling
    version: int                        # the policy version rollout generates with
    samples: list[tuple[Group, int]]

    def holds(self, batch: int) -> bool:
        """Whether any row of the round is of batch `batch`."""
        return any(g.batch == batch for g, _ in self.samples)

    def prompts(self, limit: Callable[[Group], int]) -> dict[str, Ragged | np.ndarray]:
        """The call's rows: each prompt followed by its response so far, and the tokens it may add
        (`limit(group)`, the most a response may have, less what it has); in a round that also starts
        a later batch, which rows are `needed` (of batch `batch`): the round ends when they have."""
        prompts = Ragged.from_arrays([g.prompt_ids for g, _ in self.samples], np.int32)
        partial = Ragged.from_arrays([g.response_ids[i] for g, i in self.samples], np.int32)
        limits = np.array([limit(g) for g, _ in self.samples], np.int64)
        rows = {"prompt_ids": Ragged.concat_rows(prompts, partial), "budgets": limits - partial.lengths}
        needed = np.array([g.batch == self.batch for g, _ in self.samples])
        if not needed.all():
            rows["needed"] = needed
        return rows


class RolloutScheduler:
    def __init__(self, job: JobConfig, sampler: DomainSampler, encode: Callable[..., list[int]]):
        self.job = job
        self.sampler = sampler
        self.encode = encode
        self.max_staleness = job.rollout.max_staleness
        self.groups_per_batch = job.train.prompts_per_step
        self.group_size = job.algorithm.group_size
        self.groups: dict[int, Group] = {}
        self.attempts: Counter[int] = Counter()      # batch -> rounds that started new groups
        self.rounds: Counter[int] = Counter()        # batch -> all its rounds (continuations too)
        self.next_group_id = 0
        self.next_batch = 1                          # the batch training takes next
        self.in_flight: Round | None = None          # one round runs at a time
        self.counts: Counter[str] = Counter()        # lifecycle totals, for the metrics
        self.groups_unit = _groups_unit(job)         # a short batch holds a multiple of this many groups

    # -- production ---------------------------------------------------------------------------
    def response_limit(self, group: Group) -> int:
        """The most tokens a response of `group` may have: rollout.max_new_tokens, or for the repeat
        task with task.stop_at_answer_length its answer's tokens and <eos>, if fewer."""
        task = self.job.task
        limit = self.job.rollout.max_new_tokens
        if task is not None and task.stop_at_answer_length:
            return min(limit, len(self.encode(group.answer, add_bos=False)) + 1)
        return limit

    def may_produce(self, batch: int, rollout_version: int) -> bool:
        """Weights of version `rollout_version` may generate batch `batch` (the staleness bound)."""
        return batch - 1 - rollout_version <= self.max_staleness and batch <= self.job.train.steps

    def missing(self, batch: int) -> int:
        """Groups batch `batch` still needs: kept ones and ones on their way count as present."""
        live = (SampleState.QUEUED, SampleState.GENERATING, SampleState.REWARDED)
        return self.groups_per_batch - sum(1 for g in self.groups.values() if g.batch == batch and g.state in live)

    def next_round(self, rollout_version: int) -> Round | None:
        """The next generation round for the batch training takes next, if weights of
        `rollout_version` may produce it and it still needs tokens: the unfinished responses of its
        groups first, then new groups for what is missing; None otherwise."""
        batch = self.next_batch
        if self.in_flight is not None or not self.may_produce(batch, rollout_version):
            return None
        samples = self._unfinished(batch)
        missing = self.missing(batch)
        if missing > 0:
            # A refill round is a full round (as in DAPO): when few groups survive the filter,
            # asking for just the missing ones would take many small rounds; extras are aborted.
            count = missing if self.attempts[batch] == 0 else self.groups_per_batch
            if not self._exhausted(batch):
                samples += [(g, i) for g in self._new_groups(batch, count, rollout_version) for i in range(g.size)]
            elif not samples and self._usable(batch) == 0:
                kept = self.groups_per_batch - missing
                raise RuntimeError(f"dynamic sampling: batch {batch} has {kept} groups with varied rewards after "
                                   f"{self.attempts[batch]} rounds (rollout.max_refills), fewer than the "
                                   f"{self.groups_unit} the trainer's replicas and minibatches need: the task is "
                                   "solved or out of reach; raise rollout.max_refills or set "
                                   "algorithm.dynamic_sampling=false")
        samples += self._ahead(batch, rollout_version)
        if not samples:
            return None
        batch = samples[0][0].batch   # the next batch's rows come first; without any, the round is the later one's
        index = self.rounds[batch]
        self.rounds[batch] += 1   # a batch begun in the previous batch's round may have none of its own
        self.in_flight = Round(batch, index, rollout_version, samples)
        return self.in_flight

    def _unfinished(self, batch: int) -> list[tuple[Group, int]]:
        """The responses of `batch` still running (cut short by an earlier round), in group order."""
        return [(g, i) for g in sorted(self.groups.values(), key=lambda g: g.group_id)
                if g.batch == batch and g.state is SampleState.GENERATING for i in g.unfinished()]

    def _ahead(self, batch: int, rollout_version: int) -> list[tuple[Group, int]]:
        """Per-sample hand-out: when every group of `batch` is on its way (or done), and the staleness
        bound lets these weights produce the batch after it, the round starts (or continues) that
        batch too, so the slots that `batch`'s long responses leave free are not idle. The round ends
        when `batch`'s rows have (Round.prompts: `needed`); the later batch's go on in the next round."""
        ahead = batch + 1
        if self.missing(batch) > 0 or not self.may_produce(ahead, rollout_version):
            return []
        rows = self._unfinished(ahead)
        if self.attempts[ahead] == 0:   # its first round; refills wait until it is the next batch
            rows += [(g, i) for g in self._new_groups(ahead, self.missing(ahead), rollout_version)
                     for i in range(g.size)]
        return rows

    def _exhausted(self, batch: int) -> bool:
        """No more refills for `batch`: its first round and `rollout.max_refills` refills are done."""
        return self.attempts[batch] > self.job.rollout.max_refills

    def _usable(self, batch: int) -> int:
        """How many of the batch's scored groups a short batch would train on."""
        scored = sum(1 for g in self.groups.values() if g.batch == batch and g.state is SampleState.REWARDED)
        return scored // self.groups_unit * self.groups_unit

    def _new_groups(self, batch: int, count: int, version: int) -> list[Group]:
        self.attempts[batch] += 1
        groups = []
        for prompt in self.sampler.next_batch(count):
            group = Group(self.next_group_id, batch, np.asarray(self.encode(prompt.text), dtype=np.int32),
                          prompt.answer, self.group_size, prompt.domain)
            self.next_group_id += 1
            group.start(version)
            self.groups[group.group_id] = group
            groups.append(group)
        self.counts["generated"] += len(groups) * self.group_size
        return groups

    def finish_round(self, round_: Round, response_ids: Ragged, logprobs: Ragged, finished: np.ndarray,
                     loss_mask: Ragged | None = None, prompt_ids: Ragged | None = None,
                     token_rewards: Ragged | None = None, routed_experts: Ragged | None = None) -> list[Group]:
        """Append a round's tokens to its responses; returns the groups whose responses have now all
        ended (to be scored), in group order. Groups aborted meanwhile are left out. An env round
        (whole trajectories) also gives each row's loss mask, its turns' rewards and its group's first
        observation as the prompt; a MoE model's round with router replay each row's routing."""
        if round_ is not self.in_flight:
            raise RuntimeError(f"round {round_.index} of batch {round_.batch} is not the round in flight")
        self.in_flight = None
        touched: dict[int, Group] = {}
        # each row's slices of the round's columns, cut in one pass (a Ragged row costs an index lookup)
        if not np.array_equal(logprobs.offsets, response_ids.offsets):
            raise ValueError("a round's log-probs are not one per response token")
        bounds = response_ids.offsets.tolist()
        ids, logps = response_ids.values, logprobs.values
        versions = np.full(len(ids), round_.version, np.int32)
        ended = finished.tolist()
        for row, (group, sample) in enumerate(round_.samples):
            if prompt_ids is not None:
                group.prompt_ids = np.asarray(prompt_ids[row], np.int32)
            start, stop = bounds[row], bounds[row + 1]
            group.extend(sample, ids[start:stop], logps[start:stop], bool(ended[row]), versions[start:stop],
                         None if loss_mask is None else loss_mask[row],
                         None if token_rewards is None else token_rewards[row],
                         None if routed_experts is None else routed_experts[row])
            touched[group.group_id] = group
        return [g for _, g in sorted(touched.items()) if g.done and g.state is SampleState.GENERATING]

    def rewarded(self, groups: list[Group], rewards: np.ndarray, codes: list[str] | None = None,
                 outcomes: np.ndarray | None = None) -> None:
        """Store the scores (and outcome codes) of finished groups; apply dynamic sampling; abort
        what is not needed. `outcomes`: the verifier's rewards before any length shaping (default:
        `rewards`); dynamic sampling keeps a group whose outcomes differ (DAPO's 0 < #correct < G),
        not one whose answers are all wrong (or all right) and only their lengths' penalties differ."""
        size = self.group_size
        outcomes = rewards if outcomes is None else outcomes
        scored = []
        for i, group in enumerate(groups):
            if self.groups.get(group.group_id) is not group:   # aborted while its scores were computed
                continue
            group.rewards = np.asarray(rewards[i * size:(i + 1) * size], dtype=np.float64)
            group.codes = list(codes[i * size:(i + 1) * size]) if codes is not None else ["ok"] * size
            group.outcomes = np.asarray(outcomes[i * size:(i + 1) * size], dtype=np.float64)
            group.move(SampleState.REWARDED)
            scored.append(group)
        groups = scored
        if self.job.algorithm.dynamic_sampling and groups:
            self._filter(groups, np.concatenate([g.outcomes for g in groups]))
        for batch in {g.batch for g in groups}:
            mine = self._batch_groups(batch)
            kept = [g for g in mine if g.state is SampleState.REWARDED]
            if len(kept) < self.groups_per_batch:
                continue
            for extra in kept[self.groups_per_batch:] + [g for g in mine if g.state is SampleState.GENERATING]:
                extra.move(SampleState.ABORTED)
                self.counts["aborted"] += size
                del self.groups[extra.group_id]

    def _filter(self, groups: list[Group], outcomes: np.ndarray) -> None:
        import torch

        rewards = torch.from_numpy(outcomes)
        index = torch.arange(len(groups)).repeat_interleave(self.group_size)
        keep = nonzero_variance_groups(rewards, index).view(len(groups), -1)[:, 0].tolist()
        for group, kept in zip(groups, keep):
            if not kept:
                group.move(SampleState.FILTERED)
                self.counts["filtered"] += group.size
                del self.groups[group.group_id]

    # -- consumption --------------------------------------------------------------------------
    def ready(self, batch: int) -> bool:
        """All the batch's groups are scored, and it is full or out of refills (a short batch)."""
        groups = [g for g in self.groups.values() if g.batch == batch]
        if not all(g.state is SampleState.REWARDED for g in groups):
            return False
        return len(groups) == self.groups_per_batch or (self._exhausted(batch) and self._usable(batch) > 0)

    def _batch_groups(self, batch: int) -> list[Group]:
        """The live groups of batch `batch`, in group order (the order it is trained in)."""
        return sorted((g for g in self.groups.values() if g.batch == batch), key=lambda g: g.group_id)

    def settled(self, batch: int) -> list[Group] | None:
        """The groups batch `batch` will train on, in `take`'s order, once that is decided before their
        scores: it is the next batch, every response of its groups has ended, and no dynamic sampling
        (which drops groups by their rewards and refills); None until then. The controller starts
        the batch's log-probs on them while their scores are computed."""
        if self.job.algorithm.dynamic_sampling or batch != self.next_batch:
            return None
        groups = self._batch_groups(batch)
        if len(groups) != self.groups_per_batch or not all(g.done for g in groups):
            return None
        return groups

    def take(self, batch: int) -> tuple[list[Group], dict[str, float]]:
        """Hand batch `batch` to training; checks every sample's staleness against the bound."""
        if batch != self.next_batch or not self.ready(batch):
            raise RuntimeError(f"batch {batch} taken out of turn (next is {self.next_batch}) or before it is ready")
        self.next_batch += 1
        groups = self._batch_groups(batch)
        if len(groups) < self.groups_per_batch:   # short: what splits evenly over the trainer
            usable = self._usable(batch)
            for extra in groups[usable:]:
                extra.move(SampleState.ABORTED)
                self.counts["aborted"] += extra.size
                del self.groups[extra.group_id]
            groups = groups[:usable]
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
        versions = [v for g in groups for v in g.token_versions]
        every_token = np.concatenate(versions) if versions else np.zeros(0, np.int32)
        # partial rollout: responses whose tokens came from more than one policy version
        metrics["partial_samples"] = float(sum(1 for v in versions if len(v) and v[0] != v[-1]))
        metrics["stale_token_frac"] = int((every_token < trained_version).sum()) / max(len(every_token), 1)
        metrics["rollout_rounds"] = float(self.rounds[batch])   # more than one: refills, or cut rounds
        metrics["batch_groups"] = float(len(groups))             # below train.prompts_per_step: a short batch
        metrics["queue_depth"] = float(sum(g.size for g in self.groups.values() if g.state is SampleState.REWARDED))
        return groups, metrics

    # -- checkpoints --------------------------------------------------------------------------
    def buffer(self) -> dict[str, list | Ragged | np.ndarray]:
        """Groups not yet consumed (scored, or with responses still running) as packed columns, one
        row per response, for the checkpoint."""
        groups = sorted(self.groups.values(), key=lambda g: g.group_id)
        rows = [(g, i) for g in groups for i in range(g.size)]
        return {
            "group_id": np.array([g.group_id for g, _ in rows], dtype=np.int64),
            "batch": np.array([g.batch for g, _ in rows], dtype=np.int64),
            "version": np.array([g.version for g, _ in rows], dtype=np.int64),
            "scored": np.array([g.state is SampleState.REWARDED for g, _ in rows], dtype=bool),
            "prompt_ids": Ragged.from_arrays([g.prompt_ids for g, _ in rows], np.int32),
            "answer": [g.answer for g, _ in rows],
            "domain": [g.domain for g, _ in rows],
            "response_ids": Ragged.from_arrays([g.response_ids[i] for g, i in rows], np.int32),
            "behaviour_logprobs": Ragged.from_arrays([g.behaviour_logprobs[i] for g, i in rows], np.float32),
            "token_versions": Ragged.from_arrays([g.token_versions[i] for g, i in rows], np.int32),
            **{column: Ragged.from_arrays([getattr(g, name)[i] for g, i in rows], dtype)
               for column, name, dtype in ENV_TOKEN_COLUMNS if any(getattr(g, name) is not None for g, _ in rows)},
            **routing_column(rows),
            "finished": np.array([bool(g.finished[i]) for g, i in rows], dtype=bool),
            "rewards": np.array([g.rewards[i] if g.rewards is not None else np.nan for g, i in rows],
                                dtype=np.float64),
            "outcomes": np.array([g.outcomes[i] if g.outcomes is not None else np.nan for g, i in rows],
                                 dtype=np.float64),
            "code": [g.codes[i] if g.codes is not None else "" for g, i in rows],
        }

    def restore(self, step: int, buffer: dict, next_group_id: int, attempts: dict[int, int],
                rounds: dict[int, int]) -> None:
        """State saved after train step `step`: the buffer and the counters."""
        self.next_batch = step + 1
        self.next_group_id = next_group_id
        self.attempts = Counter(attempts)
        self.rounds = Counter(rounds)
        for row in range(len(buffer.get("group_id", []))):
            gid = int(buffer["group_id"][row])
            if gid not in self.groups:
                group = Group(gid, int(buffer["batch"][row]), np.array(buffer["prompt_ids"][row]),
                              buffer["answer"][row], self.group_size, buffer["domain"][row])
                group.start(int(buffer["version"][row]))
                group.response_ids, group.behaviour_logprobs, group.token_versions = [], [], []
                self.groups[gid] = group
            group = self.groups[gid]
            sample = len(group.response_ids)
            group.response_ids.append(np.array(buffer["response_ids"][row]))
            group.behaviour_logprobs.append(np.array(buffer["behaviour_logprobs"][row]))
            group.token_versions.append(np.array(buffer["token_versions"][row]))
            for column, name, dtype in ENV_TOKEN_COLUMNS:
                if column in buffer:
                    if getattr(group, name) is None:
                        setattr(group, name, [])
                    getattr(group, name).append(np.array(buffer[column][row], dtype))
            if "routed_experts" in buffer:
                if group.routed_experts is None:
                    group.routed_experts = []
                group.routed_experts.append(np.array(buffer["routed_experts"][row]))
            group.finished[sample] = bool(buffer["finished"][row])
            if bool(buffer["scored"][row]):
                if group.rewards is None:
                    group.rewards = np.zeros(self.group_size, dtype=np.float64)
                    group.codes = [""] * self.group_size
                    group.outcomes = np.zeros(self.group_size, dtype=np.float64)
                    group.move(SampleState.REWARDED)
                group.rewards[sample] = buffer["rewards"][row]
                group.outcomes[sample] = buffer["outcomes"][row]
                group.codes[sample] = buffer["code"][row]
