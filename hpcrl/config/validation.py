"""Turn pydantic's validation errors into lines a person can act on: key path, what is allowed, line."""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any

import annotated_types
from pydantic import BaseModel, ValidationError

from hpcrl.config.yaml_source import KeyPath


def _unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The schema class behind `X`, `X | None` or `dict[str, X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, dict):
        for arg in typing.get_args(annotation):
            found = _unwrap_model(arg)
            if found is not None:
                return found
    return None


def _field_at(schema: type[BaseModel], loc: tuple[Any, ...]) -> tuple[type[BaseModel] | None, Any]:
    """Walk `loc` through nested schemas: return (the schema holding the last key, its FieldInfo)."""
    model: type[BaseModel] | None = schema
    field = None
    for part in loc:
        if model is None:
            return None, None
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return model, None
        parent = model
        model = _unwrap_model(field.annotation)
    return parent if loc else schema, field


def _expected(field: Any, error_type: str) -> str:
    """Describe what the field accepts, e.g. 'a positive integer'."""
    if field is None:
        return ""
    bounds = {type(m).__name__: m for m in field.metadata}
    annotation = field.annotation
    base = typing.get_args(annotation)[0] if typing.get_origin(annotation) in (typing.Union, types.UnionType) else annotation
    below = f" below {bounds['Lt'].lt}" if "Lt" in bounds and error_type == "less_than" else ""
    if base is int or error_type.startswith("int"):
        if isinstance(bounds.get("Gt"), annotated_types.Gt) and bounds["Gt"].gt == 0:
            return "a positive integer" + below
        if isinstance(bounds.get("Ge"), annotated_types.Ge) and bounds["Ge"].ge == 0:
            return "a non-negative integer" + below
        return "an integer" + below
    if base is float or error_type.startswith("float"):
        finite = " (finite)" if error_type == "finite_number" else ""
        if "Gt" in bounds and bounds["Gt"].gt == 0:
            return "a positive number" + finite
        return "a number" + finite
    if typing.get_origin(base) is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(base))
    if base is bool:
        return "true or false"
    return ""


def describe_errors(schema: type[BaseModel], error: ValidationError, lines: dict[KeyPath, int]) -> list[str]:
    """One message per problem: `key.path: what is wrong; what is allowed (line N)`."""
    problems = []
    for item in error.errors(include_url=False):
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p[:1].isupper()))
        key_path = ".".join(str(p) for p in loc)
        kind = item["type"]
        parent, field = _field_at(schema, loc)
        if kind == "extra_forbidden":
            allowed = sorted(parent.model_fields) if parent is not None else []
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"unknown key{hint}. Allowed here: {', '.join(allowed)}"
        elif kind == "missing":
            message = "required field is missing"
        elif kind == "value_error":
            message = str(item["ctx"]["error"]) if "ctx" in item else item["msg"]
        else:
            expected = _expected(field, kind)
            got = item.get("input")
            message = f"expected {expected}, got {got!r}" if expected else f"{item['msg']}, got {got!r}"
        line = lines.get(tuple(loc)) or lines.get(tuple(loc[:-1]))
        where = f" (line {line})" if line else ""
        problems.append(f"{key_path}: {message}{where}" if key_path else f"{message}{where}")
    return problems
