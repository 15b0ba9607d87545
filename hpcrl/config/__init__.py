"""Typed job and cluster-profile schemas, YAML loading, overrides and errors that name the field.

The names below load on first use (PEP 562): `hpcrl.config.constants` alone, which every rank's
supervisor process imports, does not pull in pydantic and the schemas.
"""
from __future__ import annotations

import importlib

_WHERE = {"ClusterProfile": "cluster", "SlurmSettings": "cluster", "ConfigError": "errors", "JobConfig": "job",
          "RoleConfig": "job", "DEFAULT_PROFILE": "loader", "REPO_ROOT": "loader", "job_to_dict": "loader",
          "load_job": "loader", "load_profile": "loader", "validate": "loader"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'hpcrl.config' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpcrl.config.{_WHERE[name]}"), name)
