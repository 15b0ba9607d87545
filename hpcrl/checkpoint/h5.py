"""The controller's data in one HDF5 file: rollout buffer, step metrics and controller state.

One self-describing file that h5py, h5dump or pandas can open (no pickle). Ragged columns
(token ids, per-token log-probs: a list of variable-length lists) are stored as flat `values`
plus `offsets` (row i is values[offsets[i]:offsets[i+1]]), as HDF5 has no cheap ragged type.
Reading back gives equal Python objects: ints stay ints (int64), floats are float64 (exact for
Python floats), bools stay bools, strings stay strings. Packed columns (a `Ragged`, or a numpy
array) are stored in their own dtype and read back as such.

Layout::

    /buffer            attrs: columns (JSON list of names, in order)
    /buffer/c<i>       ragged: group {values, offsets}; scalar: a dataset.  attrs: name, kind
    /metrics           attrs: keys (JSON list), rows
    /metrics/k<i>      group {values, present}  (a key may be absent in some rows)
    /controller        a JSON string (step, sampler epoch/position, policy version, ...)

Names live in attributes, so column and metric names may contain '/' (e.g. 'train/loss').
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from hpcrl.ragged import Ragged

# 2: the sampler's state per domain, each buffered sample's domain and reward code; 3: each token's policy version;
# 4: each buffered sample's verifier outcome, before the length shaping
FORMAT_VERSION = 4
STATE_FILE = "state.h5"
_STR = h5py.string_dtype("utf-8")


@dataclass
class RunState:
    buffer: dict[str, list | Ragged | np.ndarray] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    controller: dict[str, Any] = field(default_factory=dict)


def _is_row(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _scalar_array(values: Sequence[Any], what: str) -> np.ndarray:
    """The narrowest exact dtype for a list of Python scalars: bool, int64, float64 or str."""
    kinds = {type(v) for v in values}
    if not values or kinds <= {float, np.float64, np.float32}:
        return np.asarray(values, dtype=np.float64)
    if kinds <= {bool, np.bool_}:
        return np.asarray(values, dtype=np.bool_)
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        try:
            return np.asarray(values, dtype=np.int64)
        except OverflowError:
            raise TypeError(f"{what}: an integer does not fit in 64 bits") from None
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
           for v in values):
        return np.asarray(values, dtype=np.float64)
    if kinds <= {str}:
        return np.asarray(values, dtype=object)
    raise TypeError(f"{what}: values must all be numbers, all bools or all strings, not a mix of "
                    f"{sorted(k.__name__ for k in kinds)}")


def _write_scalars(group: h5py.Group, name: str, array: np.ndarray) -> h5py.Dataset:
    if array.dtype == object:
        return group.create_dataset(name, data=array, dtype=_STR)
    return group.create_dataset(name, data=array)


def _read_scalars(dataset: h5py.Dataset) -> list:
    if h5py.check_string_dtype(dataset.dtype) is not None:
        return list(dataset.asstr()[()])
    return dataset[()].tolist()


def _write_column(group: h5py.Group, index: int, name: str, values: Sequence[Any] | Ragged | np.ndarray) -> None:
    what = f"buffer column {name!r}"
    if isinstance(values, (Ragged, np.ndarray)):  # packed columns keep their dtype and come back packed
        if isinstance(values, Ragged):
            node = group.create_group(f"c{index}")
            node.create_dataset("values", data=values.values)
            node.create_dataset("offsets", data=values.offsets)
        else:
            node = group.create_dataset(f"c{index}", data=values)
        node.attrs["name"] = name
        node.attrs["kind"] = "packed"
        return
    rows = [_is_row(v) for v in values]
    if any(rows) and not all(rows):
        raise TypeError(f"{what}: mixes lists and scalars")
    if values and all(rows):
        lists = [list(v.tolist() if isinstance(v, np.ndarray) else v) for v in values]
        if any(_is_row(x) for row in lists for x in row):
            raise TypeError(f"{what}: only one level of nesting (a list of lists) is supported")
        flat = [x for row in lists for x in row]
        if any(isinstance(x, str) for x in flat):
            raise TypeError(f"{what}: lists of strings are not supported")
        node = group.create_group(f"c{index}")
        node.create_dataset("values", data=_scalar_array(flat, what))
        node.create_dataset("offsets", data=np.cumsum([0] + [len(r) for r in lists], dtype=np.int64))
        kind = "ragged"
    else:
        node = _write_scalars(group, f"c{index}", _scalar_array(list(values), what))
        kind = "scalar"
    node.attrs["name"] = name
    node.attrs["kind"] = kind


def _read_column(node: h5py.Group | h5py.Dataset) -> list | Ragged | np.ndarray:
    if node.attrs["kind"] == "packed":
        return Ragged(node["values"][()], node["offsets"][()]) if isinstance(node, h5py.Group) else node[()]
    if node.attrs["kind"] == "ragged":
        values, offsets = node["values"][()].tolist(), node["offsets"][()].tolist()
        return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return _read_scalars(node)


def _write_metrics(group: h5py.Group, metrics: Sequence[Mapping[str, Any]]) -> None:
    keys: list[str] = []
    for row in metrics:
        keys.extend(k for k in row if k not in keys)
    group.attrs["keys"] = json.dumps(keys)
    group.attrs["rows"] = len(metrics)
    for index, key in enumerate(keys):
        present = np.asarray([key in row for row in metrics], dtype=np.bool_)
        given = [row[key] for row in metrics if key in row]
        array = _scalar_array(given, f"metric {key!r}")
        full = np.zeros(len(metrics), dtype=array.dtype) if array.dtype != object else np.full(len(metrics), "", object)
        full[present] = array
        node = group.create_group(f"k{index}")
        _write_scalars(node, "values", full)
        node.create_dataset("present", data=present)


def _read_metrics(group: h5py.Group) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [{} for _ in range(int(group.attrs["rows"]))]
    for index, key in enumerate(json.loads(group.attrs["keys"])):
        node = group[f"k{index}"]
        for row, value, present in zip(rows, _read_scalars(node["values"]), node["present"][()].tolist()):
            if present:
                row[key] = value
    return rows


def save_run_state(path: str | os.PathLike, buffer: Mapping[str, Sequence[Any] | Ragged | np.ndarray] | None = None,
                   metrics: Sequence[Mapping[str, Any]] | None = None,
                   controller: Mapping[str, Any] | None = None) -> Path:
    """Write the three parts to one HDF5 file (replacing it). controller must be JSON-able."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    controller_json = json.dumps(dict(controller or {}), allow_nan=True)  # fail before creating the file
    with h5py.File(path, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        group = f.create_group("buffer")
        names = list((buffer or {}).keys())
        group.attrs["columns"] = json.dumps(names)
        for index, name in enumerate(names):
            _write_column(group, index, name, buffer[name])
        _write_metrics(f.create_group("metrics"), list(metrics or []))
        f.create_dataset("controller", data=controller_json, dtype=_STR)
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
    return path


class StateFormatError(ValueError):
    """state.h5 was written by an hpcrl whose controller state this one cannot read."""


def load_run_state(path: str | os.PathLike) -> RunState:
    with h5py.File(path, "r") as f:
        version = int(f.attrs.get("format_version", -1))
        if version not in (3, FORMAT_VERSION):
            raise StateFormatError(f"{path}: format_version {version} is not {FORMAT_VERSION} or 3, which this hpcrl "
                                   "reads (written by another hpcrl version, whose controller state differs)")
        group = f["buffer"]
        buffer = {name: _read_column(group[f"c{index}"])
                  for index, name in enumerate(json.loads(group.attrs["columns"]))}
        metrics = _read_metrics(f["metrics"])
        controller = json.loads(f["controller"].asstr()[()])
    if version == 3 and "rewards" in buffer:   # no length shaping told apart: the rewards are the outcomes
        buffer["outcomes"] = buffer["rewards"]
    return RunState(buffer, metrics, controller)
