"""YAML loading that remembers where each key was written, so errors can cite `file:line`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpcrl.config.errors import ConfigError

KeyPath = tuple[str | int, ...]


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that records the line of every mapping key and sequence item."""


def _record_lines(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], source: str) -> None:
    """Record every key's line; a key given twice in one mapping is an error (YAML would keep the last
    silently, and half of what the user wrote would not apply)."""
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            child = path + (key_node.value,)
            line = key_node.start_mark.line + 1
            if key_node.value in seen:
                key = ".".join(str(p) for p in child)
                raise ConfigError(source, [f"{key}: given twice (lines {seen[key_node.value]} and {line}); "
                                           "keep one"])
            seen[key_node.value] = line
            lines[child] = line
            _record_lines(value_node, child, lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_lines(item, path + (index,), lines, source)


def load_yaml_with_lines(path: str | Path) -> tuple[dict[str, Any], dict[KeyPath, int]]:
    """Parse a YAML mapping; return it with a map from key path to 1-based line number."""
    text = Path(path).read_text()
    try:
        node = yaml.compose(text, Loader=_LineLoader)
        data = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["the top level must be a mapping of keys to values"])
    lines: dict[KeyPath, int] = {}
    if node is not None:
        _record_lines(node, (), lines, str(path))
    return data, lines
