"""The one error type for bad configuration: it always names the file, the key path and the fix."""
from __future__ import annotations


class ConfigError(ValueError):
    """A job YAML or cluster profile that cannot be used, with the problems listed one per line."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {p}" for p in problems))
