"""Atomic checkpoint directories under `<run_dir>/checkpoints/`, and finding the newest valid one.

A checkpoint is written under a hidden temporary name and renamed to `step-<N>` only after every
rank's files are in it and a manifest with their SHA-256 is on disk, so a job killed mid-write
(preemption, time limit, node failure) never leaves a directory that looks complete. On resume,
each candidate is verified newest-first; damaged ones are reported and skipped, never loaded.

Multi-rank protocol (the caller owns the communication)::

    tmp = store.begin(step) if rank == 0 else None          # rank 0 only
    tmp = comm.bcast(tmp, root=0)                            # every rank learns the path
    ... every rank writes its files under tmp ...
    comm.Barrier()
    if rank == 0:
        store.commit(step, tmp, config_hash, layout, extra)  # hash, manifest, fsync, rename, prune

The directory must be on a filesystem every rank sees (the run directory on a shared FS), and
each rank should fsync what it writes (DCP, save_rng and save_run_state do): rank 0's fsync in
commit() reaches only its own node's cache.
No torch here: this module runs on a login node.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import Any

from hpcrl.checkpoint.manifest import (MANIFEST_NAME, SAFE_CONFIG_FIELDS, FileEntry, Manifest, ManifestError,
                                       config_changes, hash_files, sha256_file)

CHECKPOINTS_DIR = "checkpoints"
_FINAL = re.compile(r"^step-(\d+)$")
_SCRATCH = re.compile(r"^\.step-(\d+)\.(tmp|old)-\d+$")  # in-progress writes and replaced checkpoints


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message says which and why."""


class ConfigMismatchError(CheckpointError):
    """The newest intact checkpoint was written by a different job configuration."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint directory."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    def file(self, name: str) -> Path:
        return self.path / name


@dataclass(frozen=True)
class ScanEntry:
    """One `step-<N>` directory as `scan()` found it: a Checkpoint, or the reason it is unusable."""

    step: int
    path: Path
    checkpoint: Checkpoint | None
    problem: str | None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).as_posix() != MANIFEST_NAME)


class CheckpointStore:
    """`<run_dir>/checkpoints/step-<N>/`: begin/commit on rank 0, latest_valid on resume, scan for status."""

    def __init__(self, run_dir: str | os.PathLike, keep: int = 2, hash_workers: int = 4):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS_DIR
        self.keep = keep
        self.hash_workers = hash_workers
        self.skipped: list[str] = []   # one message per checkpoint latest_valid passed over
        self.warnings: list[str] = []  # accepted config changes, cleaned scratch dirs, pruned checkpoints

    # -- naming ------------------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def _name(self, path: Path) -> str:
        try:
            return path.relative_to(self.run_dir).as_posix()
        except ValueError:
            return str(path)

    def steps(self) -> list[tuple[int, Path]]:
        """Final `step-<N>` directories, newest first (not verified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := _FINAL.match(p.name))]
        return sorted(found, reverse=True)

    def scratch_dirs(self) -> list[Path]:
        """Leftovers of interrupted writes (`.step-<N>.tmp-<pid>`) and of replaced checkpoints."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if _SCRATCH.match(p.name))

    def clean_scratch(self) -> list[Path]:
        """Remove scratch dirs. Only the job that owns the run may call this: one may be in progress."""
        removed = self.scratch_dirs()
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
            self.warnings.append(f"{self._name(path)}: partial checkpoint from an interrupted write; removed")
        return removed

    # -- writing (rank 0) --------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """Create the empty temporary directory every rank writes step `step` into."""
        if step < 0:
            raise ValueError(f"step must be >= 0, not {step}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_scratch()
        tmp = self.root / f".step-{step}.tmp-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: str | os.PathLike, config_hash: str, layout: dict[str, Any],
               extra: dict[str, Any] | None = None, hashed: dict[str, FileEntry] | None = None) -> Checkpoint:
        """Hash and fsync every file, write the manifest, rename atomically to `step-<N>`, prune.

        Call after every rank has finished writing (a barrier), on rank 0 only. `hashed`: entries the
        ranks computed (and fsync'ed) in parallel; only the other files are hashed here.
        """
        tmp = Path(tmp)
        match = _SCRATCH.match(tmp.name)
        if tmp.parent.resolve() != self.root.resolve() or not match or match.group(2) != "tmp":
            raise CheckpointError(f"{tmp} is not a directory made by begin() in {self.root}")
        if int(match.group(1)) != step:
            raise CheckpointError(f"{tmp} was begun for step {match.group(1)}, not {step}")
        names = _files_under(tmp)
        hashed = {name: entry for name, entry in (hashed or {}).items() if name in names}
        files = {**hashed, **hash_files(tmp, [n for n in names if n not in hashed], fsync=True,
                                        workers=self.hash_workers)}
        if not files:
            raise CheckpointError(f"{tmp}: no files were written; nothing to commit")
        manifest = Manifest(step=step, config_hash=config_hash, layout=dict(layout), files=files,
                            extra=dict(extra or {}))
        manifest_path = tmp / MANIFEST_NAME
        with open(manifest_path, "w") as handle:
            handle.write(manifest.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        for directory in sorted({(tmp / name).parent for name in files} | {tmp}, reverse=True):
            _fsync_dir(directory)
        final = self.path_for(step)
        replaced = None
        if final.exists():  # a resumed run rewriting a step it had written before (e.g. that copy was corrupt)
            replaced = self.root / f".step-{step}.old-{os.getpid()}"
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self.prune(step)
        return Checkpoint(final, manifest)

    def prune(self, newest: int | None = None) -> list[Path]:
        """Keep the `keep` newest checkpoints up to step `newest`; remove the others.

        Directories beyond `newest` belong to an abandoned attempt (the run resumed from an
        earlier step, so they were damaged or refused) and are removed too.
        """
        removed = []
        kept = 0
        for step, path in self.steps():
            stale = newest is not None and step > newest
            if not stale and kept < self.keep:
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            if stale:
                self.warnings.append(f"{self._name(path)}: newer than the resumed step {newest}; removed")
        return removed

    # -- reading -----------------------------------------------------------------------------
    def verify(self, path: str | os.PathLike, deep: bool = True) -> Checkpoint:
        """Check one directory; raise CheckpointError('<file>: <problem>') at the first fault found.

        deep=False checks presence and sizes only (fast); deep=True also every SHA-256.
        """
        path = Path(path)
        manifest_path = path / MANIFEST_NAME
        if not manifest_path.is_file():
            raise CheckpointError(f"{MANIFEST_NAME} missing (incomplete write)")
        try:
            manifest = Manifest.from_json(manifest_path.read_text())
        except (ManifestError, OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{MANIFEST_NAME} unreadable: {exc}") from None
        match = _FINAL.match(path.name)
        if match and int(match.group(1)) != manifest.step:
            raise CheckpointError(f"{MANIFEST_NAME} says step {manifest.step}, the directory step {match.group(1)}")
        for name, entry in manifest.files.items():
            self._check_size(path / name, name, entry)
        if deep:
            for name, entry in manifest.files.items():
                if sha256_file(path / name).sha256 != entry.sha256:  # one at a time: stop at the first bad file
                    raise CheckpointError(f"{name}: SHA-256 mismatch (corrupt)")
        return Checkpoint(path, manifest)

    @staticmethod
    def _check_size(file: Path, name: str, entry: FileEntry) -> None:
        if not file.is_file():
            raise CheckpointError(f"{name}: missing")
        size = file.stat().st_size
        if size != entry.size:
            kind = "truncated" if size < entry.size else "corrupt"
            raise CheckpointError(f"{name}: {size} bytes, the manifest says {entry.size} ({kind})")

    def latest_valid(self, config_hash: str | None = None, *, allowed_changes: Sequence[str] = (),
                     config: dict[str, Any] | None = None, clean: bool = True,
                     deep_check: Callable[[Path, Manifest], str | None] | None = None) -> Checkpoint | None:
        """The newest intact checkpoint, or None. Every one passed over is reported in `skipped`.

        config_hash: the current job's `config_hash(...)`. If the newest intact checkpoint differs,
        raise ConfigMismatchError (resuming would mix two experiments) unless every changed field
        matches one of `allowed_changes` (key patterns such as `algorithm.kl_loss.coef` or `rollout`;
        the user's --allow-config-change), which records a warning and resumes. Give `config` (the
        resolved job dict) to name the changed fields when the checkpoint stored its job as
        `extra["config"]`; without it no change can be allowed.
        deep_check: checks every file's SHA-256 (the job spreads it over its ranks) and returns the
        first problem, or None; default: here, one file at a time.
        clean: remove partial (scratch) dirs and keep damaged checkpoints aside as `step-<N>.corrupt`
        (never loaded, never pruned: the evidence). Pass clean=False from anything but the job itself
        (e.g. `hpcrl status` on a login node), which could otherwise touch a write in progress.
        """
        self.skipped = []
        if clean:
            self.clean_scratch()
        for step, path in self.steps():
            name = self._name(path)
            try:
                cheap = self.verify(path, deep=False)
            except CheckpointError as exc:
                self._skip(path, str(exc), clean)
                continue
            if config_hash is not None and cheap.manifest.config_hash != config_hash:
                self._check_changes(name, cheap.manifest, config_hash, config, allowed_changes)
            if deep_check is not None:
                problem = deep_check(path, cheap.manifest)
                if problem is None:
                    return cheap
                self._skip(path, problem, clean)
                continue
            try:
                return self.verify(path, deep=True)
            except CheckpointError as exc:
                self._skip(path, str(exc), clean)
        return None

    def _check_changes(self, name: str, manifest: Manifest, current: str, config: dict[str, Any] | None,
                       allowed: Sequence[str]) -> None:
        message = self._mismatch(name, manifest, current, config)
        saved = manifest.extra.get("config")
        remaining = (config_changes(saved, config, (*SAFE_CONFIG_FIELDS, *allowed))
                     if config is not None and isinstance(saved, dict) else ["(the changes cannot be named)"])
        if remaining:
            raise ConfigMismatchError(
                message + ". Revert the change, start a new run directory, or, if the checkpoint still fits the "
                "changed job (not model sizes or parallel layouts), resume anyway with "
                + " ".join(f"--allow-config-change {change.split(':')[0]}" for change in remaining))
        self.warnings.append(message + "; resuming anyway (--allow-config-change)")
        warnings.warn(self.warnings[-1], stacklevel=3)

    def _skip(self, path: Path, reason: str, keep_aside: bool) -> None:
        name = self._name(path)
        if keep_aside:
            aside = path.with_name(f"{path.name}.corrupt")
            n = 1
            while aside.exists():
                n += 1
                aside = path.with_name(f"{path.name}.corrupt-{n}")
            os.rename(path, aside)
            self.skipped.append(f"{name}: {reason}; skipped, kept as {self._name(aside)} (not loaded, not pruned)")
        else:
            self.skipped.append(f"{name}: {reason}; skipped")

    @staticmethod
    def _mismatch(name: str, manifest: Manifest, current: str, config: dict[str, Any] | None) -> str:
        message = (f"{name} was written by a different job configuration "
                   f"(config hash {manifest.config_hash[:12]}, now {current[:12]})")
        saved = manifest.extra.get("config")
        if config is not None and isinstance(saved, dict):
            changes = config_changes(saved, config, SAFE_CONFIG_FIELDS)
            if changes:
                shown = "; ".join(changes[:10]) + (f"; ... {len(changes) - 10} more" if len(changes) > 10 else "")
                message += f": changed {shown}"
        return message

    def scan(self, deep: bool = True) -> list[ScanEntry]:
        """Every `step-<N>` directory, newest first, with its problem if any. Read-only (for status)."""
        entries = []
        for step, path in self.steps():
            try:
                entries.append(ScanEntry(step, path, self.verify(path, deep=deep), None))
            except CheckpointError as exc:
                entries.append(ScanEntry(step, path, None, str(exc)))
        return entries
