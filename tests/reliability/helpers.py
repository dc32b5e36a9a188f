"""Shared by the reliability tests: raw socket frames, small models, figures (a daemon as a
subprocess is tests/harness.py DaemonProcess).

The tests speak raw bytes (http.client, plain sockets, asyncio streams) rather than our clients,
so what reaches the daemon is exactly what a test generated, and a duplicate or missing answer
is seen instead of being absorbed by a client's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch
from torch import nn

from daemon.demo import save_model

LENGTH = struct.Struct(">I")
OUT_ENV = "ESCAPEMENT_RELIABILITY_OUT"
RECORD_LOCK = threading.Lock()


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return LENGTH.pack(len(payload)) + payload


def _plain(x: Any) -> Any:
    """NaN (a percentile of nothing) as null: strict JSON has no NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def record(name: str, figures: dict[str, Any]) -> None:
    """Print a test's measured figures and merge them into the JSON file named by $ESCAPEMENT_RELIABILITY_OUT."""
    figures = _plain(figures)
    print(f"\n[reliability] {name}: {json.dumps(figures, sort_keys=True)}")
    path = os.environ.get(OUT_ENV)
    if not path:
        return
    with RECORD_LOCK:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}
        except ValueError:  # a half-written file from an interrupted run: start again
            data = {}
        data[name] = figures
        p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -------------------------------------------------------------------- raw socket, blocking


class RawSocket:
    """A unix-socket connection that reads whole frames, with deadlines; for fuzzing."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self.buf = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def fill(self, n: int) -> bool:
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                return False
            self.buf += chunk
        return True

    def read_frame(self) -> dict[str, Any] | None:
        """The next answer, or None when the daemon closed the connection (raises TimeoutError)."""
        if not self.fill(4):
            assert not self.buf, f"the connection closed mid-frame: {bytes(self.buf)!r}"
            return None
        (n,) = LENGTH.unpack_from(self.buf)
        assert self.fill(4 + n), "the connection closed mid-frame"
        payload = bytes(self.buf[4 : 4 + n])
        del self.buf[: 4 + n]
        answer = msgpack.unpackb(payload, raw=False)
        assert isinstance(answer, dict), answer
        return answer

    def close(self) -> None:
        self.sock.close()


# -------------------------------------------------------------------- raw socket, asyncio


class FrameConnection:
    """An asyncio unix-socket connection that keeps every answer, each with the time it arrived.

    `answers[id]` is a list, not a value, so a request answered twice shows up as two entries.
    """

    def __init__(self) -> None:
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.answers: dict[Any, list[tuple[float, dict[str, Any]]]] = {}
        self.sent: dict[Any, float] = {}
        self.closed = asyncio.Event()
        self.waiters: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self.task: asyncio.Task[None] | None = None
        self.on_answer: Callable[[Any, dict[str, Any]], None] | None = None

    async def connect(self, path: str) -> FrameConnection:
        self.reader, self.writer = await asyncio.open_unix_connection(path, limit=2**26)
        self.task = asyncio.get_running_loop().create_task(self.read_loop())
        return self

    def send(self, req_id: Any, msg: dict[str, Any]) -> None:
        assert self.writer is not None
        self.sent[req_id] = time.monotonic()
        self.writer.write(frame({**msg, "id": req_id}))

    def send_raw(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)

    async def call(self, req_id: Any, msg: dict[str, Any], limit_s: float = 10.0) -> dict[str, Any]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiters[req_id] = fut
        self.send(req_id, msg)
        return await asyncio.wait_for(fut, limit_s)

    async def read_loop(self) -> None:
        assert self.reader is not None
        try:
            while True:
                (n,) = LENGTH.unpack(await self.reader.readexactly(4))
                answer = msgpack.unpackb(await self.reader.readexactly(n), raw=False)
                now = time.monotonic()
                rid = answer.get("id")
                self.answers.setdefault(rid, []).append((now, answer))
                fut = self.waiters.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(answer)
                if self.on_answer is not None:
                    self.on_answer(rid, answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self.task is not None:
            await self.task


# -------------------------------------------------------------------- models and repositories


class Wide(nn.Module):
    """A linear model on a wide input: requests carry enough bytes for buffering to show in RSS."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4)
        with torch.no_grad():
            self.fc.weight.fill_(1.0 / width)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def wide_repo(root: Path, name: str = "wide", width: int = 64, max_batch: int = 1, slo_ms: float = 100.0) -> Path:
    """A repository holding one FP32 model [-1, width] -> [-1, 4]."""
    save_model(Wide(width), "pt2", torch.zeros(2, width), max(max_batch, 2), root / name / "1" / "model.pt2")
    (root / name / "config.toml").write_text(
        f'max_batch_size = {max_batch}\nslo_ms = {slo_ms}\n'
        f'[[inputs]]\nname = "INPUT__0"\ndatatype = "FP32"\nshape = [-1, {width}]\n'
        '[[outputs]]\nname = "OUTPUT__0"\ndatatype = "FP32"\nshape = [-1, 4]\n', encoding="utf-8")
    return root


def write_config(path: Path, sections: dict[str, dict[str, Any]], faults: list[dict[str, Any]] | None = None) -> Path:
    """A TOML config from plain values (strings, numbers, booleans, lists of strings)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    out: list[str] = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {value(v)}" for k, v in table.items()]
    for f in faults or []:
        out.append("[[faults]]")
        out += [f"{k} = {value(v)}" for k, v in f.items()]
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return path
