"""Text environments for agentic RL: the interface, the built-in envs, and the process host that
keeps a hung or failing env from stopping a run."""
from hpcrl.envs.base import StepResult, TextEnv
from hpcrl.envs.registry import ENVS, EnvSpec

__all__ = ["ENVS", "EnvSpec", "StepResult", "TextEnv"]
