"""Shared by the reliability tests: raw socket frames, a daemon as a subprocess, small models, figures.

The tests speak raw bytes (http.client, plain sockets, asyncio streams) rather than our clients,
so what reaches the daemon is exactly what a test generated, and a duplicate or missing answer
is seen instead of being absorbed by a client's bookkeeping.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import socket
import struct
import subprocess
import sys
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
_record_lock = threading.Lock()


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
    with _record_lock:
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
        self._buf = bytearray()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                return False
            self._buf += chunk
        return True

    def read_frame(self) -> dict[str, Any] | None:
        """The next answer, or None when the daemon closed the connection (raises TimeoutError)."""
        if not self._fill(4):
            assert not self._buf, f"the connection closed mid-frame: {bytes(self._buf)!r}"
            return None
        (n,) = LENGTH.unpack_from(self._buf)
        assert self._fill(4 + n), "the connection closed mid-frame"
        payload = bytes(self._buf[4 : 4 + n])
        del self._buf[: 4 + n]
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
        self._waiters: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.on_answer: Callable[[Any, dict[str, Any]], None] | None = None

    async def connect(self, path: str) -> FrameConnection:
        self.reader, self.writer = await asyncio.open_unix_connection(path, limit=2**26)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())
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
        self._waiters[req_id] = fut
        self.send(req_id, msg)
        return await asyncio.wait_for(fut, limit_s)

    async def _read_loop(self) -> None:
        assert self.reader is not None
        try:
            while True:
                (n,) = LENGTH.unpack(await self.reader.readexactly(4))
                answer = msgpack.unpackb(await self.reader.readexactly(n), raw=False)
                now = time.monotonic()
                rid = answer.get("id")
                self.answers.setdefault(rid, []).append((now, answer))
                fut = self._waiters.pop(rid, None)
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
        if self._task is not None:
            await self._task


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


# -------------------------------------------------------------------- a daemon as a subprocess


class DaemonProcess:
    """`python -m daemon serve --config ...` with its log read on a thread; waits on log lines, never sleeps."""

    def __init__(self, config: Path, socket_path: str = "", cwd: Path | None = None) -> None:
        self.socket = socket_path
        self.scenario = ""  # what the test set up this daemon for, for its figures
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon", "serve", "--config", str(config)],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=cwd)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        # The log must be read all the time: a full pipe would block the daemon's logging.
        self._reader = threading.Thread(target=self._read, name="daemon-log", daemon=True)
        self._reader.start()
        self.http_port: int | None = None

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Block until a log line matches `pattern` (a regex); raises with the log if the daemon exits first."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = end - time.monotonic()
                if self._eof or left <= 0:
                    raise AssertionError(f"no log line matched {pattern!r}:\n" + "".join(self.lines[-60:]))
                self._cond.wait(left)

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        m = self.wait_for(r"HTTP listening on [^:]+:(\d+)", timeout)
        self.http_port = int(m.group(1))
        self.wait_for(r"escapement\.server: ready:", timeout)
        return self

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def rss_bytes(self) -> int:
        return _status_kib(self.proc.pid, "VmRSS") * 1024

    def peak_rss_bytes(self) -> int:
        return _status_kib(self.proc.pid, "VmHWM") * 1024

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(timeout)
        self._close_pipe()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reader.join(30)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()

    def log(self) -> str:
        with self._cond:
            return "".join(self.lines)


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


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
