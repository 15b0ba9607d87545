"""Terminal progress for the controller: a tqdm bar, a plain line every N steps, a closing sparkline.

The bar (stderr) is for a person at a terminal; the plain lines (stdout) are the reward curve as
it goes and are what survives in a Slurm log; the sparkline sums the run up in one line.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Mapping, Sequence

from .tensorboard import scalar_value

BLOCKS = "▁▂▃▄▅▆▇█"

# (metric key, label) in the order the plain line shows them; samples/s is appended last.
LINE_FIELDS: tuple[tuple[str, str], ...] = (("reward_mean", "reward"), ("kl", "kl"), ("loss", "loss"))


def _fmt(value: float) -> str:
    """Three significant digits: readable for rewards (0.431) and for tiny KLs (0.00213)."""
    return f"{value:.3g}"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """Values as unicode blocks ▁…█ scaled min→max; longer series are averaged into ``width`` bins.

    NaN/inf show as a space; a constant series is drawn mid-height.
    """
    if width < 1:
        raise ValueError("width must be at least 1")
    vals = [float(v) for v in values]
    if len(vals) > width:
        bins: list[float] = []
        for i in range(width):
            chunk = [v for v in vals[i * len(vals) // width:(i + 1) * len(vals) // width] if math.isfinite(v)]
            bins.append(sum(chunk) / len(chunk) if chunk else math.nan)
        vals = bins
    finite = [v for v in vals if math.isfinite(v)]
    if not finite:
        return " " * len(vals)
    lo, hi = min(finite), max(finite)
    top = len(BLOCKS) - 1
    out = []
    for v in vals:
        if not math.isfinite(v):
            out.append(" ")
        elif hi == lo:
            out.append(BLOCKS[top // 2])
        else:
            out.append(BLOCKS[round((v - lo) / (hi - lo) * top)])
    return "".join(out)


def format_step_line(step: int, total_steps: int, metrics: Mapping[str, Any]) -> str:
    """``step 20/100  reward 0.43  kl 0.002  loss -0.01  7.9 samples/s`` (missing keys left out)."""
    parts = [f"step {step}/{total_steps}"]
    for key, label in LINE_FIELDS:
        value = scalar_value(metrics.get(key))
        if value is not None:
            parts.append(f"{label} {_fmt(value)}")
    rate = scalar_value(metrics.get("samples_per_s"))
    if rate is not None:
        parts.append(f"{rate:.1f} samples/s")
    return "  ".join(parts)


def format_summary_line(history: Sequence[tuple[int, float]], key: str = "reward_mean") -> str:
    """``reward_mean ▁▃▅█  first 0.1  last 0.83  best 0.85 @ step 93`` for (step, value) pairs."""
    values = [v for _, v in history]
    finite = [(s, v) for s, v in history if math.isfinite(v)]
    line = f"{key} {sparkline(values)}"
    if finite:
        best_step, best = max(finite, key=lambda sv: sv[1])
        line += (f"  first {_fmt(finite[0][1])}  last {_fmt(finite[-1][1])}"
                 f"  best {_fmt(best)} @ step {best_step}")
    return line


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class StepProgress:
    """Progress of a training run counted in steps.

    ``update(step, metrics)`` moves the bar to ``step`` (absolute, so a resumed run starts at
    ``initial``), shows reward and samples/s, and every ``print_every`` steps (and at the last
    step) writes a plain line to stdout through ``tqdm.write`` so the bar is not torn. When stderr
    is not a terminal (a batch log) the bar redraws at most once a minute. ``enabled=False``
    (ranks other than 0, or quiet runs) prints nothing at all. ``history`` seeds the closing
    sparkline with (step, reward_mean) pairs from before a resume.
    """

    def __init__(self, total_steps: int, initial: int = 0, enabled: bool = True, print_every: int = 10,
                 history: Iterable[tuple[int, float]] = ()) -> None:
        self.total_steps = int(total_steps)
        self.print_every = int(print_every)
        self.enabled = enabled
        self.rewards: list[tuple[int, float]] = [(int(s), float(v)) for s, v in history]
        self._closed = False
        self._bar = None
        if enabled:
            from tqdm import tqdm

            tty = _isatty(sys.stderr)
            self._bar = tqdm(
                total=self.total_steps, initial=int(initial), desc="train", unit="step",
                file=sys.stderr, dynamic_ncols=tty, ncols=None if tty else 100,
                mininterval=0.5 if tty else 60.0, miniters=1, smoothing=0.1, leave=True,
            )

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Advance to ``step`` (absolute) and show ``metrics``."""
        step = int(step)
        reward = scalar_value(metrics.get("reward_mean"))
        if reward is not None:
            self.rewards.append((step, reward))
        if not self.enabled or self._bar is None or self._closed:
            return
        postfix: dict[str, str] = {}
        if reward is not None:
            postfix["reward"] = _fmt(reward)
        rate = scalar_value(metrics.get("samples_per_s"))
        if rate is not None:
            postfix["samples/s"] = f"{rate:.1f}"
        self._bar.set_postfix(postfix, refresh=False)
        delta = step - self._bar.n
        if delta > 0:
            self._bar.update(delta)
        else:  # a step repeated or out of order: show it, never count backwards silently
            self._bar.n = step
            self._bar.refresh()
        if self.print_every > 0 and (step % self.print_every == 0 or step == self.total_steps):
            self.write(format_step_line(step, self.total_steps, metrics))

    def write(self, line: str) -> None:
        """Print a line to stdout without breaking the bar."""
        if not self.enabled:
            return
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        """Close the bar and print the reward sparkline with first / last / best values."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self.enabled and self.rewards:
            print(format_summary_line(self.rewards), file=sys.stdout, flush=True)

    def __enter__(self) -> "StepProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
