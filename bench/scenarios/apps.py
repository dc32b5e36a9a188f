"""`apps`: Clipper's and Velox's parts of escapement: the prediction cache and personalized models.

Two copies of one MLP (784 -> 2048 -> 2048 -> 10, built here; ~2 ms a sample on one CPU thread)
in one daemon: `mlp_cached` opts in to the prediction cache (`[response_cache] enabled = true`),
`mlp_plain` does not. Measured in the same run:

- `cache_hit_p50_ms`: one client sends the same batch-1 request over and over on the unix socket
  (every one after the first is a hit), request by request; beside it the wire's own cost, the
  same client's `live` op (a round trip that touches no model), and the miss latency (a fresh
  input each time). The same three over HTTP binary (`http_*`).
- throughput with a 50% hit workload vs no cache: `clients` closed-loop socket clients; every
  other request repeats one of 64 hot inputs (warmed first: hits), the others are fresh inputs
  (misses, run by the model); the same stream against `mlp_plain`, where all of them run.

Then, in the same daemon, Velox's personalized models (bench/scenarios/personal.py, on the demo's
`digits_personal`): `accuracy_by_feedback`, `update_p50_ms` / `update_p99_ms`, `feedback_per_s`
and `survives_kill` (the daemon is killed with SIGKILL and started again on its database).

Last, in daemons of their own, Clipper's applications (bench/scenarios/apps_select.py): exp3 and
exp4 over the demo's three digits classifiers on a stream where the best one degrades midway,
against the best single model in hindsight (`exp3_regret`, `exp4_regret`, accuracies); and an
ensemble under a tight SLO with one member slowed by fault injection (`straggler_*`).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import orjson
import torch
import uvloop
from torch import nn

from bench import results
from bench.scenarios import apps_select, personal
from bench.scenarios.common import command
from bench.servers import Escapement
from daemon.demo import save_model

CACHED, PLAIN = "mlp_cached", "mlp_plain"
FEATURES = 784
HOT = 64  # distinct inputs that repeat in the 50% hit workload


def _build_repo(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10)).eval()
    config = ('max_batch_size = 16\nslo_ms = 200.0\n[[inputs]]\nname = "INPUT__0"\ndatatype = "FP32"\n'
              f'shape = [-1, {FEATURES}]\n[[outputs]]\nname = "OUTPUT__0"\ndatatype = "FP32"\nshape = [-1, 10]\n')
    for name, extra in ((CACHED, "[response_cache]\nenabled = true\n"), (PLAIN, "")):
        save_model(model, "ts", torch.zeros(2, FEATURES), 16, root / name / "1" / "model.ts")
        (root / name / "config.toml").write_text(config + extra, encoding="utf-8")
    return root


def _frame(msg: dict[str, Any]) -> bytes:
    payload = msgpack.packb(msg, use_bin_type=True)
    return len(payload).to_bytes(4, "big") + payload


def _infer_frame(model: str, x: np.ndarray, rid: int) -> bytes:
    return _frame({"id": rid, "op": "infer", "model": model,
                   "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape), "data": x.tobytes()}]})


class _Inputs:
    """Batch-1 inputs: `fresh()` never seen before (a counter in the first element), `hot(i)` repeats."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.base = rng.standard_normal((1, FEATURES)).astype(np.float32)
        self.hots = [rng.standard_normal((1, FEATURES)).astype(np.float32) for _ in range(HOT)]
        self.n = 0

    def fresh(self) -> np.ndarray:
        self.n += 1
        x = self.base.copy()
        x[0, 0] = self.n
        return x

    def hot(self, i: int) -> np.ndarray:
        return self.hots[i % HOT]


async def _socket_call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, frame: bytes,
                       shed_ok: bool = False) -> dict[str, Any]:
    writer.write(frame)
    n = int.from_bytes(await reader.readexactly(4), "big")
    answer: dict[str, Any] = msgpack.unpackb(await reader.readexactly(n), raw=False)
    if answer.get("status") != 200 and not (shed_ok and answer.get("status") == 503):
        raise RuntimeError(f"the daemon answered {answer}")
    return answer


async def _socket_latencies(path: str, frames: Any, count: int, expect_cached: bool | None) -> list[float]:
    """Milliseconds of `count` requests one after another (`frames(i)` builds the i-th)."""
    reader, writer = await asyncio.open_unix_connection(path)
    out: list[float] = []
    try:
        for i in range(count):
            frame = frames(i)
            t0 = time.perf_counter()
            answer = await _socket_call(reader, writer, frame)
            out.append((time.perf_counter() - t0) * 1e3)
            if expect_cached is not None and bool(answer.get("cached")) != expect_cached:
                raise RuntimeError(f"expected cached={expect_cached}: {answer.get('cached')}")
    finally:
        writer.close()
    return out


def _http_request(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode() + b"\r\n" + body


def _http_infer(model: str, x: np.ndarray) -> bytes:
    header = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                       "parameters": {"binary_data_size": x.nbytes}}],
                           "parameters": {"binary_data_output": True}})
    return _http_request(f"/v2/models/{model}/infer", header + x.tobytes(),
                         {"Inference-Header-Content-Length": str(len(header))})


async def _http_latencies(port: int, requests: Any, count: int, expect_cached: bool | None) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out: list[float] = []
    try:
        for i in range(count):
            request = requests(i)
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            body = await reader.readexactly(length)
            out.append((time.perf_counter() - t0) * 1e3)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"the daemon answered {head[:40]!r} {body[:200]!r}")
            if expect_cached is not None and (b'"cached":true' in body) != expect_cached:
                raise RuntimeError(f"expected cached={expect_cached}: {body[:200]!r}")
    finally:
        writer.close()
    return out


async def _throughput(path: str, model: str, clients: int, seconds: float, inputs: _Inputs) -> dict[str, float]:
    """Closed loop: every other request one of the hot inputs, the others fresh ones."""
    done = [0, 0, 0]  # answered, of them cached, shed (503: the loop fell behind, e.g. a busy machine)
    lat: list[float] = []
    stop = time.monotonic() + seconds

    async def client(k: int) -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        i = 0
        try:
            while time.monotonic() < stop:
                i += 1
                x = inputs.hot(k * 7919 + i) if i % 2 else inputs.fresh()
                t0 = time.perf_counter()
                answer = await _socket_call(reader, writer, _infer_frame(model, x, i), shed_ok=True)
                if answer["status"] == 503:
                    done[2] += 1
                    continue
                lat.append((time.perf_counter() - t0) * 1e3)
                done[0] += 1
                done[1] += bool(answer.get("cached"))
        finally:
            writer.close()

    t0 = time.monotonic()
    await asyncio.gather(*(client(k) for k in range(clients)))
    wall = time.monotonic() - t0
    lat.sort()
    return {"requests_per_s": done[0] / wall, "hit_ratio": done[1] / max(done[0], 1), "shed": done[2],
            "p50_ms": lat[len(lat) // 2], "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def _latency_rows(server: Escapement, n: int, rep: int) -> list[dict[str, Any]]:
    inputs = _Inputs(seed=1000 + rep)
    same = inputs.hot(0)
    live = _frame({"id": 0, "op": "live"})
    live_http = b"GET /v2/health/live HTTP/1.1\r\nHost: bench\r\n\r\n"

    async def go() -> list[dict[str, Any]]:
        sock, port = server.socket, server.port
        await _socket_latencies(sock, lambda i: _infer_frame(CACHED, same, i), 1, False)  # store it
        await _socket_latencies(sock, lambda i: _infer_frame(CACHED, same, i), 50, True)  # warm the path
        rows = []
        for label, m in (
            ("socket wire (live op)", await _socket_latencies(sock, lambda i: live, n, None)),
            ("socket hit", await _socket_latencies(sock, lambda i: _infer_frame(CACHED, same, i), n, True)),
            ("socket miss", await _socket_latencies(sock, lambda i: _infer_frame(CACHED, inputs.fresh(), i),
                                                     max(n // 10, 50), False)),
            ("http wire (live)", await _http_latencies(port, lambda i: live_http, n, None)),
            ("http hit", await _http_latencies(port, lambda i: _http_infer(CACHED, same), n, True)),
            ("http miss", await _http_latencies(port, lambda i: _http_infer(CACHED, inputs.fresh()),
                                                max(n // 10, 50), False)),
        ):
            m.sort()
            rows.append({"label": label, "rep": rep, "requests": len(m), "p50_ms": _p50(m),
                         "p99_ms": m[min(len(m) - 1, int(len(m) * 0.99))]})
        return rows

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(go())


def _throughput_rows(server: Escapement, clients: int, seconds: float, rep: int) -> list[dict[str, Any]]:
    async def go() -> list[dict[str, Any]]:
        rows = []
        for model, label in ((PLAIN, "no cache"), (CACHED, "cache")):  # the same stream of inputs for both
            inputs = _Inputs(seed=2000 + rep)
            await _throughput(server.socket, model, clients, min(1.0, seconds / 3), inputs)  # warm: the hot set
            m = await _throughput(server.socket, model, clients, seconds, inputs)
            rows.append({"label": f"50% repeats, {label}", "rep": rep, **m})
        return rows

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(go())


def run(quick: bool = False, json_out: str | None = None, reps: int | None = None, clients: int = 8,
        seconds: float | None = None, requests: int | None = None) -> dict[str, Any]:
    reps = reps or (1 if quick else 3)
    seconds = seconds or (3.0 if quick else 8.0)
    n = requests or (1000 if quick else 5000)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apps-") as tmp:
        repo = personal.build_repo(_build_repo(Path(tmp) / "repo"))
        # frontend workers off: one process, so the figures are the cache's, not the link's
        with Escapement(repo, server={"frontend_workers": 0},
                        personalization={"db_path": str(Path(tmp) / "users.sqlite3")}) as server:
            for rep in range(reps):
                rows += _latency_rows(server, n, rep)
                rows += _throughput_rows(server, clients, seconds, rep)
            # last: it kills the daemon (kill -9) and starts it again
            personal_rows, personal_summary = personal.run_all(server, repo, quick, clients)
            rows += personal_rows
    app_rows, app_summary = apps_select.run_all(quick)  # daemons of their own (two devices, faults)
    rows += app_rows

    def med(label: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["label"] == label)

    hit, wire = med("socket hit", "p50_ms"), med("socket wire (live op)", "p50_ms")
    with_cache, without = med("50% repeats, cache", "requests_per_s"), med("50% repeats, no cache", "requests_per_s")
    summary: dict[str, Any] = {
        "cache_hit_p50_ms": hit,
        "cache_hit_p99_ms": med("socket hit", "p99_ms"),
        "wire_p50_ms": wire,
        # per rep (the same connection's minutes), then the median
        "cache_hit_over_wire_ms": statistics.median(
            h["p50_ms"] - w["p50_ms"] for h in rows if h["label"] == "socket hit"
            for w in rows if w["label"] == "socket wire (live op)" and w["rep"] == h["rep"]),
        "cache_miss_p50_ms": med("socket miss", "p50_ms"),
        "http_cache_hit_p50_ms": med("http hit", "p50_ms"),
        "http_wire_p50_ms": med("http wire (live)", "p50_ms"),
        "http_cache_miss_p50_ms": med("http miss", "p50_ms"),
        "throughput_50pct_hits_rps": with_cache,
        "throughput_no_cache_rps": without,
        "throughput_ratio": with_cache / without,
        "hit_ratio_50pct_workload": med("50% repeats, cache", "hit_ratio"),
        "p99_ms_50pct_hits": med("50% repeats, cache", "p99_ms"),
        "p99_ms_no_cache": med("50% repeats, no cache", "p99_ms"),
        **personal_summary,
        **app_summary,
    }
    notes = [f"command: {command('apps', quick)}",
             f"MLP 784-2048-2048-10 (TorchScript, cpu:0), batch 1; latencies: one client, {n} requests "
             f"one after another; throughput: {clients} closed-loop socket clients, {seconds:g} s after a warm-up; "
             f"{reps} rep(s), medians. The generator shares the machine's cores with the daemon.",
             "wire: the socket's `live` op / HTTP GET /v2/health/live on the same connection (no model).",
             "personalization (digits_personal, cpu:0, SQLite WAL synchronous=NORMAL on the local disk): "
             "accuracy_by_feedback = mean held-out accuracy of permuted-label users through the daemon after "
             "0 (global head) / 10 / 50 / 200 feedback items; update_p50/p99_ms = the feedback round trip over "
             "the socket, one at a time (RLS + commit + ack); update_alone = the RLS step the daemon timed; "
             "update_durable = the step plus its commit; feedback_per_s: closed-loop clients, one user each; "
             "survives_kill: 50 acknowledged items, kill -9, restart, held-out predictions byte-identical.",
             "applications (digits_mlp, digits_cnn64, digits_linear; docs/applications.md): selection: a stream of "
             "held-out digits, each query to the exp3 app, the exp4 app and each model alone, its label fed back; "
             "at the midpoint digits_mlp version 2 (untrained weights) is loaded through the repository API; "
             "regret = correct answers of the best single model in hindsight minus the policy's. Stragglers: "
             "cpu:0 and cpu:1, members preloaded, the device holding one member alone slowed by add_ms; the exp4 "
             "app (slo_ms 20) answered at its SLO (members the controller expects late skipped), the same app with "
             "skip_late = false (every member run, the answer at the deadline: Clipper), and the same queries "
             "with a 1 s timeout (waiting for all); one client, queries one after another."]
    config = {"command": command("apps", quick), "reps": reps, "clients": clients, "seconds": seconds,
              "requests": n}
    return results.write("apps", config, rows, summary, json_out, notes=notes,
                         columns=["label", "rep", "requests", "p50_ms", "p99_ms", "requests_per_s", "hit_ratio", "shed",
                                  "after_0", "after_10", "after_50", "after_200", "feedback_per_s",
                                  "survives_kill", "acc_first_half", "acc_second_half", "acc_last_quarter",
                                  "accuracy", "regret", "on_time", "partial", "default", "members_mean",
                                  "slow_member_skipped", "slow_member_late"])
