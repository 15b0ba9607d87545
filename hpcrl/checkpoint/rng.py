"""Every global RNG state of a rank (python `random`, numpy, torch CPU, torch CUDA), one file per rank.

Sampling in hpcrl is seeded per (seed, step, replica) and does not depend on these; they cover
everything else (dropout, shuffles in user code) so a resumed run continues the same streams.
The file is JSON (`rng/rank-<k>.json`): no pickle to trust on load, readable without torch.
numpy `Generator` objects made with `default_rng` are not global and are not captured.
"""
from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

RNG_DIR = "rng"


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """The states as JSON-able data. CUDA only if this process initialised it (else it was never used)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what capture_rng returned. CUDA states are restored for the devices both runs have."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(_tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        for device, text in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_tensor(text), device)


def rng_path(checkpoint_dir: str | os.PathLike, rank: int) -> Path:
    return Path(checkpoint_dir) / RNG_DIR / f"rank-{rank}.json"


def save_rng(checkpoint_dir: str | os.PathLike, rank: int) -> Path:
    """Write this rank's states to `<checkpoint_dir>/rng/rank-<rank>.json`."""
    path = rng_path(checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(capture_rng(), handle)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def load_rng(checkpoint_dir: str | os.PathLike, rank: int) -> bool:
    """Restore this rank's states; False (nothing changed) if the saving run had no such rank."""
    path = rng_path(checkpoint_dir, rank)
    if not path.is_file():
        return False
    restore_rng(json.loads(path.read_text()))
    return True
