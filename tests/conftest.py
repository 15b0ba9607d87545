"""Shared fixtures: paths, and the real local Slurm (see slurm_cluster.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import slurm_env  # noqa: F401  (a session fixture, re-exported for every test module)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    return REPO


def hpcrl(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
          timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real `hpcrl` command line (as a user would) and capture its output."""
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], cwd=cwd or REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
