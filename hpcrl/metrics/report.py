"""``hpcrl report RUN_DIR``: a PNG of the curves and a few summary numbers from ``metrics.jsonl``.

Only the JSONL is read (no TensorBoard, no torch), so this works on a login node, on a live run,
or on a copy of the run directory. matplotlib is driven through its Agg canvas directly, never
pyplot, so no global backend is set and no display is needed.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .jsonl import METRICS_FILE, read_metrics
from .tensorboard import scalar_value

REPORT_FILE = "report.png"
# Extra panels under the reward panel, drawn when the metric is present: (key, y label).
PANELS: tuple[tuple[str, str], ...] = (("kl", "kl"), ("loss", "loss"), ("samples_per_s", "samples/s"),
                                       ("success_rate", "success rate"), ("turns", "turns per trajectory"),
                                       ("turns_to_success", "turns to success"),
                                       ("tokens_per_turn", "tokens per turn"), ("env_s_per_turn", "env s per turn"),
                                       ("trajectories_failed", "failed trajectories"),
                                       ("router_flip_frac", "routings replay changed"))


@dataclass(frozen=True)
class RunSummary:
    """The numbers ``hpcrl report`` prints; None where the metric was never recorded."""

    steps: int
    first_step: int | None
    last_step: int | None
    reward_first10: float | None
    reward_last10: float | None
    reward_best: float | None
    reward_best_step: int | None
    total_time_s: float | None  # sum of time_step_s: compute time, excluding queue waits between jobs
    samples_per_s_mean: float | None
    last_eval: dict[str, tuple[int, float]]   # eval/<domain>/<metric> -> (step, value) of the last evaluation


def by_step(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with a numeric step, sorted by step; a step seen twice keeps its last record."""
    latest: dict[int, dict[str, Any]] = {}
    for record in records:
        step = scalar_value(record.get("step"))
        if step is not None and math.isfinite(step):
            latest[int(step)] = record
    return [latest[s] for s in sorted(latest)]


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that have it as a number."""
    steps, values = [], []
    for record in records:
        value = scalar_value(record.get(key))
        if value is not None:
            steps.append(int(record["step"]))
            values.append(value)
    return steps, values


def _mean(values: Sequence[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (fewer at the start), ignoring NaN/inf."""
    out = []
    for i in range(len(values)):
        m = _mean(values[max(0, i - window + 1):i + 1])
        out.append(math.nan if m is None else m)
    return out


def summarize(records: Sequence[dict[str, Any]]) -> RunSummary:
    """Summary numbers of a run's records (in any order; duplicates of a step count once)."""
    records = by_step(records)
    r_steps, rewards = series(records, "reward_mean")
    finite = [(s, v) for s, v in zip(r_steps, rewards) if math.isfinite(v)]
    best_step, best = max(finite, key=lambda sv: sv[1]) if finite else (None, None)
    _, times = series(records, "time_step_s")
    _, rates = series(records, "samples_per_s")
    return RunSummary(
        steps=len(records),
        first_step=int(records[0]["step"]) if records else None,
        last_step=int(records[-1]["step"]) if records else None,
        reward_first10=_mean(rewards[:10]),
        reward_last10=_mean(rewards[-10:]),
        reward_best=best,
        reward_best_step=best_step,
        total_time_s=sum(t for t in times if math.isfinite(t)) if times else None,
        samples_per_s_mean=_mean(rates),
        last_eval={key: (series(records, key)[0][-1], series(records, key)[1][-1])
                   for key in domain_keys(records, "eval/")},
    )


def format_duration(seconds: float) -> str:
    """``1h 02m 03s`` / ``2m 03s`` / ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def format_summary(summary: RunSummary, name: str = "") -> str:
    """The short text ``hpcrl report`` prints."""
    head = f"run {name}: " if name else ""
    lines = [f"{head}{summary.steps} steps"
             + (f" ({summary.first_step}-{summary.last_step})" if summary.steps else "")
             + (f", {format_duration(summary.total_time_s)} of step time"
                if summary.total_time_s is not None else "")]
    best = _num(summary.reward_best)
    if summary.reward_best_step is not None:
        best += f" @ step {summary.reward_best_step}"
    lines.append(f"reward_mean  first-10 {_num(summary.reward_first10)}  "
                 f"last-10 {_num(summary.reward_last10)}  best {best}")
    if summary.samples_per_s_mean is not None:
        lines.append(f"throughput   {summary.samples_per_s_mean:.1f} samples/s (mean)")
    for key, (step, value) in summary.last_eval.items():
        lines.append(f"{key}  {value:.4g} (step {step})")
    return "\n".join(lines)


def domain_keys(records: Sequence[dict[str, Any]], prefix: str, suffix: str = "") -> list[str]:
    """The metric keys `<prefix><domain><suffix>` recorded, in first-seen order."""
    keys: dict[str, None] = {}
    for record in records:
        keys.update((k, None) for k in record if k.startswith(prefix) and k.endswith(suffix))
    return list(keys)


def _multi_curve_panels(records: Sequence[dict[str, Any]]) -> list[tuple[list[str], str]]:
    """Panels of several curves: the reward per domain (when there are several), the evaluation, and
    a MoE model's expert load (the most and the least loaded expert, over a balanced one's)."""
    panels = []
    per_domain = domain_keys(records, "reward_mean/")
    if len(per_domain) > 1:
        panels.append((per_domain, "reward by domain"))
    evaluation = domain_keys(records, "eval/", "_reward") + [k for k in domain_keys(records, "eval/")
                                                              if "/pass@" in k and not k.endswith("@1")]
    if evaluation:
        panels.append((evaluation, "evaluation"))
    load = [key for key in ("moe_load_max", "moe_load_min") if series(records, key)[0]]
    if load:
        panels.append((load, "expert load (1: balanced)"))
    return panels


def plot_report(records: Sequence[dict[str, Any]], png: Path, title: str = "") -> Path:
    """Draw reward_mean (raw, rolling mean, ±std band), the reward per domain, the evaluation and
    the expert load curves when the run has them, and the kl / loss / samples/s panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = by_step(records)
    curves = _multi_curve_panels(records)
    panels = [(k, label) for k, label in PANELS if series(records, k)[0]]
    panels = [([key], label) for key, label in panels]
    panels = curves + panels
    fig = Figure(figsize=(9, 3.2 + 1.9 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1 + len(panels), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [1.8] + [1] * len(panels)})[:, 0]

    ax = axes[0]
    steps, rewards = series(records, "reward_mean")
    if steps:
        window = max(1, min(len(rewards), max(5, len(rewards) // 10)))
        _, stds = series(records, "reward_std")
        if len(stds) == len(rewards):
            ax.fill_between(steps, [r - s for r, s in zip(rewards, stds)],
                            [r + s for r, s in zip(rewards, stds)], alpha=0.12, color="C0",
                            linewidth=0, label="± reward_std")
        ax.plot(steps, rewards, color="C0", alpha=0.35, linewidth=1, label="reward_mean")
        ax.plot(steps, rolling_mean(rewards, window), color="C0", linewidth=2,
                label=f"rolling mean ({window})")
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no reward_mean recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.set_title(title or "reward")

    for ax, (keys, label) in zip(axes[1:], panels):
        for index, key in enumerate(keys):
            s, v = series(records, key)
            sparse = len(s) < len(records) / 2   # evaluations: a point every few steps
            ax.plot(s, v, color=f"C{index + 1}", linewidth=1.2, marker="o" if sparse else None, markersize=3,
                    label=key if len(keys) > 1 else None)
        if len(keys) > 1:
            ax.legend(loc="best", fontsize="x-small")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")

    # write then rename: a report watched while the run goes on is never half a PNG
    tmp = png.with_name(f".{png.name}.tmp.{os.getpid()}")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, png)
    finally:
        if tmp.exists():
            tmp.unlink()
    return png


def write_report(run_dir: str | os.PathLike[str]) -> Path:
    """Plot ``run_dir/metrics.jsonl`` to ``run_dir/report.png`` and return the PNG's path.

    The text summary is ``format_summary(summarize(read_metrics(...)))``; ``report_main`` prints
    both. Raises FileNotFoundError / ValueError if the metrics file is missing or empty.
    """
    run_dir = Path(run_dir)
    records = _load(run_dir)
    return plot_report(records, run_dir / REPORT_FILE, title=run_dir.resolve().name)


def _load(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no {METRICS_FILE} in {run_dir}: give a run directory (runs/<name>) of a run that "
            f"has finished at least one step")
    records = by_step(read_metrics(path))
    if not records:
        raise ValueError(f"{path} has no step records yet: the run has not finished a step; "
                         f"run the report again after its first step")
    return records


def report_main(run_dir: str) -> int:
    """``hpcrl report RUN_DIR``: print the summary and the PNG path; 0 on success, 2 if no metrics."""
    path = Path(run_dir)
    if path.is_file() and path.name == METRICS_FILE:  # tolerate being given the file itself
        path = path.parent
    try:
        records = _load(path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"hpcrl report: {exc}", file=sys.stderr)
        return 2
    png = plot_report(records, path / REPORT_FILE, title=path.resolve().name)
    print(format_summary(summarize(records), name=path.resolve().name))
    print(f"report: {png}")
    return 0
