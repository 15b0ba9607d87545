"""The single controller (MPI rank 0): it runs the RL pipeline and is the only rank that decides.

An event loop over asynchronous worker calls. Production: generation rounds on the rollout ranks,
scored as each returns, while training runs (the next round of a batch waits for the scores:
dynamic sampling decides from them what to refill). Consumption: for step b,
logprobs (actor and reference) -> advantages -> train, then the weight sync. The rollout
scheduler decides what may be generated with which weights (the staleness bound); with
`rollout.max_staleness: 0` this is exactly the synchronous pipeline.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from statistics import fmean, pstdev
from typing import Any

from hpcrl.checkpoint import EXIT_REQUEUE, PreemptionSignal
from hpcrl.config.job import JobConfig
from hpcrl.data import ResumableSampler, SamplerState, load_prompts
from hpcrl.engines.lr_schedule import learning_rate
from hpcrl.metrics import StepRecorder
from hpcrl.rewards import score_responses
from hpcrl.rollout.lifecycle import Group
from hpcrl.rollout.scheduler import RolloutScheduler
from hpcrl.runtime.advantages import mean_kl, token_advantages
from hpcrl.runtime.checkpointing import Checkpointer
from hpcrl.runtime.dispatch import Dispatch, Pending, WorkerGroup, run, wait, wait_any
from hpcrl.runtime.layout import WorldLayout
from hpcrl.runtime.messages import SHUTDOWN
from hpcrl.runtime.off_policy import off_policy_columns


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


class Controller:
    def __init__(self, job: JobConfig, layout: WorldLayout, tokenizer, run_dir: Path, preemption: PreemptionSignal):
        self.job = job
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.groups = {name: WorkerGroup(name, role.ranks, role.dp_groups) for name, role in layout.roles.items()}
        workers = sorted({rank for role in layout.roles.values() for rank in role.ranks})
        self.everyone = WorkerGroup("*", workers, [workers])
        self.sampler = ResumableSampler(load_prompts(job), seed=job.seed)
        self.scheduler = RolloutScheduler(job, self.sampler, tokenizer.encode)
        self.preemption = preemption
        self.checkpointer = Checkpointer(job, layout, run_dir, self.everyone)
        self.step = 0                 # train steps done = the policy version the trainer holds
        self.rollout_version = 0      # the version of the last weights sent to rollout (calls are FIFO)
        self.history: list[dict[str, float]] = []
        self.round: tuple[Pending, int, list[Group], float] | None = None   # in-flight generation
        self.sync: _Both | None = None
        self.sync_started = 0.0
        self.rollout_busy, self.train_busy = Busy(), Busy()
        self.times: dict[str, float] = {}

    # -- production ---------------------------------------------------------------------------
    def _start_round(self) -> None:
        found = self.scheduler.next_round(self.rollout_version)
        if found is None:
            return
        batch, attempt, groups = found
        prompts = [g.prompt_ids for g in groups for _ in range(g.size)]
        pending = self.groups["actor_infer"].call("generate", Dispatch.DP_SPLIT, {"prompt_ids": prompts}, batch, attempt)
        self.round = (pending, batch, groups, time.perf_counter())
        self.rollout_busy.start()

    def _finish_round(self) -> None:
        pending, batch, groups, started = self.round
        self.round = None
        self.rollout_busy.stop()
        result = pending.value()
        self._add_time("rollout", time.perf_counter() - started)
        started = time.perf_counter()
        answers = [g.answer for g in groups for _ in range(g.size)]
        if "reward" in self.groups:
            rewards = run(self.groups["reward"], "score", Dispatch.DP_SPLIT,
                          {"response_ids": result["response_ids"], "answers": answers})["rewards"]
        else:
            rewards = score_responses(self.tokenizer, result["response_ids"], answers)
        self.scheduler.finish_round(groups, result["response_ids"], result["behaviour_logprobs"], rewards)
        self._add_time("reward", time.perf_counter() - started)

    def _add_time(self, stage: str, seconds: float) -> None:
        self.times[f"time_{stage}_s"] = self.times.get(f"time_{stage}_s", 0.0) + seconds

    # -- consumption --------------------------------------------------------------------------
    def _train(self, step: int) -> tuple[Pending, dict[str, Any]]:
        """Logprobs and advantages for batch `step` (synchronous), then the train call (asynchronous)."""
        algo = self.job.algorithm
        groups, stats = self.scheduler.take(step)
        batch: dict[str, list] = {
            "prompt_ids": [g.prompt_ids for g in groups for _ in range(g.size)],
            "response_ids": [r for g in groups for r in g.response_ids],
            "behaviour_logprobs": [lp for g in groups for lp in g.behaviour_logprobs],
            "rewards": [r for g in groups for r in g.rewards],
            "group_index": [i for i, g in enumerate(groups) for _ in range(g.size)],
        }
        started = time.perf_counter()
        self.train_busy.start()
        sequences = {k: batch[k] for k in ("prompt_ids", "response_ids")}
        pending = [self.groups["actor_train"].call("logprobs", Dispatch.DP_SPLIT, sequences)]
        if "reference" in self.groups:
            pending.append(self.groups["reference"].call("logprobs", Dispatch.DP_SPLIT, sequences))
        for result in wait(*pending):
            batch.update(result)
        self._add_time("logprobs", time.perf_counter() - started)
        lengths = [len(r) for r in batch["response_ids"]]
        batch["advantages"] = token_advantages(algo, batch["rewards"], batch["group_index"], lengths,
                                               batch["old_logprobs"], batch.get("ref_logprobs"))
        train_keys = ("prompt_ids", "response_ids", "old_logprobs", "ref_logprobs", "advantages")
        train_batch = {k: batch[k] for k in train_keys if k in batch}
        if stats["staleness_max"] > 0:
            train_batch.update(off_policy_columns(self.job.rollout, batch["old_logprobs"], batch["behaviour_logprobs"]))
        lr = learning_rate(self.job.train, step)
        call = self.groups["actor_train"].call("train_step", Dispatch.DP_SPLIT, train_batch, lr)
        gap = max(abs(a - b) for old, beh in zip(batch["old_logprobs"], batch["behaviour_logprobs"])
                  for a, b in zip(old, beh))
        rewards = batch["rewards"]
        metrics = {
            "reward_mean": fmean(rewards),
            "reward_std": pstdev(rewards),
            "accuracy": fmean(1.0 if r == 1.0 else 0.0 for r in rewards),
            "kl": mean_kl(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator)
            if "ref_logprobs" in batch else 0.0,
            "response_len": fmean(lengths),
            # With fresh samples rollout and trainer hold the same weights: their log-probs must agree.
            "rollout_logprob_gap_max": gap,
            "samples": float(len(rewards)),
            "lr": lr,
            **stats,
        }
        return call, metrics

    def _sync_weights(self) -> "_Both":
        """Send the trainer's weights to rollout. Each rank runs its calls in order, so every round
        started after this runs with these weights: that is what `rollout_version` records."""
        self.rollout_version = self.step
        return _Both(self.groups["actor_train"].call("send_weights", Dispatch.ONE_TO_ALL),
                     self.groups["actor_infer"].call("receive_weights", Dispatch.ONE_TO_ALL))

    def check_weights(self) -> dict[str, list[str]]:
        """Digests of every trainer replica and rollout rank; a mismatch stops the run."""
        train, infer = wait(self.groups["actor_train"].call("digest", Dispatch.ONE_TO_ALL),
                            self.groups["actor_infer"].call("digest", Dispatch.ONE_TO_ALL))
        if len(set(train) | set(infer) - {None}) != 1:
            raise RuntimeError(f"weights diverged after the sync: actor_train {train}, actor_infer {infer}")
        return {"digest_actor_train": train, "digest_actor_infer": infer}

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        """Train to `train.steps`; returns the exit code (EXIT_REQUEUE when stopped by a signal)."""
        job = self.job
        self._restore()
        wait(self._sync_weights())  # rollout starts from exactly the trainer's weights
        with StepRecorder(self.run_dir, job.train.steps, job.log.print_every, job.log.tensorboard,
                          resume_step=self.step) as recorder:
            step_started = time.perf_counter()
            training: tuple[Pending, dict[str, Any], float] | None = None
            while self.step < job.train.steps:
                if training is None and self.scheduler.ready(self.step + 1):
                    call, metrics = self._train(self.step + 1)
                    training = (call, metrics, time.perf_counter())
                if self.round is None:   # after a take, so rollout can start on the next batch
                    self._start_round()
                waiting = [p for p in (self.round and self.round[0], training and training[0], self.sync) if p]
                done = wait_any(waiting)
                if self.round is not None and done is self.round[0]:
                    self._finish_round()
                elif self.sync is not None and done is self.sync:
                    self.sync = None
                    self._add_time("sync", time.perf_counter() - self.sync_started)
                elif training is not None and done is training[0]:
                    call, metrics, started = training
                    training = None
                    self.train_busy.stop()
                    self._add_time("train", time.perf_counter() - started)
                    self.step += 1
                    train_metrics = call.value()["metrics"]
                    metrics.update({k: fmean(m[k] for m in train_metrics) for k in train_metrics[0]})
                    self.sync_started = time.perf_counter()
                    self.sync = self._sync_weights()
                    if job.log.check_weights or self._checkpoint_due():
                        wait(self.sync)            # the checks and the checkpoint need the synced weights
                        self.sync = None
                        self._add_time("sync", time.perf_counter() - self.sync_started)
                    if job.log.check_weights:
                        metrics.update(self.check_weights())
                    elapsed = time.perf_counter() - step_started
                    step_started = time.perf_counter()
                    metrics.update(self._step_times(elapsed, metrics["samples"]))
                    recorder.record(self.step, {"step": self.step, **metrics, "policy_version": self.step})
                    self.history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
                    if self._checkpoint_due():
                        self._save()
                    if self.preemption.requested and self.step < job.train.steps:
                        recorder.write(f"hpcrl: {self.preemption.signal_name} received: checkpoint saved at "
                                       f"step {self.step}; exiting for requeue")
                        return EXIT_REQUEUE
        return 0

    def _checkpoint_due(self) -> bool:
        return self.checkpointer.due(self.step) or self.preemption.requested

    def _step_times(self, elapsed: float, samples: float) -> dict[str, float]:
        times = {k: self.times.get(k, 0.0) for k in
                 ("time_rollout_s", "time_reward_s", "time_logprobs_s", "time_train_s", "time_sync_s")}
        self.times = {}
        return {**times, "time_step_s": elapsed, "samples_per_s": samples / elapsed,
                "rollout_idle_frac": max(0.0, 1 - self.rollout_busy.take() / elapsed),
                "train_idle_frac": max(0.0, 1 - self.train_busy.take() / elapsed)}

    # -- checkpoints --------------------------------------------------------------------------
    def _save(self) -> None:
        if self.round is not None:   # finish the round in flight so its samples are in the buffer
            wait(self.round[0])
            self._finish_round()
        state = {"step": self.step, "sampler": asdict(self.sampler.state), "policy_version": self.step,
                 "next_group_id": self.scheduler.next_group_id,
                 "attempts": [[b, n] for b, n in self.scheduler.attempts.items()]}
        self.checkpointer.save(self.step, state, self.history, self.scheduler.buffer())

    def _restore(self) -> None:
        state = self.checkpointer.restore()
        if state is None:
            return
        controller = state.controller
        self.step = int(controller["step"])
        self.sampler.state = SamplerState(**controller["sampler"])
        self.scheduler.restore(self.step, state.buffer or {}, int(controller["next_group_id"]),
                               {int(b): int(n) for b, n in controller["attempts"]})
        self.history = [dict(m) for m in state.metrics]

    def shutdown(self) -> None:
        run(self.everyone, SHUTDOWN, Dispatch.ONE_TO_ALL)


class _Both:
    """Two calls that complete together (the two sides of one collective); waitable like a Pending."""

    def __init__(self, first: Pending, second: Pending):
        self.parts = (first, second)

    @property
    def done(self) -> bool:
        return all(p.done for p in self.parts)

    def value(self) -> Any:
        return [p.value() for p in self.parts]
