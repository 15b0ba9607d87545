"""Checkpoints as the controller drives them: when to save, the multi-rank protocol, and resume.

Protocol: the controller opens a scratch directory, every worker writes its part (each training
role its DCP model + optimizer shards, every rank its RNG states), the controller writes its own
state (step, sampler position, scheduler, metrics) and the rollout buffer in HDF5, then commits: manifest with SHA-256s, atomic
rename, prune to the newest `checkpoint.keep`.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcrl.checkpoint import (Checkpoint, CheckpointStore, config_hash, load_rng, load_run_state, save_rng,
                              save_run_state)
from hpcrl.checkpoint.h5 import RunState
from hpcrl.config.job import JobConfig
from hpcrl.runtime.dispatch import Dispatch, WorkerGroup, run
from hpcrl.runtime.layout import WorldLayout

STATE_FILE = "state.h5"


class Checkpointer:
    def __init__(self, job: JobConfig, layout: WorldLayout, run_dir: Path, everyone: WorkerGroup):
        self.job = job
        self.layout = layout
        self.everyone = everyone
        self.store = CheckpointStore(run_dir, keep=job.checkpoint.keep)
        self.config = job.model_dump(mode="json")
        self.config_hash = config_hash(self.config)

    def due(self, step: int) -> bool:
        """Every `checkpoint.every` steps and after the last one; never with `every: 0` (signals only)."""
        every = self.job.checkpoint.every
        return every > 0 and (step % every == 0 or step == self.job.train.steps)

    def save(self, step: int, controller: dict[str, Any], metrics: list[dict[str, Any]],
             buffer: dict[str, list]) -> Checkpoint:
        scratch = self.store.begin(step)
        run(self.everyone, "save_checkpoint", Dispatch.ONE_TO_ALL, str(scratch))
        save_rng(scratch, 0)
        save_run_state(scratch / STATE_FILE, buffer=buffer, metrics=metrics, controller=controller)
        layout = {name: {"ranks": role.ranks, "dp_groups": role.dp_groups} for name, role in self.layout.roles.items()}
        checkpoint = self.store.commit(step, scratch, self.config_hash, layout, extra={"config": self.config})
        return checkpoint

    def restore(self) -> RunState | None:
        """Load the newest valid checkpoint into every rank; None for a fresh start."""
        checkpoint = self.store.latest_valid(self.config_hash, config=self.config)
        for message in self.store.skipped:
            print(f"hpcrl: {message}", file=sys.stderr, flush=True)
        if checkpoint is None:
            return None
        run(self.everyone, "load_checkpoint", Dispatch.ONE_TO_ALL, str(checkpoint.path))
        load_rng(checkpoint.path, 0)
        state = load_run_state(checkpoint.path / STATE_FILE)
        print(f"hpcrl: resuming from {checkpoint.path} (step {checkpoint.step})", file=sys.stderr, flush=True)
        return state
