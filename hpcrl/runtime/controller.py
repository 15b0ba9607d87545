"""The single controller (MPI rank 0): it runs the RL pipeline and is the only rank that decides.

One step: rollout -> reward -> logprobs (actor and reference) -> advantages -> train -> weight
sync. Workers only execute what it calls, so the whole algorithm reads top to bottom here.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from statistics import fmean, pstdev
from typing import Iterator

from hpcrl.checkpoint import EXIT_REQUEUE, PreemptionSignal
from hpcrl.config.job import JobConfig
from hpcrl.data import ResumableSampler, load_prompts
from hpcrl.metrics import StepRecorder
from hpcrl.runtime.advantages import mean_kl, token_advantages
from hpcrl.runtime.checkpointing import Checkpointer, controller_state
from hpcrl.runtime.dispatch import Dispatch, WorkerGroup, run, wait
from hpcrl.runtime.layout import WorldLayout
from hpcrl.runtime.messages import SHUTDOWN
from hpcrl.runtime.roles import score_responses


class Controller:
    def __init__(self, job: JobConfig, layout: WorldLayout, tokenizer, run_dir: Path, preemption: PreemptionSignal):
        self.job = job
        self.tokenizer = tokenizer
        self.run_dir = run_dir
        self.groups = {name: WorkerGroup(name, role.ranks, role.dp_groups) for name, role in layout.roles.items()}
        workers = sorted({rank for role in layout.roles.values() for rank in role.ranks})
        self.everyone = WorkerGroup("*", workers, [workers])
        self.sampler = ResumableSampler(load_prompts(job), seed=job.seed)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.timings: dict[str, float] = {}
        self.preemption = preemption
        self.checkpointer = Checkpointer(job, layout, run_dir, self.everyone)

    @contextmanager
    def _timed(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[f"time_{stage}_s"] = time.perf_counter() - start

    def sync_weights(self) -> None:
        wait(self.groups["actor_train"].call("send_weights", Dispatch.ONE_TO_ALL),
             self.groups["actor_infer"].call("receive_weights", Dispatch.ONE_TO_ALL))

    def check_weights(self) -> dict[str, list[str]]:
        """Digests of every trainer replica and rollout rank; a mismatch stops the run."""
        train, infer = wait(self.groups["actor_train"].call("digest", Dispatch.ONE_TO_ALL),
                            self.groups["actor_infer"].call("digest", Dispatch.ONE_TO_ALL))
        if len(set(train) | set(infer)) != 1:
            raise RuntimeError(f"weights diverged after the sync: actor_train {train}, actor_infer {infer}")
        return {"digest_actor_train": train, "digest_actor_infer": infer}

    def train_one_step(self, step: int) -> dict[str, float]:
        job, algo = self.job, self.job.algorithm
        self.timings = {}
        started = time.perf_counter()
        prompts = self.sampler.next_batch(job.train.prompts_per_step)
        batch: dict[str, list] = {
            "prompt_ids": [self.tokenizer.encode(p.text) for p in prompts for _ in range(algo.group_size)],
            "answers": [p.answer for p in prompts for _ in range(algo.group_size)],
            "group_index": [i for i in range(len(prompts)) for _ in range(algo.group_size)],
        }
        with self._timed("rollout"):
            batch.update(run(self.groups["actor_infer"], "generate", Dispatch.DP_SPLIT,
                             {"prompt_ids": batch["prompt_ids"]}, step))
        with self._timed("reward"):
            if "reward" in self.groups:
                batch.update(run(self.groups["reward"], "score", Dispatch.DP_SPLIT,
                                 {k: batch[k] for k in ("response_ids", "answers")}))
            else:
                batch["rewards"] = score_responses(self.tokenizer, batch["response_ids"], batch["answers"])
        sequences = {k: batch[k] for k in ("prompt_ids", "response_ids")}
        with self._timed("logprobs"):
            pending = [self.groups["actor_train"].call("logprobs", Dispatch.DP_SPLIT, sequences)]
            if "reference" in self.groups:
                pending.append(self.groups["reference"].call("logprobs", Dispatch.DP_SPLIT, sequences))
            for result in wait(*pending):
                batch.update(result)
        lengths = [len(r) for r in batch["response_ids"]]
        # Rollout and trainer hold the same weights, so their log-probabilities must agree.
        logprob_gap = max(abs(a - b) for old, behaviour in zip(batch["old_logprobs"], batch["behaviour_logprobs"])
                          for a, b in zip(old, behaviour))
        batch["advantages"] = token_advantages(algo, batch["rewards"], batch["group_index"], lengths,
                                               batch["old_logprobs"], batch.get("ref_logprobs"))
        train_keys = ("prompt_ids", "response_ids", "old_logprobs", "ref_logprobs", "advantages")
        with self._timed("train"):
            result = run(self.groups["actor_train"], "train_step", Dispatch.DP_SPLIT,
                         {k: batch[k] for k in train_keys if k in batch})
        with self._timed("sync"):
            self.sync_weights()
        digests = self.check_weights() if job.log.check_weights else {}
        self.step = step
        elapsed = time.perf_counter() - started
        train_metrics = {k: fmean(m[k] for m in result["metrics"]) for k in result["metrics"][0]}
        rewards = batch["rewards"]
        metrics = {
            "step": step,
            "reward_mean": fmean(rewards),
            "reward_std": pstdev(rewards),
            "accuracy": fmean(1.0 if r == 1.0 else 0.0 for r in rewards),
            "kl": mean_kl(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator)
            if "ref_logprobs" in batch else 0.0,
            **train_metrics,
            "response_len": fmean(lengths),
            "rollout_logprob_gap_max": logprob_gap,
            **self.timings,
            "time_step_s": elapsed,
            "samples_per_s": len(rewards) / elapsed,
            "policy_version": step,
            **digests,
        }
        return metrics

    def run(self) -> int:
        """Train to `train.steps`; returns the exit code (EXIT_REQUEUE when stopped by a signal)."""
        job = self.job
        restored = self.checkpointer.restore()
        if restored is not None:
            self.step, self.sampler.state, self.history = restored
        self.sync_weights()  # rollout starts from exactly the trainer's weights
        with StepRecorder(self.run_dir, job.train.steps, job.log.print_every, job.log.tensorboard,
                          resume_step=self.step) as recorder:
            for step in range(self.step + 1, job.train.steps + 1):
                metrics = self.train_one_step(step)
                recorder.record(step, metrics)
                self.history.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
                if self.checkpointer.due(step) or self.preemption.requested:
                    self.save(step)
                if self.preemption.requested and step < job.train.steps:
                    recorder.write(f"hpcrl: {self.preemption.signal_name} received: checkpoint saved at step "
                                   f"{step}; exiting for requeue")
                    return EXIT_REQUEUE
        return 0

    def save(self, step: int) -> None:
        with self._timed("checkpoint"):
            self.checkpointer.save(step, controller_state(step, self.sampler.state), self.history)

    def shutdown(self) -> None:
        run(self.everyone, SHUTDOWN, Dispatch.ONE_TO_ALL)
