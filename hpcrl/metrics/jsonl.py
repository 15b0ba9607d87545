"""Step metrics as JSON Lines: the run's durable, append-only record.

One line per step, flushed to the operating system as it is written, so a job killed by Slurm
(preemption, time limit) loses at most the line being written. Lines are fsync'ed at each
checkpoint, not one by one (a millisecond of the controller's step on a local disk, more on a
parallel file system): a node that crashes can lose only lines after the last checkpoint. On
resume the records past the checkpoint's step (which the resumed run computes again) move to
metrics.superseded.jsonl, and a run started over moves all of them there: metrics.jsonl has every
step exactly once, and no record is lost.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"


def _to_json(value: Any) -> Any:
    """Make numpy / torch scalars and other odd values serialisable (called by json.dumps)."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def dumps_record(record: Mapping[str, Any]) -> str:
    """One record as one JSON line (no trailing newline); NaN/inf are kept as Python's json does."""
    return json.dumps(dict(record), default=_to_json, separators=(",", ":"))


def _iter_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    """Yield (line number, text, complete) — complete is False only for an unterminated last line."""
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            yield lineno, line.rstrip("\n"), line.endswith("\n")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a metrics file, in file order.

    An unterminated, unparsable last line is a write cut short (a killed job, or a live run being
    read mid-write) and is skipped; any other bad line is corruption and raises ValueError naming
    the file and line.
    """
    path = Path(path)
    records: list[dict[str, Any]] = []
    for lineno, text, complete in _iter_lines(path):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            if not complete:
                break
            raise ValueError(f"{path}:{lineno}: not a JSON record ({exc.msg}); "
                             f"fix or delete this line to read the rest") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable (POSIX needs the directory entry synced too)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _step_of(record: Mapping[str, Any]) -> float:
    step = record.get("step")
    if isinstance(step, (int, float)) and not isinstance(step, bool) and not math.isnan(step):
        return step
    return math.inf  # no usable step: never kept by a truncation


def rewrite_atomically(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``records`` via temp file + fsync + rename: never half-written."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(dumps_record(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def supersede(path: Path, records: list[dict[str, Any]]) -> None:
    """Append `records` to the superseded file beside `path` (durably, before they leave `path`)."""
    if not records:
        return
    with open(path.with_name(SUPERSEDED_FILE), "a", encoding="utf-8") as f:
        for record in records:
            f.write(dumps_record(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


class MetricsLog:
    """Append-only JSONL writer, one line per ``write``, flushed (fsync'ed at ``close``).

    ``resume_step=N`` first keeps only records with ``step <= N`` (the steps the checkpoint
    covers); ``fresh=True`` starts an empty file. The records dropped either way go to
    metrics.superseded.jsonl first. With neither, existing records are kept and a torn last line
    (killed mid-write) is cut off before appending.
    """

    def __init__(self, path: str | os.PathLike[str], resume_step: int | None = None,
                 fresh: bool = False, restored: list[dict[str, Any]] | None = None) -> None:
        """`restored`: the checkpoint's own record of its steps, which fills in steps missing here
        (a deleted or damaged metrics.jsonl); `self.rebuilt` counts them."""
        if fresh and resume_step is not None:
            raise ValueError("give resume_step or fresh=True, not both")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rebuilt = 0
        if fresh or resume_step is not None:
            records = read_metrics(self.path) if self.path.exists() else []
            kept = [] if fresh else [r for r in records if _step_of(r) <= resume_step]
            supersede(self.path, records if fresh else [r for r in records if _step_of(r) > resume_step])
            present = {_step_of(r) for r in kept}
            missing = [r for r in restored or [] if _step_of(r) not in present and _step_of(r) <= (resume_step or 0)]
            self.rebuilt = len(missing)
            rewrite_atomically(self.path, sorted(kept + missing, key=_step_of))
        else:
            self._drop_torn_tail()
        self._file = open(self.path, "a", encoding="utf-8")

    def _drop_torn_tail(self) -> None:
        """Cut an unterminated last line so the next record starts on a line of its own."""
        if not self.path.exists():
            return
        with open(self.path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            # walk back to the last newline (files are small: one line per step)
            f.seek(0)
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record and hand it to the operating system before returning."""
        if self._file.closed:
            raise ValueError(f"MetricsLog({self.path}) is closed")
        self._file.write(dumps_record(record) + "\n")
        self._file.flush()

    def sync(self) -> None:
        """Make the lines so far durable (at a checkpoint: its record of the steps keeps only numbers)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
