"""Model and optimizer state of a training role, saved with torch.distributed.checkpoint (DCP).

DCP stores tensors by their parameter name (FQN) with a global layout in `.metadata`, so a
checkpoint written by N data-parallel ranks loads on M ranks, or in one process with no
process group at all. `get_state_dict` strips DDP's `module.` prefix and keys the optimizer
state by parameter name, so a DDP-wrapped module and the bare module are interchangeable.
DP replicas hold identical tensors; DCP's planner writes each one once, spread over the ranks.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every no_dist call that it 'assumes' one process; here it is the stated intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def _dist_args(process_group: dist.ProcessGroup | None) -> dict:
    """None means this rank alone, even when a default (world) group exists."""
    if process_group is None:
        return {"no_dist": True}
    return {"process_group": process_group}


def save_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
                     process_group: dist.ProcessGroup | None = None, thread_count: int = 1) -> None:
    """Collective over `process_group`: every DP rank calls it with the same `path` (a shared dir).

    `module` may be the DDP wrapper or the bare model. process_group=None: a single process.
    """
    path = Path(path)
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
    else:
        model_sd, optim_sd = _train_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    writer = dcp.FileSystemWriter(path, thread_count=thread_count, sync_files=True)
    with _quiet_single_process():
        dcp.save(state, storage_writer=writer, **_dist_args(process_group))


def _train_state_dict(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """`get_state_dict` materialises a fresh optimizer's state with a zero-lr step() that counts as
    Adam's first step (e.g. an actor saved during the critic warm-up): its first real update would
    then use step 2's bias correction. Zero moments at step 0 are exactly Adam's lazy init, so the
    count is undone, in the live optimizer and the saved state alike (they share the tensors)."""
    fresh = not optimizer.state
    model_sd, optim_sd = get_state_dict(module, optimizer)
    if fresh:
        for state in optimizer.state.values():
            state["step"].zero_()
    return model_sd, optim_sd


def load_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
                     process_group: dist.ProcessGroup | None = None) -> None:
    """Collective over `process_group`; restores parameters and optimizer state in place, bit-exact.

    The DP size may differ from the one that saved. The optimizer's param_groups (lr, betas,
    weight_decay, ...) come from the checkpoint too, as with `optimizer.load_state_dict`.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: no DCP checkpoint here (.metadata missing)")
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
    else:
        if not optimizer.state:
            # get_state_dict materialises empty Adam state (a zero-lr step) only when no grad is
            # set; without it the loaded state would be silently dropped.
            optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    reader = dcp.FileSystemReader(path)
    _check_keys(path, reader, state)
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, **_dist_args(process_group))
    if optimizer is None:
        set_model_state_dict(module, state["model"])
    else:
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _tensor_keys(state: dict) -> set[str]:
    """DCP's flattened names of the model tensors and the optimizer's per-parameter state."""
    keys = {f"model.{name}" for name in state["model"]}
    for fqn, values in state.get("optim", {}).get("state", {}).items():
        keys.update(f"optim.state.{fqn}.{name}" for name in values)
    return keys


def _check_keys(path: Path, reader: dcp.FileSystemReader, state: dict) -> None:
    """DCP silently ignores saved tensors nobody asks for: say so when model or optimizer differ."""
    saved = {key for key in reader.read_metadata().state_dict_metadata
             if key.startswith("model.") or (key.startswith("optim.state.") and "optim" in state)}
    wanted = _tensor_keys(state)
    for keys, what in ((saved - wanted, "saved but not in this model/optimizer"),
                       (wanted - saved, "in this model/optimizer but not saved")):
        if keys:
            shown = ", ".join(sorted(keys)[:5]) + (", ..." if len(keys) > 5 else "")
            raise RuntimeError(f"{path}: {len(keys)} tensor(s) {what} ({shown}): "
                               "was this checkpoint written for a different model or optimizer?")
