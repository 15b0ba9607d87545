"""The checkpoint manifest: what a checkpoint holds, and the checksums that prove it is whole.

No torch here: `hpcrl status` verifies checkpoints on a login node with only this module and
`store.py`.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"

# Job fields whose change does not invalidate a checkpoint: extending the run (train.steps), how
# often / how many checkpoints are kept, logging, and where and on how many data-parallel ranks
# a role runs (model and optimizer state are saved with DCP and reshard on load).
SAFE_CONFIG_FIELDS: tuple[str, ...] = ("train.steps", "checkpoint", "log", "roles.*.parallel.dp",
                                       "roles.*.placement")

_CHUNK = 8 << 20


class ManifestError(ValueError):
    """manifest.json is missing a field, has a wrong type, or is from an unknown format version."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    config_hash: str
    layout: dict[str, Any]
    files: dict[str, FileEntry]
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())

    def to_json(self) -> str:
        data = {
            "format_version": self.format_version,
            "step": self.step,
            "config_hash": self.config_hash,
            "created": self.created,
            "layout": self.layout,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())},
            "extra": self.extra,
        }
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        """Parse and type-check; any problem is a ManifestError saying which field."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"not valid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ManifestError("not a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(f"format_version {version!r} is not {FORMAT_VERSION} "
                                "(written by another hpcrl version)")
        _expect(data, "step", int)
        _expect(data, "config_hash", str)
        _expect(data, "created", str)
        _expect(data, "layout", dict)
        _expect(data, "files", dict)
        files: dict[str, FileEntry] = {}
        for name, entry in data["files"].items():
            if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                    or not isinstance(entry.get("sha256"), str)):
                raise ManifestError(f"files[{name!r}] needs an integer 'size' and a string 'sha256'")
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ManifestError(f"files[{name!r}] is not a path inside the checkpoint")
            files[name] = FileEntry(entry["size"], entry["sha256"])
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise ManifestError("'extra' is not an object")
        return cls(step=data["step"], config_hash=data["config_hash"], layout=data["layout"], files=files,
                   created=data["created"], extra=extra, format_version=version)


def _expect(data: dict, key: str, kind: type) -> None:
    value = data.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"field {key!r} is missing or not a {kind.__name__}")


def sha256_file(path: Path, fsync: bool = False) -> FileEntry:
    """Size and SHA-256 of a file; with fsync, also force it to stable storage (same open, one read)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := handle.readinto(buffer):
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(handle.fileno())
    return FileEntry(size, digest.hexdigest())


def hash_files(root: Path, names: Iterable[str], fsync: bool = False, workers: int = 4) -> dict[str, FileEntry]:
    """Hash files under root in parallel threads (hashlib releases the GIL on large buffers)."""
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(names) or 1))) as pool:
        entries = list(pool.map(lambda name: sha256_file(root / name, fsync), names))
    return dict(zip(names, entries))


def _drop(data: Any, path: Sequence[str]) -> None:
    """Delete a dotted path from nested dicts in place; `*` matches any one key."""
    if not isinstance(data, dict) or not path:
        return
    head, rest = path[0], path[1:]
    keys = list(data) if head == "*" else [head] if head in data else []
    for key in keys:
        if rest:
            _drop(data[key], rest)
        else:
            del data[key]


def _without(job: Mapping[str, Any], ignore: Iterable[str]) -> dict[str, Any]:
    data = json.loads(json.dumps(job, sort_keys=True, default=str))  # a deep, JSON-normalised copy
    for dotted in ignore:
        _drop(data, dotted.split("."))
    return data


def config_hash(job: Mapping[str, Any], ignore: Iterable[str] = SAFE_CONFIG_FIELDS) -> str:
    """SHA-256 of the resolved job (canonical JSON) without the fields safe to change on resume."""
    canonical = json.dumps(_without(job, ignore), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   ignore: Iterable[str] = SAFE_CONFIG_FIELDS) -> list[str]:
    """The fields that differ, as 'a.b: old -> new', for an error message a person can act on."""
    ignore = tuple(ignore)
    before, after = _flatten(_without(old, ignore)), _flatten(_without(new, ignore))
    missing = object()
    changes = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key, missing), after.get(key, missing)
        if a != b:
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            changes.append(f"{key}: {show(a)} -> {show(b)}")
    return changes
