"""`--set a.b.c=value` overrides, applied to the raw YAML mapping before validation."""
from __future__ import annotations

import copy
from typing import Any

import yaml

from hpcrl.config.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into its key path and a YAML-typed value (`3` is an int, `[1, 2]` a list)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("--set", [f"{text!r}: expected KEY.PATH=VALUE, e.g. train.steps=20"])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError("--set", [f"{text!r}: the value is not valid YAML ({exc.problem})"]) from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `data` with each override set, creating intermediate mappings as needed."""
    result = copy.deepcopy(data)
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    for key, value in items:
        keys = key.split(".") if isinstance(key, str) else key
        node = result
        for part in keys[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError("--set", [f"{'.'.join(keys)}: {part!r} is not a mapping"])
            node = child
        node[keys[-1]] = value
    return result
