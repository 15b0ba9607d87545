"""The single controller (MPI rank 0): it runs the RL pipeline and is the only rank that decides.

An event loop over asynchronous worker calls. Production: generation rounds on the rollout ranks,
scored as each returns, while training runs (the next round of a batch waits for the scores:
dynamic sampling decides from them what to refill). Consumption: for step b, logprobs (actor and
reference; sent while b is scored when its groups are known by then) -> advantages -> train, then
the trainer stages its weights in host memory and goes on.
The staged weights are pushed to rollout at its next round boundary, never into a running round,
so neither side sits in a collective waiting for the other's work. The rollout scheduler decides
what may be generated with which weights (the staleness bound); with `rollout.max_staleness: 0`
this is exactly the synchronous pipeline.

Token columns stay packed (`hpcrl.ragged`) from the rollout's reply to the train call: the
controller never loops over tokens in Python.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import numpy as np

from hpcrl.checkpoint import EXIT_REQUEUE, PreemptionSignal, clear_control, control_reason, read_control
from hpcrl.config.constants import EXIT_STOPPED
from hpcrl.config.job import JobConfig
from hpcrl.algos import adaptive_kl_coef
from hpcrl.data import DomainSampler, fit_context, load_prompts
from hpcrl.engines.digests import combine_digests
from hpcrl.engines.lr_schedule import learning_rate
from hpcrl.envs import EnvSpec
from hpcrl.metrics import StepRecorder
from hpcrl.placement.memory import ModelShape
from hpcrl.ragged import Ragged
from hpcrl.rollout.lifecycle import Group, routing_column
from hpcrl.rollout.scheduler import Round, RolloutScheduler
from hpcrl.runtime.advantages import logged_kl_estimator, mean_kl, token_advantages
from hpcrl.runtime.checkpointing import Checkpointer
from hpcrl.runtime.dispatch import Dispatch, Pending, WorkerGroup, busy, run, wait, wait_any
from hpcrl.runtime.layout import WorldLayout
from hpcrl.runtime.messages import SHUTDOWN, TAG_SYNC
from hpcrl.runtime.off_policy import off_policy_columns
from hpcrl.runtime.evaluation import Evaluator
from hpcrl.runtime import startup
from hpcrl.runtime.interrupts import interrupt
from hpcrl.runtime.residency import Residency
from hpcrl.runtime.scoring import Scorer, correct, domain_metrics


class Busy:
    """Wall time a resource (rollout or training) spent with work in flight, for idle fractions."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.total = 0.0

    def start(self) -> None:
        if self.since is None:
            self.since = time.perf_counter()

    def stop(self) -> None:
        if self.since is not None:
            self.total += time.perf_counter() - self.since
            self.since = None

    def take(self) -> float:
        """Busy seconds since the last call (counting a period still running up to now)."""
        running = self.since is not None
        self.stop()
        total, self.total = self.total, 0.0
        if running:
            self.start()
        return total


@dataclass
class _InFlight:
    """A call the loop waits for, with what it needs when the call returns."""

    pending: Any          # a Pending, or _All
    started: float
    version: int = -1     # stage/push: the policy version; train: the step
    round: Round | None = None
    metrics: dict[str, Any] | None = None
    groups: list[Group] | None = None   # scoring: the groups whose responses are scored
    interrupted: bool = False           # generation: asked to end early (partial rollout)
    queued: bool = False                # generation: sent behind the train call on the same ranks


@dataclass
class _Logprobs:
    """A batch's log-prob calls (the actor's recompute, the reference's, the critic's values), sent as
    soon as the batch's sequences are final: before its scores are in, where that is known then."""

    step: int
    groups: list[Group]
    sequences: dict[str, Ragged]
    actor: dict[str, Ragged]          # the sequences, and the rollout's routing to replay
    versions: np.ndarray              # per token: the policy version that sampled it
    recompute: bool
    pending: list[Pending]


class Controller:
    def __init__(self, job: JobConfig, layout: WorldLayout, tokenizer, run_dir: Path, preemption: PreemptionSignal,
                 restart: bool = False, allowed_changes: Sequence[str] = (), automatic_restart: bool = False):
        """`restart`: start over from step 0 when no checkpoint can be resumed although the run
        directory holds a run; `automatic_restart`: this world restarts a failed or requeued one
        (AUTOMATIC_RESTART_ENV), which starts over only before the first checkpoint;
        `allowed_changes`: job fields that may differ from the checkpoint's."""
        self.job = job
        self.restart, self.automatic_restart = restart, automatic_restart
        self.allowed_changes = tuple(allowed_changes)
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.groups = {name: WorkerGroup.of(role) for name, role in layout.roles.items()}
        self.residency = Residency(layout.residency, self.groups)
        workers = sorted({rank for role in layout.roles.values() for rank in role.ranks})
        self.everyone = WorkerGroup("*", workers)
        self.rank_roles = [",".join(layout.roles_on(rank)) for rank in workers]   # for RUN_DIR/startup.json
        sync = layout.sync
        # Stage leaders with loaders to send to run a weight server thread (calls on TAG_SYNC).
        self.servers = WorkerGroup("actor_train", [src for stage, src in enumerate(sync.sources)
                                                   if len(sync.members(stage)) > 1], tag=TAG_SYNC)
        self.loaders = WorkerGroup("actor_infer", sync.loaders)
        self.shared_weights = layout.shared_weights
        trainer = layout.roles["actor_train"]
        self.trainer_replicas = [trainer.stage_leaders(d) for d in trainer.whole_replicas]  # their stage leaders
        train_prompts, eval_prompts = self._prompts()
        self.sampler = DomainSampler(train_prompts, job.seed, job.domain_interleave_probs)
        self.scheduler = RolloutScheduler(job, self.sampler, tokenizer.encode)
        self.scorer = Scorer(job, tokenizer, self.groups.get("reward"), self.residency.enter)
        self.evaluator = Evaluator(job, eval_prompts, tokenizer.encode)
        self.scoring: list[_InFlight] = []       # reward workers scoring finished groups
        self.preemption = preemption
        self.checkpointer = Checkpointer(job, layout, run_dir, self.everyone)
        self.step = 0                 # train steps done = the policy version the trainer holds
        self.staged_version = -1      # the version the trainer last staged for rollout
        self.rollout_version = -1     # the version rollout generates with (calls are FIFO per rank)
        self.history: list[dict[str, float]] = []
        self.round: _InFlight | None = None      # generation
        self.training: _InFlight | None = None   # logprobs are done; the train call is in flight
        self.logprobs: _Logprobs | None = None    # the next batch's, sent while its scores are computed
        self.staging: _InFlight | None = None
        self.pushing: _InFlight | None = None
        self.train_digest: str | None = None     # of the staged weights, when digests were asked for
        self.digests: dict[str, list[str]] = {}  # the last compared digests, for the metrics
        self.rollout_busy, self.train_busy = Busy(), Busy()
        self.times: dict[str, float] = {}
        self.kl_in_reward_coef = job.algorithm.kl_in_reward.coef   # adapted per step when a target is set
        # an env round plays whole trajectories: no round is cut for partial rollout
        self._interrupts = job.rollout.partial_rollout and job.rollout.max_staleness > 0 and job.env is None
        self.episode_stats: list[dict[str, np.ndarray]] = []   # env rounds' per-trajectory figures, per step
        # gigpo: a turn's state is its whole history when the env's observation is not its state
        self.history_states = (job.env is not None and job.algorithm.advantage == "gigpo"
                               and not EnvSpec(job.env.name, job.env.options).build().observation_is_state)

    def _prompts(self) -> tuple[dict[str, list], dict[str, list]]:
        """(training, evaluation) prompts by domain that fit the model's context with a whole
        response; the rest are left out, with a count on stderr (verl filters overlong prompts the
        same way)."""
        job = self.job
        context = ModelShape.from_model(job.model).max_position_embeddings
        what = (f"longer than the {context} positions of the model's context (model.max_position_embeddings) less "
                f"rollout.max_new_tokens = {job.rollout.max_new_tokens}")
        found = load_prompts(job, self.tokenizer)
        for split in found:
            for domain, prompts in split.items():
                kept, dropped = fit_context(prompts, self.tokenizer.encode, context, job.rollout.max_new_tokens)
                if prompts and not kept:
                    raise ValueError(f"domain {domain}: every one of the {len(prompts)} prompts is {what}: raise "
                                     "model.max_position_embeddings or lower rollout.max_new_tokens")
                if dropped:
                    print(f"hpcrl: domain {domain}: {dropped} of {len(prompts)} prompts are {what}: left out",
                          file=sys.stderr, flush=True)
                split[domain] = kept
        return found

    # -- production ---------------------------------------------------------------------------
    def _start_round(self) -> None:
        found = self.scheduler.next_round(self.rollout_version)
        if found is None:
            return
        self.residency.enter("rollout")
        if self.job.env is not None:   # an episode per row, from its group's env seed
            rows = {"env_seed": np.array([int(g.answer) for g, _ in found.samples], np.int64),
                    "group": np.array([g.group_id for g, _ in found.samples], np.int64)}
            pending = self.groups["actor_infer"].call("play", Dispatch.DP_SPLIT, rows, found.batch, found.index)
            if "env" in self.groups:   # env ranks answer the round's env calls until its rollout ranks are done
                pending = _All(pending, self.groups["env"].call("serve_round", Dispatch.ONE_TO_ALL))
        else:
            pending = self.groups["actor_infer"].call("generate", Dispatch.DP_SPLIT,
                                                      found.prompts(self.scheduler.response_limit), found.batch,
                                                      found.index, False, self._interrupts)
        # behind a train call on the same ranks the round starts when that call ends (see _train)
        self.round = _InFlight(pending, time.perf_counter(), round=found, queued=self.shared_weights
                               and self.training is not None and "actor_train" in self.training.pending.roles)
        if not self.round.queued:
            self.rollout_busy.start()

    def _interrupt_round(self) -> None:
        """Partial rollout: newer weights are staged while a round runs that training is not waiting
        for (only later batches' rows); end it now, so that the weights are pushed at once and its
        unfinished responses continue with them (hpcrl.runtime.interrupts). A round holding the next
        batch ends by itself when that batch's rows have (then the push goes out): cutting it would
        only delay the batch training waits for (tiny long-tail job, K=1: 0.84x the samples/s)."""
        flight = self.round
        if (self._interrupts and flight is not None and not flight.interrupted
                and self.staged_version > flight.round.version
                and not flight.round.holds(self.scheduler.next_batch)):
            interrupt(self.groups["actor_infer"].result_ranks, (flight.round.batch, flight.round.index))
            flight.interrupted = True

    def _finish_round(self) -> None:
        flight, self.round = self.round, None
        self.rollout_busy.stop()
        result = flight.pending.value()
        self._add_time("rollout", time.perf_counter() - flight.started)
        started = time.perf_counter()
        if self.job.env is not None:
            self._finish_episodes(flight.round, result[0] if isinstance(flight.pending, _All) else result)
            return
        done = self.scheduler.finish_round(flight.round, result["response_ids"], result["behaviour_logprobs"],
                                           result["finished"], routed_experts=result.get("routed_experts"))
        self._request_logprobs_early()
        if done:
            prompts = Ragged.from_arrays([g.prompt_ids for g in done for _ in range(g.size)], np.int32)
            responses = Ragged.from_arrays([r for g in done for r in g.response_ids], np.int32)
            pending = self.scorer.start(prompts, responses, [g.answer for g in done for _ in range(g.size)],
                                        [g.domain for g in done for _ in range(g.size)])
            self.scoring.append(_InFlight(pending, started, groups=done))
            self._finish_scoring()   # scored here at once without reward workers
        self._add_time("reward", time.perf_counter() - started)

    def _finish_episodes(self, round_, result: dict) -> None:
        """An env round's trajectories are finished and rewarded by their envs: no scoring."""
        done = self.scheduler.finish_round(round_, result["response_ids"], result["behaviour_logprobs"],
                                           np.ones(len(result["rewards"]), bool), result["loss_mask"],
                                           result["prompt_ids"], result["token_rewards"], result.get("routed_experts"))
        row_of = {(g.group_id, i): row for row, (g, i) in enumerate(round_.samples)}
        rows = [row_of[g.group_id, i] for g in done for i in range(g.size)]
        self.scheduler.rewarded(done, result["rewards"][rows], [result["codes"][r] for r in rows])
        self.episode_stats.append({k: result[k] for k in ("turns", "env_s")})

    def _episode_metrics(self, groups) -> dict[str, float]:
        """Success rate, turns (of all, and of those that succeeded) and tokens per turn of the step's
        trajectories (a turn is a run of generated tokens in the loss mask); env seconds per turn of
        the rounds played since the last step; failed envs by kind."""
        codes = [c for g in groups for c in g.codes]
        masks = [m.astype(np.int8) for g in groups for m in g.loss_masks]
        turns = np.array([int((np.diff(m, prepend=0) == 1).sum()) for m in masks])
        succeeded = np.array([c == "success" for c in codes], bool)
        metrics = {"success_rate": codes.count("success") / max(len(codes), 1),
                   "turns": float(turns.mean()) if len(turns) else 0.0,
                   **({"turns_to_success": float(turns[succeeded].mean())} if succeeded.any() else {}),
                   "tokens_per_turn": float(sum(int(m.sum()) for m in masks)) / max(int(turns.sum()), 1),
                   "trajectories_failed": float(sum(c.startswith("failed:") for c in codes))}
        if self.episode_stats:
            played = {k: np.concatenate([s[k] for s in self.episode_stats]) for k in ("turns", "env_s")}
            metrics["env_s_per_turn"] = float(played["env_s"].sum()) / max(int(played["turns"].sum()), 1)
            self.episode_stats = []
        for code in sorted({c for c in codes if c.startswith("failed:")}):
            metrics[f"envs_{code.split(':', 1)[1]}"] = float(codes.count(code))
        return metrics

    def _finish_scoring(self) -> None:
        """Hand the groups whose scores have come back to the scheduler (the rest stay in flight)."""
        for flight in [f for f in self.scoring if f.pending.done]:
            self.scoring.remove(flight)
            responses = Ragged.from_arrays([r for g in flight.groups for r in g.response_ids], np.int32)
            rewards, codes, outcomes = self.scorer.finish(flight.pending, responses)
            self.scheduler.rewarded(flight.groups, rewards, codes, outcomes)

    def _request_logprobs_early(self) -> None:
        """Send the next batch's log-prob calls now if its sequences are final, so that they run while
        the controller (or the reward workers) score it, as verl's launch_reward_fn_async overlaps
        the reward with the old log-probs: the trainer ranks would otherwise wait for the scores
        (the tiny job's scoring is 5 ms a step; a code sandbox's can be seconds). Calls are FIFO
        per rank, and the train call of the batch before it went out with its take: the actor's
        recompute runs on the weights this batch will train. Not while that call runs (K >= 1):
        queued behind it, the calls would hold back the staging of its weights for rollout."""
        batch = self.scheduler.next_batch
        if (self.logprobs is None and self.training is None
                and (groups := self.scheduler.settled(batch)) is not None):
            self.logprobs = self._request_logprobs(batch, groups)

    def _request_logprobs(self, step: int, groups: list[Group]) -> _Logprobs:
        sequences = {"prompt_ids": Ragged.from_arrays([g.prompt_ids for g in groups for _ in range(g.size)], np.int32),
                     "response_ids": Ragged.from_arrays([r for g in groups for r in g.response_ids], np.int32)}
        versions = np.concatenate([v for g in groups for v in g.token_versions])
        recompute = self._recomputes_old_logprobs(versions == step - 1)
        self.train_busy.start()
        self.residency.enter("logprobs")
        # the actor replays the rollout's routing (router_replay)
        actor = {**sequences, **routing_column([(g, i) for g in groups for i in range(g.size)])}
        pending = [self.groups["actor_train"].call("logprobs", Dispatch.DP_SPLIT, actor)] if recompute else []
        if "reference" in self.groups:
            pending.append(self.groups["reference"].call("logprobs", Dispatch.DP_SPLIT, sequences))
        if "critic" in self.groups:
            pending.append(self.groups["critic"].call("values", Dispatch.DP_SPLIT, sequences))
        return _Logprobs(step, groups, sequences, actor, versions, recompute, pending)

    def _recomputes_old_logprobs(self, fresh: np.ndarray) -> bool:
        """Whether the trainer recomputes a batch's old log-probs (rollout.recompute_logprobs). Where rollout
        ran the trainer's own model code on its float32 weights, the behaviour log-probs of fresh tokens
        are the old policy's up to rounding, and those of stale tokens are what the ppo correction takes
        the ratio against: a recompute would give the same numbers, or numbers nothing reads."""
        if (self.job.rollout.recompute_logprobs == "always" or not self.job.rollout_logprobs_are_trainers()
                or self.job.corrects_mismatch()):
            return True
        stale_need_proximal = self.job.rollout.is_correction != "ppo" or self.kl_in_reward_coef > 0
        return bool(stale_need_proximal and not fresh.all())

    def _add_time(self, stage: str, seconds: float) -> None:
        self.times[f"time_{stage}_s"] = self.times.get(f"time_{stage}_s", 0.0) + seconds

    # -- consumption --------------------------------------------------------------------------
    def _train(self, step: int) -> None:
        """Logprobs (sent early while it was scored, or now) and advantages for batch `step`, then the
        train call (asynchronous)."""
        algo = self.job.algorithm
        groups, stats = self.scheduler.take(step)
        started = time.perf_counter()
        sent, self.logprobs = self.logprobs, None
        if sent is None:
            sent = self._request_logprobs(step, groups)
        elif sent.step != step or [g.group_id for g in sent.groups] != [g.group_id for g in groups]:
            raise RuntimeError(f"the log-probs sent early were for batch {sent.step}'s groups "
                               f"{[g.group_id for g in sent.groups]}, batch {step} has {[g.group_id for g in groups]}")
        sequences, actor, versions, recompute = sent.sequences, sent.actor, sent.versions, sent.recompute
        fresh = versions == step - 1   # sampled by the weights the trainer holds
        behaviour = Ragged.from_arrays([lp for g in groups for lp in g.behaviour_logprobs], np.float32)
        rewards = np.concatenate([g.rewards for g in groups])
        group_index = np.repeat(np.arange(len(groups)), [g.size for g in groups])
        # an env's trajectories: observation tokens are context, not the policy's (no loss, no log-prob)
        loss_mask, token_rewards = ((Ragged.from_arrays([m for g in groups for m in g.loss_masks], np.float32),
                                     Ragged.from_arrays([r for g in groups for r in g.token_rewards], np.float32))
                                    if self.job.env is not None else (None, None))
        columns: dict[str, Ragged] = {} if recompute else {"old_logprobs": behaviour}
        for result in wait(*sent.pending):
            columns.update(result)
        # the wait for them here: what they add to the step beyond the scoring they overlapped
        self._add_time("logprobs", time.perf_counter() - started)
        old, ref = columns["old_logprobs"], columns.get("ref_logprobs")
        found = token_advantages(algo, rewards, group_index, old, ref, columns.get("values"), self.kl_in_reward_coef,
                                 loss_mask, token_rewards, sequences["prompt_ids"], sequences["response_ids"],
                                 self.history_states)
        train_batch = {**actor, **columns, **found.columns}
        if loss_mask is not None:
            train_batch["loss_mask"] = loss_mask
            fresh &= loss_mask.values > 0   # the log-prob gap below is over generated tokens
        metrics = {}
        # Tokens sampled by older weights are corrected (each by its own version's log-prob, when a
        # partial rollout's response spans versions); fresh ones too under mismatch correction.
        corrected = np.ones_like(versions, bool) if self.job.corrects_mismatch() else versions < step - 1
        train_batch.update(off_policy_columns(self.job.rollout, old, behaviour, corrected, loss_mask))
        if "importance_weights" in train_batch:
            weights = train_batch["importance_weights"].values
            metrics["is_weight_mean"] = float(weights[loss_mask.values > 0].mean() if loss_mask is not None
                                              else weights.mean())
        lr = learning_rate(self.job.train, step)
        self.residency.enter("train")
        calls = []
        if step > algo.critic_warmup_steps:   # the first steps of PPO train the critic alone
            calls.append(self.groups["actor_train"].call("train_step", Dispatch.DP_SPLIT, train_batch, lr))
        if "critic" in self.groups:
            critic_lr = lr * (self.job.train.critic_lr or self.job.train.lr) / self.job.train.lr
            calls.append(self.groups["critic"].call("train_step", Dispatch.DP_SPLIT,
                                                    {**sequences, "values": columns["values"],
                                                     "returns": train_batch["returns"]}, critic_lr))
        lengths = old.lengths
        metrics.update({
            "reward_mean": fmean(rewards),
            "reward_std": float(rewards.std()),   # statistics.pstdev sums exact fractions: 10x slower
            "accuracy": float(correct(np.concatenate([g.outcomes for g in groups])).mean()),
            "kl": mean_kl(old, ref, logged_kl_estimator(algo), loss_mask) if ref is not None else 0.0,
            "kl_in_reward_coef": self.kl_in_reward_coef,
            "sequence_kl": found.sequence_kl,
            "response_len": float(lengths.mean()),
            "samples": float(len(rewards)),
            "lr": lr,
            **stats,
            **domain_metrics(groups),
            **(self._episode_metrics(groups) if self.job.env is not None else {}),
        })
        if recompute:   # fresh tokens were sampled by the weights the trainer holds: their log-probs must agree
            metrics["rollout_logprob_gap_max"] = float(np.abs(old.values - behaviour.values)[fresh].max(initial=0.0))
        if algo.kl_in_reward.target is not None:
            self.kl_in_reward_coef = adaptive_kl_coef(self.kl_in_reward_coef, found.sequence_kl,
                                                      algo.kl_in_reward.target, len(rewards),
                                                      algo.kl_in_reward.horizon)
        self.training = _InFlight(_All(*calls), time.perf_counter(), version=step, metrics=metrics)
        if self.shared_weights and not self.job.log.check_weights:
            # Rollout samples with the trainer's own parameters, on its ranks, which serve calls in
            # order: the next round, sent now, runs on the weights this call makes as soon as it
            # ends, while the controller takes in the step (no staging or push to wait for).
            self.staged_version = self.rollout_version = step

    # -- the weight sync ----------------------------------------------------------------------
    def _copies_weights(self, digest: bool) -> bool:
        """Whether a sync stages and pushes: not when rollout samples with the trainer's own
        parameters, unless digests are asked for (they are compared on both sides)."""
        return digest or not self.shared_weights

    def _stage(self, digest: bool) -> None:
        """The trainer copies the weights of its current version to host memory (FIFO after the
        train call that made them, before the next)."""
        if self.staging is not None:   # its reply may have come in while the train call ran
            wait(self.staging.pending)
            self._staged()
        if not self._copies_weights(digest):
            self.staged_version = self.step
            return
        self.residency.need("actor_train", "train")   # the weights are read from the trainer's devices
        pending = self.groups["actor_train"].call("stage_weights", Dispatch.ONE_TO_ALL, self.step, digest)
        self.staging = _InFlight(pending, time.perf_counter(), version=self.step)
        self.train_busy.start()

    def _staged(self) -> None:
        flight, self.staging = self.staging, None
        if self.training is None:
            self.train_busy.stop()
        self.staged_version = flight.version
        self._add_time("stage", time.perf_counter() - flight.started)
        digests = flight.pending.value()
        if any(d is not None for d in digests):
            self.train_digest = self._replicas_agree(digests)

    def _replicas_agree(self, digests: list[list[tuple[str, str]] | None]) -> str:
        """Every trainer replica's digest (over its stage leaders' tensors) must be the same."""
        by_rank = dict(zip(self.groups["actor_train"].ranks, digests))
        replicas = [combine_digests([pair for rank in leaders for pair in by_rank[rank]])
                    for leaders in self.trainer_replicas]
        if len(set(replicas)) != 1:
            raise RuntimeError(f"trainer replicas diverged: actor_train digests {replicas}")
        self.digests = {"digest_actor_train": replicas}
        return replicas[0]

    def _push_ready(self) -> bool:
        """A push goes out when rollout is between rounds and its loaders are idle, so it never
        waits inside a collective for a round or a train step to end."""
        return (self.round is None and self.pushing is None and self.staging is None
                and self.staged_version > self.rollout_version and not busy(self.loaders.ranks))

    def _push(self, digest: bool) -> None:
        version = self.staged_version
        self.rollout_version = version   # every round started after this runs with these weights
        self.residency.enter("rollout")  # FIFO on the loaders: they are woken before the weights land
        if not self._copies_weights(digest):
            return
        self.pushing = _InFlight(_All(self.servers.call("push", Dispatch.ONE_TO_ALL, version),
                                      self.loaders.call("receive_weights", Dispatch.ONE_TO_ALL, digest)),
                                 time.perf_counter(), version=version)

    def _pushed(self) -> None:
        flight, self.pushing = self.pushing, None
        self._add_time("sync", time.perf_counter() - flight.started)
        _, loaded = flight.pending.value()
        if any(d is not None for d in loaded):
            if set(loaded) != {self.train_digest}:
                raise RuntimeError(f"weights diverged after the sync of version {flight.version}: actor_train "
                                   f"{self.train_digest}, actor_infer {loaded}")
            self.digests["digest_actor_infer"] = loaded

    def _sync_now(self, digest: bool = True) -> None:
        """Stage (unless a staging with digests is under way) and push at once, with digests
        compared (at start, and after every step with `log.check_weights`): waits for the round
        in flight. Without `digest` (evaluation) only what rollout lacks is sent, unchecked."""
        self._settle()
        if self.staged_version < self.step:
            self._stage(digest=digest)
            if self.staging is not None:
                wait(self.staging.pending)
                self._staged()
        if digest or self.rollout_version < self.step:
            self._push(digest=digest)
            if self.pushing is not None:
                wait(self.pushing.pending)
                self._pushed()

    def _settle(self) -> None:
        """Let the round, its scoring, the early log-probs, the staging and the push in flight end
        (checks, checkpoints); the log-probs' replies are kept for the train call."""
        if self.round is not None:
            wait(self.round.pending)
            self._finish_round()
        if self.logprobs is not None:
            wait(*self.logprobs.pending)
        if self.scoring:
            wait(*[f.pending for f in self.scoring])
            self._finish_scoring()
        if self.staging is not None:
            wait(self.staging.pending)
            self._staged()
        if self.pushing is not None:
            wait(self.pushing.pending)
            self._pushed()

    # -- the loop -----------------------------------------------------------------------------
    def _advance(self) -> None:
        """Start whatever may start now: training, staging, a push, a round."""
        staged = self.staged_version == self.step or (self.staging is not None and self.staging.version == self.step)
        if self.training is None and staged and self.scheduler.ready(self.step + 1):
            self._train(self.step + 1)   # FIFO behind the staging of the weights it will change
        if self.training is None and self.staging is None and self.pushing is None and self.staged_version < self.step:
            self._stage(digest=False)
        self._interrupt_round()
        if self._push_ready():
            self._push(digest=False)
        if self.round is None and self.staging is None:   # after a take, so rollout can start on the next batch
            self._start_round()

    def run(self) -> int:
        """Train to `train.steps`; returns the exit code (EXIT_REQUEUE or EXIT_STOPPED when asked to end
        early: see hpcrl.checkpoint.signals)."""
        job = self.job
        self._restore()
        startup.mark("checkpoint restored")
        # every role built: the first sync waits for no one
        workers = run(self.everyone, "ready", Dispatch.ONE_TO_ALL)
        startup.mark("every rank ready")
        self._sync_now()  # rollout starts from exactly the trainer's weights, checked once
        startup.mark("first weight sync")
        startup.write(self.run_dir, [startup.MARKS, *workers],
                      ["controller", *self.rank_roles])
        with StepRecorder(self.run_dir, job.train.steps, job.log.print_every, job.log.tensorboard,
                          resume_step=self.step, restored=self.history) as recorder:
            if self.step == 0 and self.evaluator.due(0):   # the starting point, what the run improves on
                recorder.record(0, {"policy_version": 0, **self._evaluate()})
            step_started = time.perf_counter()
            while self.step < job.train.steps:
                self._advance()
                # staging before training: a staging finished before the train call behind it is handled first
                flights = [f for f in (self.round, self.staging, self.pushing, self.training) if f is not None]
                if self.round is not None and self.round.queued:   # it ends after the train call ahead of it
                    flights.append(flights.pop(0))
                done = wait_any([f.pending for f in flights + self.scoring])
                if any(done is f.pending for f in self.scoring):
                    self._finish_scoring()
                elif self.round is not None and done is self.round.pending:
                    self._finish_round()
                elif self.staging is not None and done is self.staging.pending:
                    self._staged()
                elif self.pushing is not None and done is self.pushing.pending:
                    self._pushed()
                elif self.training is not None and done is self.training.pending:
                    metrics = self._trained()
                    if job.log.check_weights:
                        self._sync_now()
                        metrics.update(self.digests)
                    elapsed = time.perf_counter() - step_started
                    step_started = time.perf_counter()
                    metrics.update(self._step_times(elapsed, metrics["samples"]))
                    if self.evaluator.due(self.step):
                        metrics.update(self._evaluate())
                    recorder.record(self.step, {"step": self.step, **metrics, "policy_version": self.step})
                    if metrics["batch_groups"] < job.train.prompts_per_step:
                        recorder.write(f"hpcrl: step {self.step} trained on a short batch: {metrics['batch_groups']:.0f} "
                                       f"of {job.train.prompts_per_step} groups had varied rewards after "
                                       f"rollout.max_refills={job.rollout.max_refills} refills (dynamic sampling)")
                    self.history.append({"step": self.step, **{k: v for k, v in metrics.items()
                                                                if isinstance(v, (int, float))}})
                    request = self._request()
                    if request is not None or self.checkpointer.due(self.step):
                        self._save()
                        recorder.sync()
                    if request is not None and self.step < job.train.steps:
                        what = "exiting for requeue" if request == "requeue" else "stopping as asked"
                        recorder.write(f"hpcrl: {self._request_source()} received: checkpoint saved at step "
                                       f"{self.step}; {what}")
                        clear_control(self.run_dir)
                        return EXIT_REQUEUE if request == "requeue" else EXIT_STOPPED
        clear_control(self.run_dir)
        return 0

    def _trained(self) -> dict[str, Any]:
        flight, self.training = self.training, None
        self.train_busy.stop()
        self._add_time("train", time.perf_counter() - flight.started)
        self.step = flight.version
        if self.round is not None and self.round.queued:   # it has begun now that training ended
            self.round.started, self.round.queued = time.perf_counter(), False
            self.rollout_busy.start()
        metrics = flight.metrics
        for role, result in zip(flight.pending.roles, flight.pending.value()):
            role_metrics = result["metrics"]
            averaged = {k: fmean(m[k] for m in role_metrics) for k in role_metrics[0]}
            metrics.update(averaged if role == "actor_train" else {_critic_metric(k): v for k, v in averaged.items()})
        if self.pushing is None:   # staging now lets the next train call follow it at once
            self._stage(digest=self.job.log.check_weights)
        return metrics

    def _evaluate(self) -> dict[str, float]:
        """Evaluation of the policy of this step, once rollout holds its weights (hpcrl.runtime.evaluation)."""
        started = time.perf_counter()
        self._sync_now(digest=False)

        def generate(batch, attempt: int, greedy: bool) -> Ragged:
            self.residency.enter("rollout")
            return run(self.groups["actor_infer"], "generate", Dispatch.DP_SPLIT, batch, self.step, attempt,
                       greedy)["response_ids"]

        def score(prompts: Ragged, responses: Ragged, answers: list[str], domains: list[str]) -> np.ndarray:
            pending = self.scorer.start(prompts, responses, answers, domains)
            wait(pending)
            return self.scorer.finish(pending, responses)[2]   # the verifier's: no training shaping in pass@k

        metrics = self.evaluator.run(self.step, generate, score)
        metrics["time_eval_s"] = time.perf_counter() - started
        return metrics

    def _request(self) -> str | None:
        """'requeue' or 'stop' when a signal reached this rank or RUN_DIR/control asks for one (the
        batch script, `hpcrl run` and `hpcrl cancel` write it); a warning outranks a stop."""
        requests = {self.preemption.request, read_control(self.run_dir)}
        return "requeue" if "requeue" in requests else ("stop" if "stop" in requests else None)

    def _request_source(self) -> str:
        """Who asked: the signal this rank got, else what RUN_DIR/control says (the launcher's signal)."""
        return self.preemption.signal_name or control_reason(self.run_dir) or f"a {read_control(self.run_dir)} request"

    def _step_times(self, elapsed: float, samples: float) -> dict[str, float]:
        times = {k: self.times.get(k, 0.0) for k in ("time_rollout_s", "time_reward_s", "time_logprobs_s",
                                                     "time_train_s", "time_stage_s", "time_sync_s")}
        self.times = {}
        times["time_offload_s"], moves = self.residency.take()
        if moves:
            times["stage_moves"] = moves
        return {**times, "time_step_s": elapsed, "samples_per_s": samples / elapsed,
                "rollout_idle_frac": max(0.0, 1 - self.rollout_busy.take() / elapsed),
                "train_idle_frac": max(0.0, 1 - self.train_busy.take() / elapsed)}

    # -- checkpoints --------------------------------------------------------------------------
    def _save(self) -> None:
        self._settle()   # the round's samples go into the buffer; no collective is left in flight
        for role in ("actor_train", "critic"):   # save_state reads the trained roles' state on their devices
            self.residency.need(role, "train")
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "policy_version": self.step,
                 "kl_in_reward_coef": self.kl_in_reward_coef,
                 "next_group_id": self.scheduler.next_group_id,
                 "attempts": [[b, n] for b, n in self.scheduler.attempts.items()],
                 "rounds": [[b, n] for b, n in self.scheduler.rounds.items()]}
        self.checkpointer.save(self.step, state, self.history, self.scheduler.buffer())

    def _restore(self) -> None:
        for role in ("actor_train", "critic"):   # load_state writes into the engines' state on their devices
            self.residency.need(role, "train")
        state = self.checkpointer.restore(self.allowed_changes, self.restart, self.automatic_restart)
        if state is None:
            return
        controller = state.controller
        self.step = int(controller["step"])
        self.sampler.load_state_dict(controller["sampler"])
        self.scheduler.restore(self.step, state.buffer or {}, int(controller["next_group_id"]),
                               {int(b): int(n) for b, n in controller["attempts"]},
                               {int(b): int(n) for b, n in controller["rounds"]})
        self.history = [dict(m) for m in state.metrics]
        self.kl_in_reward_coef = float(controller.get("kl_in_reward_coef", self.kl_in_reward_coef))

    def shutdown(self) -> None:
        if self.servers.ranks:
            run(self.servers, SHUTDOWN, Dispatch.ONE_TO_ALL)
        run(self.everyone, SHUTDOWN, Dispatch.ONE_TO_ALL)


def _critic_metric(key: str) -> str:
    """The critic's train metrics under names of their own (its grad_norm is not the actor's)."""
    return key if key.startswith(("value", "vf_")) else f"critic_{key}"


class _All:
    """Calls that complete together (the two sides of one collective, or the train calls of a step's
    roles); waitable like a Pending."""

    def __init__(self, *parts: Pending):
        self.parts = parts

    @property
    def roles(self) -> list[str]:
        return [part.group.role for part in self.parts]

    @property
    def done(self) -> bool:
        return all(p.done for p in self.parts)

    def value(self) -> Any:
        return [p.value() for p in self.parts]
