"""Tensors between the wire and numpy, shared by both frontends.

Every check a request's tensors must pass lives here, so HTTP and the socket refuse the same
inputs with the same messages: names, datatypes, shapes (batch first, non-batch dims as the
model declares) and byte counts. Binary data is wrapped without copying, except BYTES, whose
length-prefixed elements become a numpy object array of `bytes`; BF16 is `ml_dtypes.bfloat16`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from daemon.datatypes import BY_NAME, DataType
from daemon.errors import BadRequest
from daemon.model import ModelSpec

_LEN = struct.Struct("<I")  # a BYTES element's length prefix


@dataclass(slots=True)
class WireTensor:
    """One input as the wire gave it: raw little-endian bytes, or JSON data (nested or flat)."""

    name: str
    datatype: str
    shape: list[int]
    raw: bytes | memoryview | None = None
    data: Any = None
    owned: bool = False  # raw is a copy the request owns (read from a shared-memory region)


MAX_TIMEOUT_US = 3_600_000_000  # an hour: a larger timeout is a mistake, not a deadline


def request_options(timeout_us: Any, priority: Any) -> tuple[int | None, int | None]:
    """A request's `timeout` (µs; None: the model's SLO) and `priority` (None or 0: the default
    level) as the wire gave them, checked; the same rules on every frontend."""
    if timeout_us is not None and (isinstance(timeout_us, bool) or not isinstance(timeout_us, int)
                                   or not 0 <= timeout_us <= MAX_TIMEOUT_US):
        raise BadRequest(f"timeout must be an integer number of microseconds in 0..{MAX_TIMEOUT_US}, "
                         f"got {timeout_us!r}")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or priority < 0):
        raise BadRequest(f"priority must be a non-negative integer, got {priority!r}")
    return timeout_us, priority


def check_shape(shape: Any, name: str) -> list[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise BadRequest(f"input {name}: shape must be a list of integers, got {shape!r}")
    if any(d < 0 for d in shape):
        raise BadRequest(f"input {name}: shape {shape} has a negative dimension")
    return shape


def region_tensor(name: str, datatype: str, shape: list[int], raw: np.ndarray) -> WireTensor:
    """An input read from a shared-memory region (its bytes copied into the request's memory)."""
    return WireTensor(name, datatype, shape, raw=raw.data, owned=True)


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
        found = by_name.get(s.name)
        if found is None:
            raise BadRequest(f"missing input {s.name!r} for model {spec.name}; it takes {expected}")
        t = found
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
        arrays.append(decode_tensor(s.name, s.datatype, shape, t))
    return tuple(arrays), batch


def decode_tensor(name: str, datatype: DataType, shape: list[int], t: WireTensor) -> np.ndarray:
    """One input's array of `shape`, from raw bytes or JSON data; BadRequest if they do not fit."""
    count = math.prod(shape)
    if t.raw is None:
        if datatype.variable:
            return _bytes_from_json(t.data, count, name).reshape(shape)
        if datatype.name == "BF16":  # through FP32: numpy's float checks, then rounded to bfloat16
            wide = _from_json(t.data, "BF16", np.dtype(np.float32), count, name)
            narrow = wide.astype(datatype.numpy)
            if np.isinf(narrow.astype(np.float32)).sum() != np.isinf(wide).sum():
                raise BadRequest(f"input {name}: a value is out of range for BF16")
            return narrow.reshape(shape)
        return _from_json(t.data, datatype.name, datatype.numpy, count, name).reshape(shape)
    if datatype.variable:
        return decode_bytes(t.raw, count, name).reshape(shape)
    want = count * datatype.itemsize
    if len(t.raw) != want:
        raise BadRequest(f"input {name}: {len(t.raw)} bytes of data, but shape {shape} of "
                         f"{datatype.name} needs {want}")
    return np.frombuffer(t.raw, dtype=datatype.numpy).reshape(shape)


def decode_bytes(raw: bytes | memoryview, count: int, name: str) -> np.ndarray:
    """`count` BYTES elements, each a 4-byte little-endian length and that many bytes, filling `raw`
    exactly; an object array of `bytes`."""
    view = memoryview(raw)
    end = len(view)
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > end:
            raise BadRequest(f"input {name}: BYTES data ends before element {i} of {count} (each element is a "
                             "4-byte little-endian length, then its bytes)")
        (n,) = _LEN.unpack_from(view, pos)
        pos += 4
        if n > end - pos:
            raise BadRequest(f"input {name}: BYTES element {i} says {n} bytes, but only {end - pos} remain")
        out[i] = bytes(view[pos : pos + n])
        pos += n
    if pos != end:
        raise BadRequest(f"input {name}: {end - pos} bytes of data follow its {count} BYTES elements")
    return out


def _bytes_from_json(data: Any, count: int, name: str) -> np.ndarray:
    """BYTES given as values: strings (nested lists, or flat), taken as their UTF-8 bytes, or bytes."""
    if data is None:
        raise BadRequest(f"input {name}: no data (give 'data', or binary data with parameters.binary_data_size)")
    flat: list[bytes] = []
    stack: list[Any] = [data]
    while stack:  # depth-first, left to right: row-major order
        x = stack.pop()
        if isinstance(x, list):
            if len(flat) + len(stack) + len(x) > count:  # never walk more than the shape holds
                raise BadRequest(f"input {name}: more values of data than its shape holds ({count})")
            stack.extend(reversed(x))
        elif isinstance(x, str):
            flat.append(x.encode())
        elif isinstance(x, bytes):  # gRPC's bytes_contents (JSON has only strings)
            flat.append(x)
        else:
            raise BadRequest(f"input {name}: BYTES data must be strings, got {type(x).__name__}")
    if len(flat) != count:
        raise BadRequest(f"input {name}: {len(flat)} values of data, but its shape needs {count}")
    out = np.empty(count, dtype=object)
    out[:] = flat
    return out


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


def select_outputs(spec: ModelSpec, names: Sequence[str] | None, personalized: bool = False) -> list[int]:
    """Indices (in `spec.served_outputs`) of the requested outputs (all of them when `names` is
    None). The personalized output exists only for a request naming a user (`personalized`)."""
    if names is None:
        return list(range(len(spec.served_outputs) if personalized else len(spec.outputs)))
    index = {o.name: i for i, o in enumerate(spec.served_outputs)}
    picked: list[int] = []
    for n in names:
        if n not in index:
            raise BadRequest(f"unknown output {n!r} for model {spec.name}; it gives {list(index)}")
        if index[n] >= len(spec.outputs) and not personalized:
            raise BadRequest(f"output {n} of model {spec.name} is a user's answer: name the user (the request "
                             "parameter user)")
        if index[n] in picked:
            raise BadRequest(f"output {n} is requested twice")
        picked.append(index[n])
    return picked


def tensor_bytes(arr: np.ndarray) -> bytes:
    """Little-endian, row-major bytes of an output; BYTES as length-prefixed elements."""
    dt = arr.dtype
    if not dt.hasobject and dt.byteorder != ">":
        return arr.tobytes()  # most outputs: numbers in native or little-endian order, any strides
    if dt.hasobject:
        return b"".join(_LEN.pack(len(b)) + b for b in (_as_bytes(x) for x in arr.ravel()))
    return np.ascontiguousarray(arr).astype(dt.newbyteorder("<")).tobytes()


def _as_bytes(x: Any) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


def json_data(arr: np.ndarray, name: str) -> Any:
    """An output's values for a JSON answer (flat, row-major): numbers as they are, BF16 as floats,
    BYTES as strings (BadRequest if an element is not UTF-8: it must be asked for as binary)."""
    flat = arr.ravel() if arr.flags.c_contiguous else arr.flatten()
    if arr.dtype == object:
        try:
            return [x if isinstance(x, str) else bytes(x).decode() for x in flat]
        except UnicodeDecodeError:
            raise BadRequest(f"output {name} holds bytes that are not UTF-8, which JSON cannot carry; ask for it "
                             "as binary data") from None
    if arr.dtype == BY_NAME["BF16"].numpy:
        return flat.astype(np.float32)
    return flat
