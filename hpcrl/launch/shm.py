"""Shared-memory segments that MPI (and a colocated vLLM's weight staging) leaves behind when a world
ends abnormally, and their removal.

MPICH keeps its intra-node buffers in /dev/shm/mpich_shm_* and unlinks them in MPI_Finalize; a rank
that is killed or aborts never gets there, and each such end leaves 1-5 MB in RAM-backed /dev/shm
until the node reboots. After a world ends, `hpcrl run` (and the batch script, on every node of the
allocation) removes the segments of this user that no process maps any more. (MPICH maps a segment
right after creating it: one that is more than a second old and mapped by nobody is left over.)

    python -m hpcrl.launch.shm      # what the batch script runs on each node: prints what it removed
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("mpich_shm_", "hpcrl-weights-")   # MPICH's segments; a weight bucket staged for vLLM (vllm_engine)
MIN_AGE_S = 1.0


def _mapped(root: Path) -> set[str]:
    """Every file under `root` some process on this node maps (as far as /proc lets us see)."""
    paths: set[str] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as maps:
                paths.update(line.split(maxsplit=5)[5].strip() for line in maps if str(root) in line)
        except (OSError, IndexError):
            continue
    return paths


def stale_segments(root: Path = SHM, min_age_s: float = MIN_AGE_S) -> list[Path]:
    """This user's MPI segments under `root` that nothing maps and that are older than `min_age_s`."""
    if not root.is_dir():
        return []
    now, uid = time.time(), os.getuid()
    candidates = []
    for entry in os.scandir(root):
        if not entry.name.startswith(PREFIXES):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid == uid and now - info.st_mtime > min_age_s:
            candidates.append(Path(entry.path))
    if not candidates:
        return []
    mapped = _mapped(root)
    return sorted(p for p in candidates if str(p) not in mapped)


def remove_stale(root: Path = SHM, min_age_s: float = MIN_AGE_S) -> list[Path]:
    removed = []
    for path in stale_segments(root, min_age_s):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            continue
    return removed


def main() -> int:
    removed = remove_stale()
    if removed:
        print(f"hpcrl: removed {len(removed)} MPI shared-memory segment(s) left in {SHM} by ended worlds",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
