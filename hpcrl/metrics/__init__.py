"""Step metrics: durable JSONL, TensorBoard scalars, terminal progress and ``hpcrl report`` plots.

Nothing here imports torch or matplotlib at import time: TensorBoard writing imports torch when a
``TensorBoardLog`` is made, and the report imports matplotlib when it draws, so planning and
reporting work on a login node.
"""

from .jsonl import METRICS_FILE, SUPERSEDED_FILE, MetricsLog, read_metrics
from .progress import StepProgress, format_step_line, format_summary_line, sparkline
from .recorder import StepRecorder
from .report import REPORT_FILE, RunSummary, format_summary, report_main, summarize, write_report
from .tensorboard import TENSORBOARD_DIR, TensorBoardLog, TensorBoardUnavailable

__all__ = [
    "METRICS_FILE",
    "REPORT_FILE",
    "SUPERSEDED_FILE",
    "TENSORBOARD_DIR",
    "MetricsLog",
    "RunSummary",
    "StepProgress",
    "StepRecorder",
    "TensorBoardLog",
    "TensorBoardUnavailable",
    "format_step_line",
    "format_summary",
    "format_summary_line",
    "read_metrics",
    "report_main",
    "sparkline",
    "summarize",
    "write_report",
]
