"""The clients' wire formats: the socket's msgpack frames and KServe v2's binary HTTP bodies.

What a request becomes on the wire and what an answer becomes for the caller (`InferResult`,
`AppResult`, `InferenceServerError`), with no connection in it: the socket clients (uds.py),
the HTTP clients (http.py) and the benchmarks' load generators build and read messages here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import orjson

from daemon.api.codec import decode_bytes, tensor_bytes
from daemon.datatypes import BY_NAME, BY_NUMPY

LENGTH = struct.Struct(">I")
HEADER_LEN = "Inference-Header-Content-Length"


class InferenceServerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


@dataclass(slots=True)
class InferResult:
    model: str
    version: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    reconstructed: bool = False
    cached: bool = False  # answered from the daemon's prediction cache (docs/cache.md)
    query_id: str = ""  # a personalized answer: what its feedback names (docs/personalization.md)
    in_regions: dict[str, dict[str, Any]] = field(default_factory=dict)  # outputs written to shared memory


@dataclass(slots=True)
class AppResult:
    """An application's answer (docs/applications.md): its one output, the models that made it, and
    the query id its feedback names ("" for a default answer)."""

    app: str
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    models: list[str] = field(default_factory=list)
    query_id: str = ""
    skipped: list[str] = field(default_factory=list)  # left out: the controller expected them too late
    late: list[str] = field(default_factory=list)  # run, but not back by the deadline
    default: bool = False  # the application's default output: no model answered in time
    partial: bool = False  # an ensemble answered without some of its models

    @property
    def output(self) -> np.ndarray:
        return next(iter(self.outputs.values()))


def app_result(app: str, outputs: dict[str, np.ndarray], p: dict[str, Any]) -> AppResult:
    return AppResult(app, outputs, list(p.get("models", [])), str(p.get("query_id", "")), list(p.get("skipped", [])),
                     list(p.get("late", [])), bool(p.get("default")), bool(p.get("partial")))


def app_infer_message(app: str, inputs: Mapping[str, np.ndarray], timeout_us: int | None = None,
                      priority: int | None = None) -> dict[str, Any]:
    """The msgpack map of an application query (without its id)."""
    msg = infer_message("", inputs, timeout_us=timeout_us, priority=priority)
    del msg["model"]
    return {**msg, "op": "app_infer", "app": app}


def app_feedback_message(app: str, query_id: str, label: int | list[int] | None = None,
                         reward: float | dict[str, float] | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": "app_feedback", "app": app, "query_id": query_id}
    if label is not None:
        msg["label"] = label
    if reward is not None:
        msg["reward"] = reward
    return msg


def app_socket_result(msg: dict[str, Any]) -> AppResult:
    outs = {o["name"]: _wire_array(o["data"], o["datatype"], o["shape"]) for o in msg.get("outputs", [])}
    return app_result(str(msg.get("app", "")), outs, msg)


@dataclass(frozen=True, slots=True)
class ShmInput:
    """An input read from a registered shared-memory region (`byte_size` bytes at `offset`)."""

    region: str
    byte_size: int
    datatype: str
    shape: list[int]
    offset: int = 0

    def wire(self, name: str) -> dict[str, Any]:
        return {"name": name, "datatype": self.datatype, "shape": list(self.shape),
                "parameters": _shm_params(self.region, self.byte_size, self.offset)}


@dataclass(frozen=True, slots=True)
class ShmOutput:
    """An output the daemon writes into a registered region (at most `byte_size` bytes at `offset`)."""

    name: str
    region: str
    byte_size: int
    offset: int = 0

    def wire(self) -> dict[str, Any]:
        return {"name": self.name, "parameters": _shm_params(self.region, self.byte_size, self.offset)}


def _shm_params(region: str, byte_size: int, offset: int) -> dict[str, Any]:
    return {"shared_memory_region": region, "shared_memory_byte_size": byte_size, "shared_memory_offset": offset}


def _datatype(arr: np.ndarray) -> str:
    dt = BY_NUMPY.get(arr.dtype.newbyteorder("=") if arr.dtype.byteorder == ">" else arr.dtype)
    if dt is None:
        raise TypeError(f"no wire datatype for numpy dtype {arr.dtype}")
    return dt.name


def _le_bytes(arr: np.ndarray) -> bytes:
    return tensor_bytes(arr)  # little-endian; BYTES (object arrays) length-prefixed


def _wire_array(raw: bytes | memoryview, datatype: str, shape: list[int]) -> np.ndarray:
    """An output from its wire bytes (BYTES: an object array of bytes)."""
    if datatype == "BYTES":
        return decode_bytes(raw, math.prod(shape), "output").reshape(shape)
    return np.frombuffer(raw, dtype=BY_NAME[datatype].numpy).reshape(shape)


def infer_message(model: str, inputs: Mapping[str, np.ndarray | ShmInput],
                  outputs: Sequence[str | ShmOutput] | None = None, version: str | int | None = None,
                  timeout_us: int | None = None, priority: int | None = None, user: str | None = None
                  ) -> dict[str, Any]:
    """The msgpack map of an infer request (without its id)."""
    msg: dict[str, Any] = {
        "op": "infer", "model": model,
        "inputs": [a.wire(n) if isinstance(a, ShmInput) else
                   {"name": n, "datatype": _datatype(a), "shape": list(a.shape), "data": _le_bytes(a)}
                   for n, a in inputs.items()],
    }
    if outputs is not None:
        msg["outputs"] = [o.wire() if isinstance(o, ShmOutput) else o for o in outputs]
    if version is not None:
        msg["version"] = str(version)
    if timeout_us is not None:
        msg["timeout_us"] = int(timeout_us)
    if priority is not None:
        msg["priority"] = int(priority)
    if user is not None:
        msg["user"] = user
    return msg


def decode_answer(msg: Any) -> dict[str, Any]:
    if not isinstance(msg, dict) or "status" not in msg:
        raise InferenceServerError(0, f"malformed answer from the daemon: {msg!r:.200}")
    if msg["status"] != 200:
        raise InferenceServerError(int(msg["status"]), str(msg.get("error", "")))
    return msg


def infer_result(msg: dict[str, Any]) -> InferResult:
    outs = {}
    in_regions = {}
    for o in msg.get("outputs", []):
        if "data" in o:
            outs[o["name"]] = _wire_array(o["data"], o["datatype"], o["shape"])
        else:
            in_regions[o["name"]] = {"datatype": o["datatype"], "shape": o["shape"], "parameters": o["parameters"]}
    return InferResult(msg.get("model", ""), msg.get("version", ""), outs, bool(msg.get("reconstructed")),
                       bool(msg.get("cached")), str(msg.get("query_id", "")), in_regions)


def answer_body(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without the frame's own keys (what HTTP's body holds)."""
    return {k: v for k, v in answer.items() if k not in ("id", "status")}


def version_field(version: str | int | None) -> dict[str, str]:
    return {"version": str(version)} if version is not None else {}


def feedback_message(model: str, query_id: str, label: int | list[int], version: str | int | None) -> dict[str, Any]:
    return {"op": "feedback", "model": model, "query_id": query_id, "label": label, **version_field(version)}


def frame(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


# -------------------------------------------------------------------- HTTP (KServe v2, binary tensors)


def http_infer_body(inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None,
                    timeout_us: int | None = None, priority: int | None = None,
                    user: str | None = None) -> tuple[bytes, int]:
    """A KServe v2 binary body: JSON header + tensor bytes; returns (body, header length)."""
    chunks = [_le_bytes(a) for a in inputs.values()]
    header: dict[str, Any] = {"inputs": [
        {"name": n, "datatype": _datatype(a), "shape": list(a.shape), "parameters": {"binary_data_size": len(c)}}
        for (n, a), c in zip(inputs.items(), chunks, strict=True)]}
    if outputs is not None:
        header["outputs"] = [{"name": o, "parameters": {"binary_data": True}} for o in outputs]
    params: dict[str, Any] = {} if outputs is not None else {"binary_data_output": True}
    if timeout_us is not None:
        params["timeout"] = int(timeout_us)
    if priority:
        params["priority"] = int(priority)
    if user is not None:
        params["user"] = user
    if params:
        header["parameters"] = params
    h = orjson.dumps(header)
    return b"".join([h, *chunks]), len(h)


def http_infer_result(body: bytes, header_len: str | None) -> InferResult:
    n = int(header_len) if header_len is not None else len(body)
    obj = orjson.loads(body[:n])
    outs: dict[str, np.ndarray] = {}
    offset = n
    for o in obj.get("outputs", []):
        dt = BY_NAME[o["datatype"]].numpy
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outs[o["name"]] = _wire_array(memoryview(body)[offset : offset + size], o["datatype"], o["shape"])
            offset += size
        elif o["datatype"] == "BYTES":
            outs[o["name"]] = np.array([x.encode() for x in o["data"]], dtype=object).reshape(o["shape"])
        else:
            outs[o["name"]] = np.array(o["data"], dtype=dt).reshape(o["shape"])
    params = obj.get("parameters") or {}
    return InferResult(obj.get("model_name", ""), obj.get("model_version", ""), outs,
                       bool(params.get("reconstructed")), bool(params.get("cached")), str(params.get("query_id", "")))
