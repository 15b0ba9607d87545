"""Typed job and cluster-profile schemas, YAML loading, overrides and errors that name the field."""
from hpcrl.config.cluster import ClusterProfile, SlurmSettings
from hpcrl.config.errors import ConfigError
from hpcrl.config.job import JobConfig, RoleConfig
from hpcrl.config.loader import DEFAULT_PROFILE, REPO_ROOT, job_to_dict, load_job, load_profile, validate

__all__ = ["ClusterProfile", "SlurmSettings", "ConfigError", "JobConfig", "RoleConfig", "DEFAULT_PROFILE",
           "REPO_ROOT", "job_to_dict", "load_job", "load_profile", "validate"]
