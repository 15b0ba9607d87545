"""Atomic checkpoint directories with a manifest and checksums, model/optimizer state (DCP), RNG
state, rollout buffer and metrics in HDF5, preemption signals and Slurm requeue.

Importing this package does not import torch or h5py: the store and manifest verify checkpoints
on a login node (`hpcrl status`). The torch/h5py parts load on first use of their names.
"""
from __future__ import annotations

import importlib
from typing import Any

from hpcrl.checkpoint.manifest import (FORMAT_VERSION, MANIFEST_NAME, SAFE_CONFIG_FIELDS, FileEntry, Manifest,
                                       ManifestError, config_changes, config_hash)
from hpcrl.checkpoint.signals import (EXIT_REQUEUE, PREEMPTION_SIGNALS, PreemptionSignal, clear_control,
                                      control_reason, read_control, requeue_slurm_job, write_control)
from hpcrl.checkpoint.store import (CHECKPOINTS_DIR, Checkpoint, CheckpointError, CheckpointStore,
                                    ConfigMismatchError, ScanEntry)

_LAZY = {
    "save_train_state": "model_state", "load_train_state": "model_state",
    "capture_rng": "rng", "restore_rng": "rng", "save_rng": "rng", "load_rng": "rng", "rng_path": "rng",
    "RunState": "h5", "save_run_state": "h5", "load_run_state": "h5", "STATE_FILE": "h5",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcrl.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpcrl.checkpoint.{module}"), name)


__all__ = [
    "FORMAT_VERSION", "MANIFEST_NAME", "SAFE_CONFIG_FIELDS", "FileEntry", "Manifest", "ManifestError",
    "config_changes", "config_hash",
    "EXIT_REQUEUE", "PREEMPTION_SIGNALS", "PreemptionSignal", "clear_control", "control_reason", "read_control",
    "requeue_slurm_job", "write_control",
    "CHECKPOINTS_DIR", "Checkpoint", "CheckpointError", "CheckpointStore", "ConfigMismatchError", "ScanEntry",
    *_LAZY,
]
