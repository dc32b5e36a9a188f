"""`soak`: a long run of malformed input and of overload against real daemons (issue 13).

Not a test (never in `make test`, not in `python -m bench all`): `python -m bench run soak` runs
the full size (100,000 inputs per frontend, 60 s of overload; 3 to 4 minutes on 2 cores),
`--quick` a short one (3,000 inputs per frontend, 5 s of overload; ~30 s). Options as for every
scenario (`--fuzz-inputs N --overload-s S --capacity-rps R --skip fuzz|overload ...`, see `run`).
Two daemons, each started on the demo models as every scenario starts one (bench/servers.py):

1. **Fuzz.** Both frontends, `server.max_body_bytes` at 1 MiB so bodies over the limit and
   decompression bombs cost little to send. `fuzz_inputs` generated requests (HTTP) and frames
   (socket) each, from bench/fuzzgen.py: most valid-looking with one thing wrong, some valid, a
   few random bytes; several per connection (pipelined), the writes cut at random boundaries,
   connections ended by a half-close, a plain close after the answers, or a reset.
   `concurrency` connections at a time, each under `op_timeout_s`. Every answer is classified by
   status: a 5xx is a `bad_5xx` unless it is a labelled overload refusal (503 with Retry-After), a
   504 to a request that asked for a deadline (or a valid one whose SLO passed), or a 501 naming a
   feature the daemon does not offer. Afterwards: the daemon alive and serving, its pending,
   queued and in-flight requests and its request memory back to 0, its sockets and descriptors
   back to where they began; its RSS sampled all along; its log searched for ERROR lines and
   tracebacks (the inputs that caused them are replayed one by one to name a reproducer).
2. **Overload.** `model` (cnn_heavy: the device, not the event loop, is its bottleneck) over the
   socket, open loop (Poisson). Its capacity at SLO is measured first in the same run, by a short
   ramp (bench/scenarios/common.search_capacity, the rule of results.capacity_at_slo), unless
   `capacity_rps` is given; then `factor` x that is offered for `overload_s` seconds, while a
   separate process (bench/probe.py) times GET /v2/health/ready every 20 ms and samples RSS;
   then the capacity load once more (the machine is shared: did it still hold?). Every row says
   what the daemon, the generator and the rest of the machine used (`other_cores`), the mean
   batch size the daemon ran, and the daemon's own count of deadlines met (escapement_slo_met).

Each check of the issue is a boolean in `checks` (and `checks_failed` in the summary); a failed
check is a finding about the daemon, not a failure of the run, which always writes its results.
A reproducer of any fuzz case: `python -m bench.fuzzgen http|socket --seed S --index I [--port P]`.

Results: bench/results/soak/soak.json and soak.md (soak-quick.* for --quick), with the command.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import uvloop

from bench import loadgen, results
from bench.fuzzgen import Case, Frame, HttpGen, ModelInfo, Request, SocketGen
from bench.probe import fd_count, rss_kib, socket_count, status_kib
from bench.scenarios.common import command, demo_repo, passes, search_capacity, spec_of
from bench.servers import ROOT, CpuMeter, Escapement
from daemon.client.wire import infer_message
from daemon.repository import scan

OUT_DIR = results.RESULTS / "soak"
FUZZ_MAX_BODY = 1 << 20
MODEL_WEIGHTS = {"digits_mlp": 4.0, "digits_cnn": 2.0, "mlp_784": 2.0, "cnn_heavy": 0.5}  # small models mostly
SAMPLES_KEPT = 8  # findings of each kind kept with their inputs
MiB = 1024.0  # KiB per MiB: /proc reports KiB
GAUGES = ("escapement_pending_requests", "nv_inference_pending_request_count", "escapement_device_inflight_actions")
# Limits of the checks (what the issue asks, and what "bounded" is taken to mean).
HEALTH_P99_MS = 50.0
REFUSAL_P99_MS = 10.0  # "answered within a few ms"
GOODPUT_FRACTION = 0.9
RSS_GROWTH_MIB = 32.0  # RSS may not grow more than this from a quarter of the way to the end
QUICK = {"fuzz_inputs": 3_000, "overload_s": 5.0, "ramp_s": 1.5, "refine": 1}
FULL = {"fuzz_inputs": 100_000, "overload_s": 60.0, "ramp_s": 3.0, "refine": 2}


def fuzz_models(repo: Path | None = None) -> list[ModelInfo]:
    """The demo models as the generator sees them."""
    out = []
    for spec in scan(repo or demo_repo()).models:
        out.append(ModelInfo(spec.name, tuple((t.name, t.datatype.name, tuple(t.sample_shape)) for t in spec.inputs),
                             tuple(t.name for t in spec.outputs), spec.max_batch_size,
                             MODEL_WEIGHTS.get(spec.name, 1.0)))
    return out


# ===================================================================== the daemon and its watchers

LOG_LINE = re.compile(r"^(?:\S+ )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)$")


@dataclass
class LogEvent:
    t: float  # time.monotonic() when the line was read
    level: str
    signature: str  # the message with numbers blanked: events of one cause share it
    lines: list[str] = field(default_factory=list)


class LoggedEscapement(Escapement):
    """An Escapement whose whole log is read for ERROR lines, tracebacks and stray output (the base
    class keeps only the last 200 lines)."""

    def __init__(self, repo: str | Path, faults: list[dict[str, Any]] | None = None,
                 **sections: dict[str, Any]) -> None:
        super().__init__(repo, faults, **sections)
        self.levels: Counter[str] = Counter()
        self.tracebacks = 0
        self.other_lines = 0  # stderr lines that are neither log lines nor part of a traceback
        self.events: list[LogEvent] = []  # ERROR and CRITICAL
        self.warnings: Counter[str] = Counter()
        self._last: LogEvent | None = None
        self._lock = threading.Lock()

    def _drain(self) -> None:
        for line in list(self.log):  # start-up: read by start() before this thread began
            self._note(line)
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            self._note(line)

    def _note(self, line: str) -> None:
        line = line.rstrip("\n")
        now = time.monotonic()
        with self._lock:
            m = LOG_LINE.match(line)
            if m:
                level, name, msg = m.groups()
                self.levels[level] += 1
                self._last = None
                sig = f"{name}: {re.sub(r'[0-9]+', 'N', msg)[:160]}"
                if level in ("ERROR", "CRITICAL"):
                    self._last = LogEvent(now, level, sig, [line])
                    self.events.append(self._last)
                elif level == "WARNING":
                    self.warnings[sig] += 1
                return
            if line.startswith("Traceback") and (self._last is None or "Traceback" not in "".join(self._last.lines)):
                self.tracebacks += 1
                if self._last is None:  # a traceback with no log line before it (an uncaught error)
                    self._last = LogEvent(now, "TRACEBACK", "traceback without a log line", [])
                    self.events.append(self._last)
            if self._last is not None:
                if len(self._last.lines) < 60:
                    self._last.lines.append(line)
                if self._last.signature == "traceback without a log line" and line and not line.startswith(" "):
                    self._last.signature = f"traceback: {re.sub(r'[0-9]+', 'N', line)[:160]}"
            else:
                self.other_lines += 1

    def log_figures(self, since: float = 0.0) -> dict[str, Any]:
        with self._lock:
            events = [e for e in self.events if e.t >= since]
            by_sig = Counter(e.signature for e in events)
            first: dict[str, list[str]] = {}
            for e in events:
                if e.signature not in first and len(first) < 5:
                    first[e.signature] = e.lines[:40]
            return {"errors": len(events), "tracebacks": self.tracebacks, "levels": dict(self.levels),
                    "other_stderr_lines": self.other_lines, "errors_by_message": dict(by_sig.most_common(20)),
                    "first_errors": first, "warnings_by_message": dict(self.warnings.most_common(10))}

    def count(self, signature: str) -> int:
        with self._lock:
            return sum(1 for e in self.events if e.signature == signature)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Probe:
    """bench/probe.py in a child process: health latency, RSS, descriptors and sockets of the daemon."""

    def __init__(self, port: int, pid: int, interval: float, out: Path) -> None:
        self.out = out
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.probe", "--port", str(port), "--pid", str(pid),
                                      "--out", str(out), "--interval", str(interval)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL)
        self.samples: dict[str, np.ndarray] = {}

    def stop(self) -> dict[str, np.ndarray]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.samples or not self.out.exists():
            return self.samples
        raw = json.loads(self.out.read_text())
        self.samples = {k: np.array([np.nan if x is None else x for x in v], dtype=float) for k, v in raw.items()}
        return self.samples

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Health latency, memory and sockets between two time.monotonic() moments (after stop())."""
        s = self.samples
        if not s:
            return {"health_probes": 0}
        w = (s["t"] >= t0) & (s["t"] <= t1)
        h = s["health_ms"][w]
        ok = h[~np.isnan(h)]
        rss = s["rss_kib"][w]
        rss = rss[rss > 0]
        q = rss[: max(1, len(rss) // 4)]  # the first quarter of the window
        tail = rss[-max(1, len(rss) // 10) :]  # its last tenth
        socks = s["sockets"][w]
        socks = socks[socks >= 0]
        return {"health_probes": int(w.sum()), "health_failed": int(np.isnan(h).sum()),
                "health_not_200": int(((s["status"][w] != 200) & ~np.isnan(h)).sum()),
                "health_p50_ms": results.percentile(ok, 50), "health_p99_ms": results.percentile(ok, 99),
                "health_max_ms": float(ok.max()) if len(ok) else float("nan"),
                "rss_mib_peak_sampled": float(rss.max()) / MiB if len(rss) else float("nan"),
                "rss_mib_first_quarter": float(q.max()) / MiB if len(rss) else float("nan"),
                "rss_mib_last_tenth": float(tail.max()) / MiB if len(rss) else float("nan"),
                "sockets_peak": int(socks.max()) if len(socks) else -1}


def http_get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def metric_total(port: int, name: str) -> float:
    """A metric of GET /metrics summed over its labels (a counter's `_total` sample included)."""
    _, text = http_get(port, "/metrics")
    total = 0.0
    for line in text.decode().splitlines():
        if line.split("{", 1)[0].split(" ", 1)[0] in (name, name + "_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def in_flight(port: int) -> dict[str, Any]:
    """What the daemon holds for requests: its controller's counts (GET /v2/controller/stats) and the
    sum of each in-flight / queued gauge over its labels (GET /metrics)."""
    _, text = http_get(port, "/metrics")
    gauges = dict.fromkeys(GAUGES, 0.0)
    for line in text.decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in gauges:
            gauges[name] += float(line.rsplit(" ", 1)[1])
    _, body = http_get(port, "/v2/controller/stats")
    st = orjson.loads(body)
    held = {"pending": st.get("pending", 0), "inflight_actions": st.get("inflight_actions", 0),
            "queued": sum((st.get("queued") or {}).values()),
            "request_memory_bytes": (st.get("request_memory") or {}).get("held_bytes", 0)}
    return {"gauges": gauges, **held,
            "leaked": int(sum(gauges.values()) + held["pending"] + held["inflight_actions"] + held["queued"]),
            "request_memory_peak_bytes": (st.get("request_memory") or {}).get("peak_bytes", 0)}


@dataclass(frozen=True)
class Baseline:
    """The daemon at rest before a phase, with the probe's connection open."""

    sockets: int
    fds: int
    rss_kib: int

    @staticmethod
    def of(pid: int) -> Baseline:
        return Baseline(socket_count(pid), fd_count(pid), rss_kib(pid))


def settle(server: LoggedEscapement, base: Baseline, timeout: float = 30.0) -> dict[str, Any]:
    """Wait for the daemon to go quiet: nothing held for requests, its sockets and descriptors back to
    where they began (a refused HTTP connection lingers up to 2 s). Reports what is left after
    `timeout`: those are the leaks."""
    t0 = time.monotonic()
    end = t0 + timeout
    held = in_flight(server.port)
    while (held["leaked"] or held["request_memory_bytes"]) and time.monotonic() < end:
        time.sleep(0.2)
        held = in_flight(server.port)
    # Its own time, whatever the wait above took: in_flight()'s own connection closes a moment later.
    end = max(end, time.monotonic() + 5.0)
    time.sleep(0.2)
    socks, fds = socket_count(server.pid), fd_count(server.pid)
    while (socks > base.sockets or fds > base.fds) and time.monotonic() < end:
        time.sleep(0.2)
        socks, fds = socket_count(server.pid), fd_count(server.pid)
    return {**held, "requests_leaked": held["leaked"], "sockets": socks, "sockets_before": base.sockets,
            "connections_leaked": socks - base.sockets, "fds": fds, "fds_before": base.fds,
            "fds_leaked": fds - base.fds, "settle_s": round(time.monotonic() - t0, 1)}


def memory(server: LoggedEscapement, base: Baseline, watch: dict[str, Any]) -> dict[str, Any]:
    """Start, peak (VmHWM: the kernel's high-water mark, and the highest sample) and end RSS, in MiB,
    and the growth from the first quarter of the phase to its end."""
    end = rss_kib(server.pid) / MiB
    growth = max(end, watch.get("rss_mib_last_tenth", end)) - watch.get("rss_mib_first_quarter", end)
    return {"rss_mib_start": base.rss_kib / MiB, "rss_mib_peak": status_kib(server.pid, "VmHWM") / MiB,
            "rss_mib_peak_sampled": watch.get("rss_mib_peak_sampled"), "rss_mib_end": end,
            "rss_mib_first_quarter": watch.get("rss_mib_first_quarter"), "rss_mib_growth": growth,
            "rss_bounded": bool(growth <= RSS_GROWTH_MIB)}


# ===================================================================== fuzz: running one case


@dataclass
class Outcome:
    """What one case's connection got."""

    answers: list[tuple[int, str, bool, Any]] = field(default_factory=list)  # (status, message, retry, item)
    unanswered: int = 0  # requests that had to be answered and were not
    doubled: int = 0
    malformed: str = ""  # an answer that could not be read (a daemon bug)
    bad_error_body: str = ""
    head_body: str = ""  # an answer to HEAD that carried a body
    reset: bool = False  # the daemon reset the connection
    closed_by_413: bool = False  # a socket frame over the limit was answered 413 (the daemon then closes)


@dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    head_body: bool = False  # an answer to HEAD followed by a body (RFC 9110 9.3.2: it must have none)


def parse_http(buf: bytes, methods: list[str]) -> tuple[list[HttpAnswer], str, int]:
    """The answers in `buf` (interim 1xx ones dropped); a complaint if one could not be read; bytes used."""
    out: list[HttpAnswer] = []
    pos = 0
    while pos < len(buf):
        end = buf.find(b"\r\n\r\n", pos)
        if end < 0:
            return out, "" if len(buf) - pos < 65536 else "an answer head with no end", pos
        head = buf[pos:end].decode("latin-1").split("\r\n")
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            return out, f"not an HTTP answer: {buf[pos : pos + 80]!r}", pos
        status = int(parts[1])
        headers: dict[str, str] = {}
        for h in head[1:]:
            k, _, v = h.partition(":")
            headers[k.strip().lower()] = v.strip()
        body_at = end + 4
        if 100 <= status < 200:
            pos = body_at
            continue
        method = methods[len(out)] if len(out) < len(methods) else "?"
        length = int(headers.get("content-length", "0") or 0)
        n = 0 if method == "HEAD" else length
        head_body = False
        if method == "HEAD" and length and headers.get("connection") == "close" and len(buf) >= body_at + length \
                and not buf.startswith(b"HTTP/1.", body_at):
            n, head_body = length, True  # the last answer on the connection: its body is plainly that
        if len(buf) < body_at + n:
            return out, "", pos  # not all here yet
        out.append(HttpAnswer(status, headers, buf[body_at : body_at + n], head_body))
        pos = body_at + n
    return out, "", pos


def _expected_http(reqs: list[Request]) -> int:
    """How many requests must be answered: those up to the first whose framing or ending is uncertain."""
    n = 0
    for r in reqs:
        if not r.framed or r.ends is None:
            break
        n += 1
        if r.ends:
            break
    return n


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (SO_LINGER 0): the daemon sees ECONNRESET, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class ConnectFailed(Exception):
    """The case's connection could not be opened (the daemon refused it, or is gone)."""


async def _connect(case: Case, where: int | str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        if case.frontend == "http":
            return await asyncio.open_connection("127.0.0.1", where)
        return await asyncio.open_unix_connection(str(where))
    except OSError as e:
        raise ConnectFailed(repr(e)) from e


async def _send(case: Case, writer: asyncio.StreamWriter) -> bool:
    """Write the case's chunks; False when the daemon closed the connection before all were written
    (it may: a frame over the limit is answered, then the connection is closed)."""
    for chunk in case.chunks:
        if writer.transport.is_closing():
            return False
        try:
            writer.write(chunk)
        except RuntimeError:  # uvloop: the transport closed under us
            return False
        if case.pause:
            await asyncio.sleep(0.001)
        else:
            await asyncio.sleep(0)  # let the loop flush this write on its own
    await writer.drain()
    return True


async def _exchange(case: Case, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, out: Outcome,
                    enough: Callable[[bytes], bool]) -> bytes | None:
    """Send a case's bytes and finish as it says (reset, half-close, or read until `enough` of the
    bytes read); the bytes read, or None for a case that resets the connection itself. Closes it."""
    buf = b""
    try:
        try:
            await _send(case, writer)
        except OSError:  # reset, broken pipe, ENOTCONN: the daemon ended the connection first
            out.reset = True
        if case.finish == "reset":
            await asyncio.sleep(0.002)
            _abort(writer)
            return None
        if case.finish == "half_close" and not out.reset and not writer.transport.is_closing():
            try:
                writer.write_eof()
            except (OSError, RuntimeError):  # closed meanwhile: read what was answered
                pass
        while True:
            try:
                chunk = await reader.read(65536)
            except OSError:
                out.reset = True
                break
            if not chunk:
                break
            buf += chunk
            if case.finish == "read" and enough(buf):
                break
    finally:
        if not writer.transport.is_closing():
            writer.close()
    return buf


async def http_case(case: Case, port: int) -> Outcome:
    reqs: list[Request] = case.items
    methods = [r.method for r in reqs]
    out = Outcome()
    expected = _expected_http(reqs)
    reader, writer = await _connect(case, port)
    buf = await _exchange(case, reader, writer, out, lambda b: len(parse_http(b, methods)[0]) >= expected)
    if buf is None:
        return out
    answers, complaint, used = parse_http(buf, methods)
    if complaint or (case.finish != "read" and used < len(buf)):
        out.malformed = complaint or f"{len(buf) - used} bytes after the last whole answer: {buf[used:used + 80]!r}"
    if len(answers) < expected and not out.reset:
        out.unanswered = expected - len(answers)
    if len(answers) > len(reqs) and all(r.framed for r in reqs):  # unframed bytes may read as more requests
        out.doubled = len(answers) - len(reqs)
    certain = True
    for i, a in enumerate(answers):
        if a.head_body:
            out.head_body = f"{a.status} to HEAD with {len(a.body)} bytes of body: {a.body[:120]!r}"
        certain = certain and i < len(reqs) and reqs[i].framed
        item: Any = reqs[i] if certain else reqs[min(i, len(reqs) - 1):]
        message, retry = "", "retry-after" in a.headers
        if a.status >= 300 and methods[i if i < len(methods) else -1] != "HEAD":
            try:
                obj = orjson.loads(a.body)
                message = obj["error"]
                assert isinstance(message, str) and message
            except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
                out.bad_error_body = f"{a.status}: {a.body[:200]!r}"
        out.answers.append((a.status, message, retry, item))
    return out


def _frames(buf: bytes) -> tuple[list[Any], int, str]:
    out, pos = [], 0
    while len(buf) - pos >= 4:
        (n,) = struct.unpack_from(">I", buf, pos)
        if len(buf) - pos - 4 < n:
            break
        try:
            out.append(msgpack.unpackb(buf[pos + 4 : pos + 4 + n], raw=False))
        except Exception as e:
            return out, pos, f"an answer that is not msgpack: {type(e).__name__}: {buf[pos:pos + 80]!r}"
        pos += 4 + n
    return out, pos, ""


async def socket_case(case: Case, path: str) -> Outcome:
    frames: list[Frame] = case.items
    out = Outcome()
    expected = 0
    for f in frames:
        if not f.intact:
            break
        expected += 1
    reader, writer = await _connect(case, path)
    buf = await _exchange(case, reader, writer, out, lambda b: len(_frames(b)[0]) >= expected)
    if buf is None:
        return out
    answers, used, complaint = _frames(buf)
    if complaint or (case.finish != "read" and used < len(buf)):
        out.malformed = complaint or f"{len(buf) - used} bytes after the last whole answer: {buf[used:used + 80]!r}"
    by_id = {f.rid: f for f in frames[:expected] if f.rid is not None}
    seen: Counter[int] = Counter()
    for a in answers:
        if not isinstance(a, dict) or not isinstance(a.get("status"), int):
            out.malformed = out.malformed or f"an answer without a status: {a!r:.200}"
            continue
        rid = a.get("id")
        f = by_id.get(rid) if isinstance(rid, int) else None
        if f is not None:
            seen[rid] += 1
        status = a["status"]
        message = a.get("error", "")
        if status != 200 and not (isinstance(message, str) and message):
            out.bad_error_body = f"{a!r:.200}"
        item: Any = f if f is not None else frames
        out.answers.append((status, message if isinstance(message, str) else "", "retry_after_s" in a, item))
    all_intact = expected == len(frames)
    if not any(f.kind == "flip" for f in frames):  # a bit-flipped frame may decode to another frame's id
        out.doubled = sum(n - 1 for n in seen.values() if n > 1) + \
            (max(0, len(answers) - len(frames)) if all_intact else 0)
    if not out.reset:
        missing_ids = sum(1 for rid in by_id if seen[rid] == 0)
        out.unanswered = max(missing_ids, expected - len(answers), 0)
        out.closed_by_413 = any(st == 413 and item is frames for st, _, _, item in out.answers)
    return out


def classify(status: int, message: str, retry: bool, item: Any) -> str:
    """What an answer is: fine, a client error, a labelled refusal, or a finding (bad_5xx)."""
    items = item if isinstance(item, list) else [item]
    asks_deadline = any(getattr(i, "asks_deadline", False) for i in items)
    if status < 300:
        return "ok"
    if status < 500:
        return f"client_{status}"
    if status == 503 and retry:
        return "overload_503"  # labelled: Retry-After / retry_after_s, and says why
    if status == 504 and asks_deadline:
        return "deadline_504_asked"
    if status == 504 and "deadline" in message:
        # Accepted as valid, queued, and its SLO target passed: a miss under the fuzz's load, not an
        # answer to a mistake (the daemon only queues what passed every check). Counted apart.
        return "deadline_504_missed"
    if status == 501 and "not supported" in message:
        return "feature_501"  # NotImplementedByServer, a ClientError in daemon/errors.py, naming the feature
    return "bad_5xx"


# ===================================================================== fuzz: one frontend

# Protocol findings: answers that are wrong in form though not a crash, a 5xx or a leak.
FINDINGS = ("unanswered", "doubled", "malformed_answers", "head_with_body", "errors_without_message", "timeouts",
            "connect_errors")


@dataclass
class FuzzTally:
    frontend: str
    inputs: int = 0
    connections: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    classes: Counter[str] = field(default_factory=Counter)
    finishes: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    counts: Counter[str] = field(default_factory=Counter)  # FINDINGS, and resets by the daemon
    findings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    spans: list[tuple[int, float, float]] = field(default_factory=list)  # (case, start, end): to place log lines
    seed: int = 0
    port: int = 0

    def keep(self, what: str, case: Case, detail: Any) -> None:
        got = self.findings.setdefault(what, [])
        if len(got) < SAMPLES_KEPT:
            got.append({"case": case.index, "kinds": case.kinds, "finish": case.finish, "detail": str(detail)[:400],
                        "input": repr(case.data[:600]), "reproduce": reproduce_command(case, self.seed, self.port)})

    def add(self, case: Case, out: Outcome) -> None:
        self.connections += 1
        self.finishes[case.finish] += 1
        for k in case.kinds:
            self.kinds[":".join(k.split(":")[:2])] += 1
        for status, message, retry, item in out.answers:
            self.statuses[status] += 1
            c = classify(status, message, retry, item)
            self.classes[c] += 1
            if c == "bad_5xx":
                self.keep("bad_5xx", case, f"{status}: {message}")
        for name in ("unanswered", "doubled"):
            n = getattr(out, name)
            if n:
                self.counts[name] += n
                self.keep(name, case, f"{n} of {len(case.items)}; answers {[a[0] for a in out.answers]}")
        if out.unanswered and out.closed_by_413:
            self.counts["unanswered_where_a_413_closed"] += out.unanswered
        for name, what in (("malformed_answers", out.malformed), ("head_with_body", out.head_body),
                           ("errors_without_message", out.bad_error_body)):
            if what:
                self.counts[name] += 1
                self.keep(name, case, what)
        self.counts["resets_by_daemon"] += out.reset

    def figures(self) -> dict[str, Any]:
        return {"frontend": self.frontend, "inputs": self.inputs, "connections": self.connections,
                "seconds": round(self.seconds, 1), "inputs_per_s": round(self.inputs / max(self.seconds, 1e-9), 1),
                "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "classes": dict(sorted(self.classes.items())), "bad_5xx": self.classes.get("bad_5xx", 0),
                **{k: self.counts[k] for k in FINDINGS}, "resets_by_daemon": self.counts["resets_by_daemon"],
                "unanswered_where_a_413_closed": self.counts["unanswered_where_a_413_closed"],
                "finishes": dict(self.finishes), "kinds": dict(self.kinds.most_common()),
                "findings": self.findings}


def reproduce_command(case: Case, seed: int, port: int) -> str:
    """The command that prints this case's bytes (bench/fuzzgen.py); HTTP cases name the port in Host."""
    return f"python -m bench.fuzzgen {case.frontend} --seed {seed} --index {case.index}" + \
        (f" --port {port}" if case.frontend == "http" else "")


async def run_case(case: Case, server: Escapement, limit_s: float) -> Outcome:
    if case.frontend == "http":
        return await asyncio.wait_for(http_case(case, server.port), limit_s)
    return await asyncio.wait_for(socket_case(case, server.socket), limit_s)


async def fuzz_frontend(gen: HttpGen | SocketGen, server: Escapement, target: int, concurrency: int,
                        limit_s: float) -> FuzzTally:
    """Cases 0, 1, 2, ... until `target` inputs were sent, `concurrency` connections at a time."""
    tally = FuzzTally("http" if isinstance(gen, HttpGen) else "socket", seed=gen.seed, port=server.port)
    next_case = 0
    t0 = time.monotonic()

    async def worker() -> None:
        nonlocal next_case
        while tally.inputs < target:
            case = gen.case(next_case)
            next_case += 1
            tally.inputs += len(case.items)
            start = time.monotonic()
            try:
                out = await run_case(case, server, limit_s)
            except TimeoutError:
                tally.counts["timeouts"] += 1
                tally.keep("timeouts", case, f"the connection did not end within {limit_s} s")
                continue
            except ConnectFailed as e:
                tally.counts["connect_errors"] += 1
                tally.keep("connect_errors", case, str(e))
                continue
            finally:
                tally.spans.append((case.index, start, time.monotonic()))
            tally.add(case, out)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    tally.seconds = time.monotonic() - t0
    return tally


async def replay_for_errors(server: LoggedEscapement, gens: dict[str, HttpGen | SocketGen],
                            tallies: dict[str, FuzzTally], since: float, limit_s: float) -> list[dict[str, Any]]:
    """For each kind of ERROR line the fuzz caused (the first 5), replay the cases that were open
    when it was logged, one at a time, until one logs it again: that case reproduces it."""
    found: list[dict[str, Any]] = []
    events = [e for e in server.events if e.t >= since]
    done: set[str] = set()
    for e in events:
        if e.signature in done or len(done) >= 5:
            continue
        done.add(e.signature)
        candidates = sorted(((abs(e.t - end), fe, idx) for fe, t in tallies.items() for idx, start, end in t.spans
                             if start - 0.05 <= e.t <= end + 1.0), key=lambda c: c[0])[:40]
        hit: dict[str, Any] = {"signature": e.signature, "reproduced_by": None, "candidates_tried": 0}
        for _, fe, idx in candidates:
            before = server.count(e.signature)
            case = gens[fe].case(idx)
            case.finish = "half_close"  # answers, then the daemon closes: no timing left to chance
            try:
                await run_case(case, server, limit_s)
            except (TimeoutError, ConnectFailed):
                pass
            hit["candidates_tried"] += 1
            for _ in range(30):
                await asyncio.sleep(0.01)
                if server.count(e.signature) > before:
                    break
            if server.count(e.signature) > before:
                hit["reproduced_by"] = {"frontend": fe, "case": idx, "kinds": case.kinds,
                                        "input": repr(case.data[:600]),
                                        "command": reproduce_command(case, gens[fe].seed, server.port)}
                break
        found.append(hit)
    return found


def still_serves(server: Escapement) -> dict[str, Any]:
    """One valid inference on each frontend, from a new client, and the readiness check."""
    x = np.linspace(0, 1, 64, dtype=np.float32).reshape(1, 64)
    body = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 64],
                                     "data": x.ravel().tolist()}]})
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        c.request("POST", "/v2/models/digits_mlp/infer", body=body)
        r = c.getresponse()
        http_ok = r.status == 200 and len(orjson.loads(r.read())["outputs"][0]["data"]) == 10
    finally:
        c.close()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(server.socket)
        payload = msgpack.packb({**infer_message("digits_mlp", {"INPUT__0": x}), "id": 1}, use_bin_type=True)
        s.sendall(struct.pack(">I", len(payload)) + payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        answers = _frames(data)[0]
        socket_ok = len(answers) == 1 and answers[0].get("status") == 200
    finally:
        s.close()
    status, _ = http_get(server.port, "/v2/health/ready")
    return {"http_infer_ok": http_ok, "socket_infer_ok": socket_ok, "ready_ok": status == 200}


def fuzz_phase(repo: Path, inputs: int, seed: int, concurrency: int, timeout: float, tmp: Path) -> dict[str, Any]:
    models = fuzz_models(repo)
    server = LoggedEscapement(repo, server={"max_body_bytes": FUZZ_MAX_BODY})
    server.start()
    probe: Probe | None = None
    try:
        probe = Probe(server.port, server.pid, 0.05, tmp / "probe-fuzz.json")
        time.sleep(0.5)  # its keep-alive connection is open before the sockets are counted
        base = Baseline.of(server.pid)
        gens: dict[str, HttpGen | SocketGen] = {
            "http": HttpGen(models, seed, FUZZ_MAX_BODY, server.port), "socket": SocketGen(models, seed, FUZZ_MAX_BODY)}
        for i in range(64):
            gens["http"].case(i)  # builds the cached bombs and value pools before the clock starts
        t0 = time.monotonic()
        tallies: dict[str, FuzzTally] = {}
        after: dict[str, dict[str, Any]] = {}  # what each frontend's inputs left held: to tell whose a leak is
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            for fe, gen in gens.items():
                tallies[fe] = runner.run(fuzz_frontend(gen, server, inputs, concurrency, timeout))
                if server.alive:
                    after[fe] = settle(server, base, timeout=10.0)
                print(f"soak: fuzz {fe}: {tallies[fe].inputs} inputs in {tallies[fe].seconds:.0f} s; left held "
                      f"{after.get(fe, {}).get('request_memory_bytes')} bytes of request memory", file=sys.stderr)
            t1 = time.monotonic()
            alive = server.alive
            settled = settle(server, base) if alive else {}
            log_fuzz = server.log_figures()
            replays = runner.run(replay_for_errors(server, gens, tallies, t0, timeout)) if alive else []
        serves = still_serves(server) if server.alive else {}
        probe.stop()
        watch = probe.window(t0, t1)
        mem = memory(server, base, watch) if server.alive else {}
    finally:
        if probe is not None:
            probe.stop()
        server.stop()
    rc = server.proc.returncode if server.proc is not None else None
    figures = {fe: {**t.figures(), "held_after": {k: after.get(fe, {}).get(k) for k in (
        "requests_leaked", "request_memory_bytes", "connections_leaked")}} for fe, t in tallies.items()}
    return {"tallies": figures, "seconds": round(t1 - t0, 1),
            "alive_at_end": alive, "exit_code_on_sigterm": rc, **serves, "settle": settled, "memory": mem,
            "watch": watch, "log": log_fuzz, "error_reproductions": replays}


# ===================================================================== overload


def overload_frame(repo: Path, model: str, deadline_us: int | None) -> loadgen.SocketFrame:
    spec = spec_of(repo, model)
    rng = np.random.default_rng(0)
    x = {t.name: rng.random((1, *t.sample_shape)).astype(t.datatype.numpy) for t in spec.inputs}
    return loadgen.SocketFrame(infer_message(model, x, timeout_us=deadline_us))


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def play(schedule: loadgen.Schedule, server: Escapement, frame: loadgen.SocketFrame, model: str, warmup: float,
         drain_s: float, connections: int) -> tuple[loadgen.Run, dict[str, float]]:
    """One open-loop run over the socket; returns it with the cores the server, the generator and the
    rest of the machine (other users' work, the probe) used meanwhile."""
    meter = CpuMeter(server.pid)
    gc.collect()
    gc.freeze()  # no long collection pass inside a measurement (bench/README.md)
    samples0, runs0 = (metric_total(server.port, f"escapement_batch_size_{k}") for k in ("sum", "count"))
    r0, b0 = _self_cpu(), busy_cpu_seconds()
    t0 = time.monotonic()
    meter.start()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        run = runner.run(loadgen.run_socket(schedule, server.socket, [frame], [model], warmup, drain_s, connections))
    wall = max(time.monotonic() - t0, 1e-9)
    cores = {"server_cores": meter.stop(), "generator_cores": (_self_cpu() - r0) / wall}
    cores["other_cores"] = max(0.0, (busy_cpu_seconds() - b0) / wall - cores["server_cores"] - cores["generator_cores"])
    samples, runs = (metric_total(server.port, f"escapement_batch_size_{k}") for k in ("sum", "count"))
    cores["mean_batch_size"] = (samples - samples0) / (runs - runs0) if runs > runs0 else float("nan")
    return run, cores


def _per_second(run: loadgen.Run, slo_s: float) -> list[int]:
    """Results within the SLO in each second of the run, by when they were sent: a stall shows as a dip."""
    r = run.records
    met = (r.status == 200) & (r.latency <= slo_s)
    t = r.scheduled - np.nanmin(r.scheduled)
    return np.bincount(t[met].astype(int), minlength=int(np.ceil(np.nanmax(t)))).tolist()


def _latency(lat_ms: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    x = lat_ms[mask]
    return {"n": int(mask.sum()), "p50_ms": results.percentile(x, 50), "p99_ms": results.percentile(x, 99),
            "max_ms": float(x.max()) if len(x) else float("nan")}


def overload_phase(repo: Path, model: str, factor: float, seconds: float, capacity_rps: float | None,
                   slowdown: float, ramp_s: float, refine: int, client_deadline: bool, connections: int,
                   seed: int, tmp: Path) -> dict[str, Any]:
    spec = spec_of(repo, model)
    slo_s = spec.slo_s
    faults = [{"device": "cpu:0", "slowdown": slowdown}] if slowdown > 1 else None
    server = LoggedEscapement(repo, faults)
    server.start()
    rows: list[dict[str, Any]] = []
    frame = overload_frame(repo, model, int(slo_s * 1e6) if client_deadline else None)
    probe: Probe | None = None
    try:
        def point(rate: float) -> dict[str, Any]:
            run, cores = play(loadgen.poisson(rate, ramp_s, seed=len(rows) + seed), server, frame, model,
                              min(1.0, ramp_s / 4), max(2.0, 3 * slo_s), connections)
            r = results.row(run, "capacity ramp", slo_s, **cores)
            rows.append(r)
            return r

        point(100.0)  # warm-up: first runs, estimates; not reported
        rows.clear()
        if capacity_rps is None:
            search_capacity(point, [250.0, 500.0], refine=refine)
            capacity = max((r["offered_rps"] for r in rows if passes(r)), default=0.0)
        else:
            capacity = float(capacity_rps)
        if capacity <= 0:
            raise RuntimeError(f"no load passed the SLO in the capacity ramp: {rows}")
        rate = factor * capacity
        probe = Probe(server.port, server.pid, 0.02, tmp / "probe-overload.json")
        time.sleep(1.0)  # the probe's connection is open, and a second of quiet before the load
        base = Baseline.of(server.pid)
        log_since = time.monotonic()
        sched = loadgen.poisson(rate, seconds, seed=seed + 1000)
        met0 = metric_total(server.port, "escapement_slo_met")
        t0 = time.monotonic()
        run, cores = play(sched, server, frame, model, min(5.0, seconds / 10), 30.0, connections)
        t_end_load = t0 + sched.duration
        alive = server.alive
        settled = settle(server, base) if alive else {}
        # the daemon's own count of requests answered by their deadline (its clock starts when it reads the frame)
        daemon_met = (metric_total(server.port, "escapement_slo_met") - met0) / sched.duration if alive else None
        probe.stop()
        if alive:  # the machine is shared: the capacity load once more, to see whether it still holds
            point(capacity)["label"] = "capacity recheck"
        during = probe.window(t0, t_end_load)
        mem = memory(server, base, during) if alive else {}
        log = server.log_figures(log_since)
    finally:
        if probe is not None:
            probe.stop()
        server.stop()
    over = results.row(run, f"overload {factor:g}x", slo_s, **cores)
    rec = run.records
    win = run.window()
    status = rec.status[win]
    lat_ms = rec.latency[win] * 1e3
    refused = (status != 200) & (status > 0)  # every answer that is not a result: 503, 504, ...
    figures = {
        "model": model, "slo_ms": slo_s * 1e3, "device_slowdown": slowdown, "client_deadline": client_deadline,
        "capacity_rps": capacity, "capacity_measured": capacity_rps is None, "factor": factor,
        "offered_rps": over["offered_rps"], "seconds": seconds, "sent": len(sched),
        "statuses": dict(Counter(results.ERROR_NAMES.get(int(s), f"status_{int(s)}") if s != 200 else "ok"
                                 for s in status)),
        "lost": int(np.isin(status, (loadgen.NO_ANSWER, loadgen.CONN_ERROR)).sum()),
        "refused": int(refused.sum()),
        "refusal": _latency(lat_ms, refused), "refusal_503": _latency(lat_ms, status == 503),
        "refusal_504": _latency(lat_ms, status == 504), "ok": _latency(lat_ms, status == 200),
        "goodput_rps": over["goodput_rps"], "goodput_fraction_of_capacity": over["goodput_rps"] / capacity,
        "recheck_goodput_rps": rows[-1]["goodput_rps"] if rows and rows[-1]["label"] == "capacity recheck" else None,
        "daemon_slo_met_per_s": daemon_met,
        "health": {k.removeprefix("health_"): v for k, v in during.items() if k.startswith("health_")},
        "memory": mem, "sockets_peak": during.get("sockets_peak"), "settle": settled, "alive_at_end": alive,
        "exit_code_on_sigterm": server.proc.returncode if server.proc else None,
        "generator_lag_p99_ms": over["generator_lag_p99_ms"], "generator_bound": over["generator_bound"],
        "goodput_per_s": _per_second(run, slo_s), **cores, "log": log,
    }
    return {"figures": figures, "capacity_rows": rows, "overload_row": over}


# ===================================================================== the scenario


def run(quick: bool = False, json_out: str | None = None, fuzz_inputs: int | None = None,
        overload_s: float | None = None, capacity_rps: float | None = None, factor: float = 5.0,
        model: str = "cnn_heavy", slowdown: float = 1.0, seed: int = 0, concurrency: int = 16,
        op_timeout_s: float = 10.0, ramp_s: float | None = None, client_deadline: bool = False,
        connections: int = 8, skip: str = "") -> dict[str, Any]:
    """`skip`: "fuzz" or "overload" to run only the other phase; `slowdown` > 1 slows the overload's
    device by an injected fault (the controller's estimates then lag the device: not the default)."""
    wall0 = time.monotonic()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    size = QUICK if quick else FULL
    given = {"fuzz_inputs": fuzz_inputs, "overload_s": overload_s, "capacity_rps": capacity_rps, "ramp_s": ramp_s,
             "factor": factor if factor != 5.0 else None, "model": model if model != "cnn_heavy" else None,
             "slowdown": slowdown if slowdown != 1.0 else None, "seed": seed or None,
             "client_deadline": client_deadline or None, "skip": skip or None}
    fuzz_inputs = fuzz_inputs or size["fuzz_inputs"]
    overload_s = overload_s or size["overload_s"]
    ramp_s = ramp_s or size["ramp_s"]
    repo = demo_repo()
    fuzz: dict[str, Any] = {}
    over: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        tmp = Path(d)
        if skip != "fuzz":
            fuzz = fuzz_phase(repo, fuzz_inputs, seed, concurrency, op_timeout_s, tmp)
        if skip != "overload":
            over = overload_phase(repo, model, factor, overload_s, capacity_rps, slowdown, ramp_s, size["refine"],
                                  client_deadline, connections, seed, tmp)
    summary, checks = _summary(fuzz, over)
    summary["wall_s"] = round(time.monotonic() - wall0, 1)
    # Other work on the machine takes cores from the daemon and the generator: every figure depends on it.
    summary["loadavg_start_end"] = [load0, Path("/proc/loadavg").read_text().split()[:3]]
    config = {"command": command("soak", quick, {k: json.dumps(v) if isinstance(v, bool) else v
                                                 for k, v in given.items() if v is not None}),
              "fuzz_inputs_per_frontend": fuzz_inputs, "fuzz_concurrency": concurrency, "op_timeout_s": op_timeout_s,
              "seed": seed, "fuzz_server": {"max_body_bytes": FUZZ_MAX_BODY, "models": sorted(MODEL_WEIGHTS)},
              "overload": {"model": model, "factor": factor, "seconds": overload_s, "device_slowdown": slowdown,
                           "ramp_s_per_point": ramp_s, "socket_connections": connections,
                           "client_deadline": client_deadline, "capacity_rps_given": capacity_rps},
              "limits": {"health_p99_ms": HEALTH_P99_MS, "refusal_p99_ms": REFUSAL_P99_MS,
                         "goodput_fraction": GOODPUT_FRACTION, "rss_growth_mib": RSS_GROWTH_MIB}}
    rows: list[dict[str, Any]] = []
    if fuzz:
        rows += [{"label": f"fuzz {fe}", **{k: v for k, v in t.items() if k not in ("kinds", "findings")}}
                 for fe, t in fuzz["tallies"].items()]
    if over:
        rows += [*over["capacity_rows"], over["overload_row"]]
    out = Path(json_out) if json_out else OUT_DIR / ("soak-quick.json" if quick else "soak.json")
    result = results.write("soak", config, rows, summary, out, _notes(fuzz, over))
    result["checks"] = checks
    result["fuzz"] = fuzz
    result["overload"] = over.get("figures", {})
    out.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(table(result))
    return result


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _summary(fuzz: dict[str, Any], over: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool]]:
    """The headline figures, and the checks the issue asks for (each True when it holds)."""
    s: dict[str, Any] = {}
    checks: dict[str, bool] = {}
    if fuzz:
        t = fuzz["tallies"]
        for fe, f in t.items():
            s[f"fuzz_{fe}_inputs"] = f["inputs"]
            s[f"fuzz_{fe}_bad_5xx"] = f["bad_5xx"]
            s[f"fuzz_{fe}_findings"] = {k: f[k] for k in FINDINGS if f[k]}
        st, mem = fuzz["settle"], fuzz["memory"]
        s["fuzz_crashes"] = 0 if fuzz["alive_at_end"] and fuzz["exit_code_on_sigterm"] == 0 else 1
        s["fuzz_serves_after"] = bool(fuzz.get("ready_ok") and fuzz.get("http_infer_ok")
                                      and fuzz.get("socket_infer_ok"))
        s["fuzz_connections_leaked"] = st.get("connections_leaked")
        s["fuzz_fds_leaked"] = st.get("fds_leaked")
        s["fuzz_requests_leaked"] = st.get("requests_leaked")
        s["fuzz_request_memory_leaked_bytes"] = st.get("request_memory_bytes")
        s["fuzz_rss_mib_start_peak_end"] = [round(mem.get(k, float("nan")), 1)
                                            for k in ("rss_mib_start", "rss_mib_peak", "rss_mib_end")]
        s["fuzz_rss_mib_growth"] = round(mem.get("rss_mib_growth", float("nan")), 1)
        s["fuzz_log_errors"] = fuzz["log"]["errors"]
        s["fuzz_log_tracebacks"] = fuzz["log"]["tracebacks"]
        s["fuzz_health_p99_ms"] = fuzz["watch"].get("health_p99_ms")
        checks["fuzz_no_crash"] = s["fuzz_crashes"] == 0 and s["fuzz_serves_after"]
        checks["fuzz_no_5xx_to_mistakes"] = all(f["bad_5xx"] == 0 for f in t.values())
        checks["fuzz_no_leaked_connections"] = st.get("connections_leaked") == 0 and (st.get("fds_leaked") or 0) <= 0
        checks["fuzz_no_leaked_requests"] = st.get("requests_leaked") == 0 and st.get("request_memory_bytes") == 0
        checks["fuzz_rss_bounded"] = bool(mem.get("rss_bounded"))
        checks["fuzz_no_error_lines"] = s["fuzz_log_errors"] == 0 and s["fuzz_log_tracebacks"] == 0
    if over:
        f = over["figures"]
        st, mem = f["settle"], f["memory"]
        s.update({"overload_capacity_rps": f["capacity_rps"], "overload_offered_rps": f["offered_rps"],
                  "overload_seconds": f["seconds"], "overload_statuses": f["statuses"],
                  "overload_health_p99_ms": f["health"].get("p99_ms"),
                  "overload_refusal_p99_ms": f["refusal"]["p99_ms"],
                  "overload_refusal_503_p99_ms": f["refusal_503"]["p99_ms"],
                  "overload_refusal_504_p99_ms": f["refusal_504"]["p99_ms"],
                  "overload_goodput_rps": f["goodput_rps"],
                  "overload_goodput_fraction_of_capacity": f["goodput_fraction_of_capacity"],
                  "overload_recheck_goodput_rps": f["recheck_goodput_rps"],
                  "overload_rss_mib_start_peak_end": [round(mem.get(k, float("nan")), 1)
                                                      for k in ("rss_mib_start", "rss_mib_peak", "rss_mib_end")],
                  "overload_connections_leaked": st.get("connections_leaked"),
                  "overload_requests_leaked": st.get("requests_leaked"),
                  "overload_log_errors": f["log"]["errors"]})
        checks["overload_no_crash"] = bool(f["alive_at_end"]) and f["exit_code_on_sigterm"] == 0 and f["lost"] == 0
        checks["overload_health_p99_under_50ms"] = bool(f["health"].get("p99_ms", np.inf) < HEALTH_P99_MS
                                                        and f["health"].get("failed", 1) == 0
                                                        and f["health"].get("not_200", 1) == 0)
        # Every answer that is not a result is a refusal, whatever its status: the excess must hear "no" at once.
        checks["overload_refusals_within_10ms"] = bool(f["refused"] == 0 or f["refusal"]["p99_ms"] <= REFUSAL_P99_MS)
        checks["overload_goodput_at_least_90pct"] = bool(f["goodput_fraction_of_capacity"] >= GOODPUT_FRACTION)
        checks["overload_rss_bounded"] = bool(mem.get("rss_bounded"))
        checks["overload_no_leaks"] = st.get("requests_leaked") == 0 and st.get("connections_leaked") == 0 \
            and st.get("request_memory_bytes") == 0
        checks["overload_no_error_lines"] = f["log"]["errors"] == 0
    s["checks_failed"] = sorted(k for k, v in checks.items() if not v)
    return s, checks


def _notes(fuzz: dict[str, Any], over: dict[str, Any]) -> list[str]:
    notes = ["A 5xx answer in the fuzz counts as bad_5xx unless it is a 503 with Retry-After (a labelled overload "
             "refusal), a 504 to a request that asked for a deadline, or a 501 that names a feature the daemon does "
             "not offer (NotImplementedByServer, a ClientError in daemon/errors.py). A 504 to a valid request "
             "without a deadline of its own is counted apart (deadline_504_missed): a missed SLO target under the "
             "fuzz's own load, not an answer to a mistake.",
             "Protocol findings (not checks of the issue, each a daemon bug when non-zero; samples with the command "
             "that prints their bytes): unanswered = requests the generator knows were framed intact and came "
             "before anything that may end the connection, left without an answer; doubled = answered twice; "
             "malformed = an answer that could not be read; head_with_body = an answer to HEAD carrying a body; "
             "timeouts = a connection that had not ended after op_timeout_s.",
             "Leaks are read after the daemon goes quiet (up to 30 s): sockets and descriptors in /proc/<pid>/fd "
             "against a count taken before the phase with the probe's connection open; requests pending, queued "
             "and in flight, and request memory held, from GET /v2/controller/stats and GET /metrics.",
             f"RSS bounded: RSS at the end of a phase at most {RSS_GROWTH_MIB:g} MiB above its highest sample in the "
             "phase's first quarter (peak: VmHWM, the kernel's high-water mark, start-up included)."]
    if over:
        f = over["figures"]
        slowed = f"cpu:0 slowed {f['device_slowdown']:g}x by an injected fault" if f["device_slowdown"] > 1 \
            else "cpu:0 at its own speed"
        notes.append(f"Overload: {f['model']} on {slowed}, over the socket, requests "
                     + ("with timeout_us = the SLO (a hard deadline)" if f["client_deadline"]
                        else "without a deadline of their own (the SLO is the deadline)")
                     + f"; capacity at SLO {f['capacity_rps']:.0f} req/s "
                     + ("measured by the ramp in the rows" if f["capacity_measured"] else "given")
                     + f"; {f['factor']:g}x offered for {f['seconds']:g} s. A refusal is any answer that is not a "
                     "result (503, 504, ...): its latency is the client's, from writing the request to reading the "
                     "answer. Goodput: results within the SLO per second by the client's clock, after a warm-up of a "
                     "tenth of the run (goodput_per_s: each second's, by when sent); daemon_slo_met_per_s: the "
                     "daemon's own count (escapement_slo_met, its clock starting when it reads the frame) over the "
                     "whole run. other_cores: the machine's busy CPU (/proc/stat) less the daemon's and the "
                     "generator's: other users' work, which these figures cannot separate from the daemon's.")
    return notes


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(n)}" for k, n in v.items()) or "-"
    if isinstance(v, list):
        return " / ".join(_fmt(x) for x in v)
    return str(v)


def table(result: dict[str, Any]) -> str:
    """The headline figures as a plain table (printed at the end of a run)."""
    s = result["summary"]
    rows: list[tuple[str, str, str]] = []
    fuzz, over = result.get("fuzz") or {}, result.get("overload") or {}
    for fe, t in (fuzz.get("tallies") or {}).items():
        rows.append((f"fuzz {fe}", "inputs", f"{t['inputs']} in {t['seconds']:g} s"))
        rows.append((f"fuzz {fe}", "5xx to mistakes", str(t["bad_5xx"])))
        rows.append((f"fuzz {fe}", "protocol findings", _fmt({k: t[k] for k in FINDINGS if t[k]})))
        rows.append((f"fuzz {fe}", "left held: requests / bytes", f"{t['held_after']['requests_leaked']} / "
                                                                  f"{t['held_after']['request_memory_bytes']}"))
    if fuzz:
        rows += [("fuzz", "crashes", str(s["fuzz_crashes"])),
                 ("fuzz", "leaked connections / fds", f"{s['fuzz_connections_leaked']} / {s['fuzz_fds_leaked']}"),
                 ("fuzz", "leaked requests / bytes", f"{s['fuzz_requests_leaked']} / "
                                                     f"{s['fuzz_request_memory_leaked_bytes']}"),
                 ("fuzz", "RSS MiB start / peak / end", _fmt(s["fuzz_rss_mib_start_peak_end"])),
                 ("fuzz", "RSS growth MiB", _fmt(s["fuzz_rss_mib_growth"])),
                 ("fuzz", "ERROR lines / tracebacks", f"{s['fuzz_log_errors']} / {s['fuzz_log_tracebacks']}"),
                 ("fuzz", "health p99 ms", _fmt(s["fuzz_health_p99_ms"]))]
    if over:
        rows += [("overload", "capacity at SLO req/s", _fmt(over["capacity_rps"])),
                 ("overload", "offered req/s", f"{over['offered_rps']:.0f} ({over['factor']:g}x) for "
                                               f"{over['seconds']:g} s"),
                 ("overload", "answers", _fmt(over["statuses"])),
                 ("overload", "health p99 ms", _fmt(over["health"].get("p99_ms"))),
                 ("overload", "refusal p99 ms (all / 503 / 504)",
                  " / ".join(_fmt(over[k]["p99_ms"]) for k in ("refusal", "refusal_503", "refusal_504"))),
                 ("overload", "goodput req/s / capacity", f"{over['goodput_rps']:.0f} / "
                                                          f"{_fmt(over['goodput_fraction_of_capacity'])}"),
                 ("overload", "goodput at capacity, rechecked after", _fmt(over["recheck_goodput_rps"])),
                 ("overload", "met by the daemon's clock req/s", _fmt(over["daemon_slo_met_per_s"])),
                 ("overload", "RSS MiB start / peak / end", _fmt(s["overload_rss_mib_start_peak_end"])),
                 ("overload", "leaked connections / requests", f"{s['overload_connections_leaked']} / "
                                                               f"{s['overload_requests_leaked']}"),
                 ("overload", "ERROR lines", str(s["overload_log_errors"]))]
    rows += [("check", name, "PASS" if ok else "FAIL") for name, ok in result["checks"].items()]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [f"soak: {result['config']['command']}  ({s.get('wall_s')} s)"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = ["# soak", "",
             f"{m['date']} · commit {m['git_commit']} · {m['cores']} cores ({m['cpu']}) · torch {m['torch']}", "",
             "Command: `" + result["config"]["command"] + "`", "",
             f"Wall time: {result['summary'].get('wall_s')} s", "", "## Checks", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in result["checks"].items()]
    lines += ["", "## Summary", ""] + [f"- **{k}**: {_fmt(v)}" for k, v in result["summary"].items()]
    fuzz = result.get("fuzz") or {}
    if fuzz:
        lines += _fuzz_section(fuzz)
    over = result.get("overload") or {}
    if over:
        lines += ["", "## Overload", ""]
        lines += [f"- **{k}**: {_fmt(v)}" for k, v in over.items() if k not in ("log", "settle", "memory")]
        lines += [f"- **memory**: {_fmt(over['memory'])}", f"- **settle**: {_fmt(over['settle'])}",
                  f"- daemon log during the overload: {over['log']['errors']} ERROR lines; warnings "
                  f"{_fmt(over['log']['warnings_by_message'])}"]
        cols = ["label", "offered_rps", "achieved_rps", "goodput_rps", "slo_attainment", "p50_ms", "p99_ms", "errors",
                "mean_batch_size", "server_cores", "generator_cores", "other_cores", "generator_lag_p99_ms",
                "generator_bound"]
        rows = [r for r in result["rows"] if "offered_rps" in r]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def _fuzz_section(fuzz: dict[str, Any]) -> list[str]:
    fes = list(fuzz["tallies"])
    lines = ["", "## Fuzz", "", "| | " + " | ".join(fes) + " |", "|---|" + "---|" * len(fes)]
    keys = ["inputs", "connections", "seconds", "inputs_per_s", "statuses", "classes", "bad_5xx", *FINDINGS,
            "resets_by_daemon", "finishes"]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_fmt(t[k]) for t in fuzz["tallies"].values()) + " |")
    st, w, mem, log = fuzz["settle"], fuzz["watch"], fuzz["memory"], fuzz["log"]
    lines += ["", f"- alive at the end: {fuzz['alive_at_end']}; ready: {fuzz.get('ready_ok')}; a valid inference "
                  f"afterwards: HTTP {fuzz.get('http_infer_ok')}, socket {fuzz.get('socket_infer_ok')}; exit code "
                  f"on SIGTERM: {fuzz['exit_code_on_sigterm']}",
              f"- held after settling ({st.get('settle_s')} s): gauges {_fmt(st.get('gauges', {}))}; pending "
              f"{st.get('pending')}, queued {st.get('queued')}, in flight {st.get('inflight_actions')}, request "
              f"memory {st.get('request_memory_bytes')} bytes (peak {st.get('request_memory_peak_bytes')})",
              f"- sockets: {st.get('sockets_before')} before, {st.get('sockets')} after (peak {w.get('sockets_peak')});"
              f" descriptors: {st.get('fds_before')} before, {st.get('fds')} after",
              f"- RSS MiB: {_fmt(mem)}",
              f"- GET /v2/health/ready during the fuzz (every 50 ms): p50 {_fmt(w.get('health_p50_ms'))} ms, "
              f"p99 {_fmt(w.get('health_p99_ms'))} ms, max {_fmt(w.get('health_max_ms'))} ms, "
              f"failed {w.get('health_failed')}",
              f"- daemon log: {log['errors']} ERROR lines, {log['tracebacks']} tracebacks, "
              f"{log['other_stderr_lines']} other stderr lines; levels {_fmt(log['levels'])}"]
    lines += _log_section(log, fuzz.get("error_reproductions", []))
    for fe, t in fuzz["tallies"].items():
        if t["findings"]:
            lines += ["", f"### Findings, {fe}", ""]
            for what, samples in t["findings"].items():
                lines.append(f"- **{what}** ({t.get(what, len(samples))}; {len(samples)} kept)")
                for smp in samples[:3]:
                    lines.append(f"  - `{smp['reproduce']}` {smp['kinds']} ({smp['finish']}): {smp['detail'][:200]}")
                    lines.append(f"    input: `{smp['input'][:300]}`")
    return lines


def _log_section(log: dict[str, Any], reproductions: list[dict[str, Any]]) -> list[str]:
    if not log["errors"]:
        return []
    out = ["", "### ERROR lines in the daemon's log", ""]
    out += [f"- {n} x `{sig}`" for sig, n in log["errors_by_message"].items()]
    for r in reproductions:
        by = r["reproduced_by"]
        if by:
            out.append(f"- `{r['signature'][:100]}` reproduced by {by['frontend']} case {by['case']} {by['kinds']}: "
                       f"`{by['command']}`; input `{by['input'][:300]}`")
        else:
            out.append(f"- `{r['signature'][:100]}`: not reproduced by replaying {r['candidates_tried']} candidates")
    for sig, lines in list(log["first_errors"].items())[:3]:
        out += ["", f"First `{sig[:100]}`:", "", "```", *lines[:25], "```"]
    return out
