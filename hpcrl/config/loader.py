"""Load, override and validate job YAMLs and cluster profiles; every failure is a ConfigError."""
from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hpcrl.config.cluster import ClusterProfile
from hpcrl.config.errors import ConfigError
from hpcrl.config.job import JobConfig
from hpcrl.config.overrides import apply_overrides
from hpcrl.config.validation import describe_errors
from hpcrl.config.yaml_source import load_yaml_with_lines

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = REPO_ROOT / "clusters" / "local.yaml"

SchemaT = TypeVar("SchemaT", bound=BaseModel)


def validate(schema: type[SchemaT], data: dict[str, Any], source: str, lines: dict | None = None) -> SchemaT:
    """Validate a raw mapping against a schema, raising ConfigError with every problem found."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, describe_errors(schema, exc, lines or {})) from None


def _load(schema: type[SchemaT], path: str | Path, overrides: list[str] | None) -> SchemaT:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), ["no such file"])
    data, lines = load_yaml_with_lines(path)
    if overrides:
        data = apply_overrides(data, overrides)
    return validate(schema, data, str(path), lines)


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobConfig:
    """Read a job YAML and apply `a.b.c=value` overrides (from `--set`)."""
    return _load(JobConfig, path, overrides)


def load_profile(path: str | Path | None = None, overrides: list[str] | None = None) -> ClusterProfile:
    """Read a cluster profile; without a path, the embedded `local` profile (this machine, CPU)."""
    return _load(ClusterProfile, path or DEFAULT_PROFILE, overrides)


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """The fully resolved job as plain data (what is hashed and stored with checkpoints)."""
    return job.model_dump(mode="json")
