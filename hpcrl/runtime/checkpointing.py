"""Checkpoints as the controller drives them: when to save, the multi-rank protocol, and resume.

Protocol: the controller opens a scratch directory, every worker writes its part (each training
role its DCP model + optimizer shards, every rank its RNG states), the controller writes its own
state (step, sampler position, scheduler, metrics) and the rollout buffer in HDF5, then commits: manifest with SHA-256s, atomic
rename, prune to the newest `checkpoint.keep`.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcrl.checkpoint import (Checkpoint, CheckpointStore, config_hash, load_rng, load_run_state, save_rng,
                              save_run_state)
from hpcrl.checkpoint.h5 import RunState, StateFormatError
from hpcrl.checkpoint.manifest import FileEntry, Manifest
from hpcrl.config.job import JobConfig
from hpcrl.engines.lr_schedule import learning_rate
from hpcrl.metrics.jsonl import METRICS_FILE
from hpcrl.runtime.dispatch import Dispatch, WorkerGroup, run, wait
from hpcrl.runtime.layout import WorldLayout

STATE_FILE = "state.h5"


class RefusedError(RuntimeError):
    """The run cannot start as asked without losing what the run directory holds."""


class Checkpointer:
    def __init__(self, job: JobConfig, layout: WorldLayout, run_dir: Path, everyone: WorkerGroup):
        self.job = job
        self.layout = layout
        self.everyone = everyone
        self.run_dir = run_dir
        self.store = CheckpointStore(run_dir, keep=job.checkpoint.keep)
        self.config = job.model_dump(mode="json")
        self.config_hash = config_hash(self.config)

    def _checkpoint_dirs(self) -> list[str]:
        """The checkpoints ever written here, intact or set aside as step-N.corrupt."""
        return sorted(p.name for p in self.store.root.glob("step-*")) if self.store.root.is_dir() else []

    def _evidence(self, checkpoints: list[str]) -> str:
        """What the run directory holds of an earlier run (empty: nothing), `checkpoints` its
        `_checkpoint_dirs`."""
        from hpcrl.metrics import read_metrics

        found = []
        metrics = self.run_dir / METRICS_FILE
        if metrics.is_file() and metrics.stat().st_size:
            try:
                found.append(f"metrics of {len(read_metrics(metrics))} step(s)")
            except ValueError as exc:
                found.append(f"metrics it cannot read: {exc}")
        if checkpoints:
            found.append("checkpoints " + ", ".join(checkpoints))
        return "; ".join(found)

    def due(self, step: int) -> bool:
        """Every `checkpoint.every` steps and after the last one; never with `every: 0` (signals only)."""
        every = self.job.checkpoint.every
        return every > 0 and (step % every == 0 or step == self.job.train.steps)

    def save(self, step: int, controller: dict[str, Any], metrics: list[dict[str, Any]],
             buffer: dict[str, list]) -> Checkpoint:
        """Every rank writes its part; the controller writes its own state while the workers hash and
        fsync their share of the files, in parallel; then the manifest, the rename and the pruning."""
        scratch = self.store.begin(step)
        run(self.everyone, "save_checkpoint", Dispatch.ONE_TO_ALL, str(scratch))
        shares = _shares(scratch, [p.relative_to(scratch).as_posix() for p in scratch.rglob("*") if p.is_file()],
                         self.everyone.ranks)
        hashing = self.everyone.call("hash_files", Dispatch.ONE_TO_ALL, str(scratch), shares)
        save_rng(scratch, 0)
        save_run_state(scratch / STATE_FILE, buffer=buffer, metrics=metrics, controller=controller)
        hashed = {name: FileEntry(*entry) for part in wait(hashing)[0] for name, entry in part.items()}
        layout = {name: {"ranks": role.ranks, "dp_groups": role.dp_groups} for name, role in self.layout.roles.items()}
        return self.store.commit(step, scratch, self.config_hash, layout, extra={"config": self.config},
                                 hashed=hashed)

    def _deep_check(self, path: Path, manifest: Manifest) -> str | None:
        """Every file's SHA-256 against the manifest, the files spread over the workers."""
        expected = {name: entry.sha256 for name, entry in manifest.files.items()}
        shares = _shares(path, list(expected), self.everyone.ranks)
        checks = {rank: [(name, expected[name]) for name in names] for rank, names in shares.items()}
        problems = [p for p in run(self.everyone, "check_files", Dispatch.ONE_TO_ALL, str(path), checks) if p]
        return problems[0] if problems else None

    def restore(self, allowed_changes: Sequence[str] = (), restart: bool = False,
                automatic: bool = False) -> RunState | None:
        """Load the newest valid checkpoint into every rank; None for a fresh start. With no valid
        checkpoint over a run that already has metrics or checkpoints, refuse (RefusedError) unless
        `restart`: starting over would bury the evidence of what went wrong. `automatic` (a restart
        after a failure or a requeue) starts over only where no checkpoint was written yet: damaged
        ones still refuse, for a person to look at."""
        checkpoint = self.store.latest_valid(self.config_hash, config=self.config, allowed_changes=allowed_changes,
                                             deep_check=self._deep_check)
        for message in self.store.skipped + self.store.warnings:
            print(f"hpcrl: {message}", file=sys.stderr, flush=True)
        if checkpoint is None:
            checkpoints = self._checkpoint_dirs()
            evidence = self._evidence(checkpoints)
            if evidence and not (restart or (automatic and not checkpoints)):
                raise RefusedError(f"{self.run_dir} holds a run ({evidence}) but no checkpoint it can resume from. "
                                   "Give --restart to start it over from step 0 (its metrics move to "
                                   "metrics.superseded.jsonl, damaged checkpoints stay as step-N.corrupt), or "
                                   "use another --run-dir")
            return None
        self._note_schedule_horizon(checkpoint)
        try:   # before any rank loads a model: an unreadable state refuses (no restart would change it)
            state = load_run_state(checkpoint.path / STATE_FILE)
        except StateFormatError as exc:
            raise RefusedError(f"{exc}: resume it with the hpcrl version that wrote it; to start over instead, move "
                               f"{checkpoint.path.parent} aside and give --restart") from None
        run(self.everyone, "load_checkpoint", Dispatch.ONE_TO_ALL, str(checkpoint.path))
        load_rng(checkpoint.path, 0)
        print(f"hpcrl: resuming from {checkpoint.path} (step {checkpoint.step})", file=sys.stderr, flush=True)
        return state


    def _note_schedule_horizon(self, checkpoint: Checkpoint) -> None:
        """train.steps may change on resume (extending a run), but a decaying lr schedule runs over it:
        the rate jumps at the resume step. Said, with the rates, so that nobody finds it in the curves."""
        train = self.job.train
        saved = (checkpoint.manifest.extra.get("config") or {}).get("train", {}).get("steps", train.steps)
        if saved == train.steps or train.lr_schedule == "constant":
            return
        step = checkpoint.step + 1
        before = learning_rate(train.model_copy(update={"steps": saved}), step)
        print(f"hpcrl: train.steps {saved} -> {train.steps} under lr_schedule {train.lr_schedule}, which decays over "
              f"train.steps: step {step} trains at lr {learning_rate(train, step):.3g} instead of {before:.3g}, and "
              "the decay continues to the new last step", file=sys.stderr, flush=True)


def _shares(root: Path, names: list[str], ranks: list[int]) -> dict[int, list[str]]:
    """The files split over `ranks` by size, largest first to the least loaded (greedy)."""
    load = {rank: 0 for rank in ranks}
    shares: dict[int, list[str]] = {rank: [] for rank in ranks}
    for name in sorted(names, key=lambda n: -(root / n).stat().st_size):
        rank = min(load, key=load.get)
        shares[rank].append(name)
        load[rank] += (root / name).stat().st_size
    return shares
