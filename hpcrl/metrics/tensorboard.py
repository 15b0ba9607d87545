"""Step metrics as TensorBoard scalars, for watching a run from a browser.

torch (and its TensorBoard writer) is imported only when a ``TensorBoardLog`` is made, so this
package imports on a login node without a GPU stack; ``hpcrl report`` never needs it.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any, Mapping

TENSORBOARD_DIR = "tensorboard"


class TensorBoardUnavailable(RuntimeError):
    """TensorBoard logging was asked for but its packages cannot be imported."""


def scalar_value(value: Any) -> float | None:
    """``value`` as a float if it is one numeric scalar (int, float, numpy / 0-d torch), else None.

    Booleans, strings, lists and multi-element arrays are not curves and are skipped.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    size = getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    count = numel() if callable(numel) else size if isinstance(size, int) else None
    if callable(item) and count == 1:
        try:
            out = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return None if isinstance(out, bool) or not isinstance(out, numbers.Real) else float(out)
    return None


class TensorBoardLog:
    """Writes every numeric scalar of a step's metrics under its own key as the tag.

    ``purge_step`` (on resume: the checkpoint's step + 1) tells TensorBoard to drop points at and
    after that step left in older event files by the run that was cut short, so resumed curves
    have no doubled tail.
    """

    def __init__(self, logdir: str | os.PathLike[str], purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TensorBoardUnavailable(
                f"TensorBoard logging needs torch and the 'tensorboard' package ({exc}); "
                "install them (pip install tensorboard) or set log.tensorboard=false in the job"
            ) from exc
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.logdir), purge_step=purge_step)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> int:
        """Write the numeric scalars of ``metrics`` at ``step``; returns how many were written.

        Flushed every step so the event file is as current as the JSONL when a job is killed.
        """
        if self._closed:
            raise ValueError(f"TensorBoardLog({self.logdir}) is closed")
        written = 0
        for key, value in metrics.items():
            if key == "step":
                continue
            number = scalar_value(value)
            if number is None:
                continue
            self._writer.add_scalar(str(key), number, global_step=int(step))
            written += 1
        self._writer.flush()
        return written

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["TENSORBOARD_DIR", "TensorBoardLog", "TensorBoardUnavailable", "scalar_value"]
