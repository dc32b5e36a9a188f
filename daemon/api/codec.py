"""Tensors between the wire and numpy, shared by both frontends.

Every check a request's tensors must pass lives here, so HTTP and the socket refuse the same
inputs with the same messages: names, datatypes, shapes (batch first, non-batch dims as the
model declares) and byte counts. Binary data is wrapped without copying.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest
from daemon.repository import ModelSpec


@dataclass(slots=True)
class WireTensor:
    """One input as the wire gave it: raw little-endian bytes, or JSON data (nested or flat)."""

    name: str
    datatype: str
    shape: list[int]
    raw: bytes | memoryview | None = None
    data: Any = None


def check_shape(shape: Any, name: str) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise BadRequest(f"input {name}: shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise BadRequest(f"input {name}: shape {shape} has a negative dimension")
    return shape


def assemble_inputs(spec: ModelSpec, tensors: Sequence[WireTensor]) -> tuple[tuple[np.ndarray, ...], int]:
    """Validate wire tensors against the model; returns arrays in model input order and the batch."""
    by_name: dict[str, WireTensor] = {}
    for t in tensors:
        if t.name in by_name:
            raise BadRequest(f"input {t.name} is given twice")
        by_name[t.name] = t
    expected = [s.name for s in spec.inputs]
    unknown = [n for n in by_name if n not in expected]
    if unknown:
        raise BadRequest(f"unexpected input {unknown[0]!r} for model {spec.name}; it takes {expected}")
    arrays: list[np.ndarray] = []
    batch = -1
    for s in spec.inputs:
        t = by_name.get(s.name)
        if t is None:
            raise BadRequest(f"missing input {s.name!r} for model {spec.name}; it takes {expected}")
        if t.datatype != s.datatype.name:
            known = "" if t.datatype in BY_NAME else " (unknown datatype)"
            raise BadRequest(f"input {s.name}: datatype {t.datatype}{known} does not match the model's "
                             f"{s.datatype.name}")
        shape = t.shape
        if len(shape) != len(s.shape) or tuple(shape[1:]) != s.sample_shape:
            raise BadRequest(f"input {s.name}: shape {shape} does not match the model's {list(s.shape)} "
                             "(-1 is the batch dimension)")
        n = shape[0]
        if not 1 <= n <= spec.max_batch_size:
            raise BadRequest(f"input {s.name}: batch of {n} is outside 1..{spec.max_batch_size} "
                             "(max_batch_size)")
        if batch not in (-1, n):
            raise BadRequest(f"inputs disagree on the batch size ({batch} and {n})")
        batch = n
        count = math.prod(shape)
        dt = s.datatype.numpy
        if t.raw is not None:
            want = count * dt.itemsize
            if len(t.raw) != want:
                raise BadRequest(f"input {s.name}: {len(t.raw)} bytes of data, but shape {shape} of "
                                 f"{s.datatype.name} needs {want}")
            arr = np.frombuffer(t.raw, dtype=dt).reshape(shape)
        else:
            arr = _from_json(t.data, s.datatype.name, dt, count, s.name).reshape(shape)
        arrays.append(arr)
    return tuple(arrays), batch


def _from_json(data: Any, dt_name: str, dt: np.dtype, count: int, name: str) -> np.ndarray:
    # A finite number too large for a float datatype (1e39 as FP32, 70000 as FP16) is the client's
    # mistake, as an integer out of range is: refuse it, rather than serve inf (or, where warnings
    # are errors, fail with a 500).
    try:
        with np.errstate(over="raise"):
            return _convert_json(data, dt_name, dt, count, name)
    except FloatingPointError:
        raise BadRequest(f"input {name}: a value is out of range for {dt_name}") from None


def _convert_json(data: Any, dt_name: str, dt: np.dtype, count: int, name: str) -> np.ndarray:
    if data is None:
        raise BadRequest(f"input {name}: no data (give 'data', or binary data with parameters.binary_data_size)")
    if not isinstance(data, list):
        raise BadRequest(f"input {name}: data must be a list, got {type(data).__name__}")
    if dt.kind == "f" and _leaf_is_float(data):
        # The common case (floats for a float input): one conversion, straight to the dtype.
        try:
            arr = np.array(data, dtype=dt)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"input {name}: data is not a regular array of numbers: {e}") from None
        if arr.size != count:
            raise BadRequest(f"input {name}: {arr.size} values of data, but its shape needs {count}")
        return arr.ravel()
    try:
        arr = np.array(data)
    except ValueError as e:
        raise BadRequest(f"input {name}: data is not a regular array: {e}") from None
    if arr.dtype == object:
        raise BadRequest(f"input {name}: data is not a regular array of numbers")
    if arr.size != count:
        raise BadRequest(f"input {name}: {arr.size} values of data, but its shape needs {count}")
    kind = arr.dtype.kind
    if count and dt_name == "BOOL" and kind != "b":
        raise BadRequest(f"input {name}: BOOL data must be true/false")
    if count and dt_name != "BOOL" and kind not in "biuf":
        raise BadRequest(f"input {name}: {dt_name} data must be numbers")
    if count and dt.kind in "iu" and kind == "f":
        raise BadRequest(f"input {name}: {dt_name} data must be integers")
    if count and dt.kind in "iu" and kind in "iu":
        info = np.iinfo(dt)
        if arr.min() < info.min or arr.max() > info.max:
            raise BadRequest(f"input {name}: a value is out of range for {dt_name}")
    return arr.astype(dt, copy=False).ravel()


def _leaf_is_float(data: list[Any]) -> bool:
    x: Any = data
    while isinstance(x, list) and x:
        x = x[0]
    return type(x) is float


def select_outputs(spec: ModelSpec, names: Sequence[str] | None) -> list[int]:
    """Indices of the requested outputs (all of them when `names` is None)."""
    if names is None:
        return list(range(len(spec.outputs)))
    index = {o.name: i for i, o in enumerate(spec.outputs)}
    picked: list[int] = []
    for n in names:
        if n not in index:
            raise BadRequest(f"unknown output {n!r} for model {spec.name}; it gives {list(index)}")
        if index[n] in picked:
            raise BadRequest(f"output {n} is requested twice")
        picked.append(index[n])
    return picked


def tensor_bytes(arr: np.ndarray) -> bytes:
    """Little-endian, row-major bytes of an output."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes()
