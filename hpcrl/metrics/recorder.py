"""``StepRecorder``: the one object the controller (rank 0) records step metrics through.

It fans a step's metrics out to the durable JSONL, TensorBoard and the terminal, and on resume
cuts all of them back to the checkpoint's step so the resumed run records every step once.
Steps count from 1: step N is recorded after the N-th update, and ``resume_step`` is the step
the checkpoint was saved after (0 for a fresh run).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping

from .jsonl import METRICS_FILE, MetricsLog, read_metrics
from .progress import StepProgress
from .tensorboard import TENSORBOARD_DIR, TensorBoardLog, scalar_value


class StepRecorder:
    """Writes ``run_dir/metrics.jsonl``, ``run_dir/tensorboard/`` and terminal progress.

    A fresh run (``resume_step=0``) starts an empty JSONL and tells TensorBoard to drop any older
    points in the directory; a resumed run keeps records with ``step <= resume_step``, purges
    TensorBoard points after it, and starts the bar and the reward sparkline where it left off.
    ``show_progress=False`` keeps the files but prints nothing.
    """

    def __init__(self, run_dir: str | os.PathLike[str], total_steps: int, print_every: int,
                 tensorboard: bool, resume_step: int = 0, show_progress: bool = True,
                 restored: list[dict[str, Any]] | None = None) -> None:
        """`restored`: the checkpoint's record of steps 1..resume_step, to rebuild what the JSONL lacks."""
        if resume_step < 0:
            raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.resume_step = int(resume_step)
        history: list[tuple[int, float]] = []
        if self.resume_step > 0:
            self.jsonl = MetricsLog(self.metrics_path, resume_step=self.resume_step, restored=restored)
            if self.jsonl.rebuilt:
                print(f"hpcrl: {self.metrics_path}: {self.jsonl.rebuilt} step(s) were missing; rebuilt from the "
                      "checkpoint's record of them", file=sys.stderr, flush=True)
            for record in read_metrics(self.metrics_path):
                reward = scalar_value(record.get("reward_mean"))
                step = scalar_value(record.get("step"))
                if reward is not None and step is not None:
                    history.append((int(step), reward))
        else:
            self.jsonl = MetricsLog(self.metrics_path, fresh=True)
        self.tensorboard: TensorBoardLog | None = None
        try:
            if tensorboard:
                # purge_step: TensorBoard hides older points at or after it (the cut-short tail)
                self.tensorboard = TensorBoardLog(self.run_dir / TENSORBOARD_DIR,
                                                  purge_step=self.resume_step + 1 if self.resume_step else 0)
            self.progress = StepProgress(total_steps, initial=self.resume_step, enabled=show_progress,
                                         print_every=print_every, history=history)
        except BaseException:
            self.jsonl.close()
            if self.tensorboard is not None:
                self.tensorboard.close()
            raise
        self._closed = False

    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step: the JSONL line first, then TensorBoard, then the terminal."""
        if self._closed:
            raise ValueError(f"StepRecorder({self.run_dir}) is closed")
        record = {"step": int(step), **{k: v for k, v in metrics.items() if k != "step"}}
        self.jsonl.write(record)
        if self.tensorboard is not None:
            self.tensorboard.log(record["step"], record)
        self.progress.update(record["step"], record)

    def sync(self) -> None:
        """Make the JSONL lines so far durable (at each checkpoint)."""
        self.jsonl.sync()

    def write(self, line: str) -> None:
        """Print a message line without breaking the progress bar."""
        self.progress.write(line)

    def close(self) -> None:
        """Close the bar (printing the reward sparkline), TensorBoard and the JSONL."""
        if self._closed:
            return
        self._closed = True
        try:
            self.progress.close()
        finally:
            try:
                if self.tensorboard is not None:
                    self.tensorboard.close()
            finally:
                self.jsonl.close()

    def __enter__(self) -> "StepRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
