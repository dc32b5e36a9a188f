"""`rayserve`: the Ray Serve application (daemon/rayserve.py) on a local multi-node Ray cluster.

`ray.cluster_utils.Cluster` with 3 nodes on this machine (1 CPU each, 200 MB object stores, every
address 127.0.0.1), the demo repository, and, in order:

1. scale from one replica to two (a redeploy with num_replicas=2; both must answer);
2. affinity: requests over the demo models through Serve's proxy, each answer naming its replica;
   `affinity_hit_rate` = the share of each model's requests served by the replica that serves it most;
3. conformance: the same KServe v2 checks against Serve's proxy and a daemon of its own, whose
   statuses and answers must agree;
4. latency: one request at a time, through Serve vs the daemon's socket and HTTP directly;
5. a replica killed (SIGKILL) while requests are in flight: each request is answered or fails
   with a status and a message; one that got neither within 30 s counts as hung.

Every wait is bounded; the cluster is shut down in `finally`. Needs `ray[serve]` (the `ray` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench import results
from bench.scenarios.common import command, demo_repo
from daemon.client import SocketClient

CLIENT_TIMEOUT_S = 30.0
_ERRORS: dict[str, int] = {}  # the last load's failures by message
DIGIT = [0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0, 0, 8, 8, 0,
         0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0, 0, 6, 13, 10, 0, 0, 0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _infer_body(meta: dict[str, Any], timeout_us: int | None = None, priority: int | None = None) -> bytes:
    """A JSON infer body for any demo model: zeros of its input shape, batch 1 (digits: a real digit)."""
    inputs = []
    for t in meta["inputs"]:
        shape = [1 if d == -1 else d for d in t["shape"]]
        n = int(np.prod(shape))
        data = DIGIT if n == 64 else [0] * n
        inputs.append({"name": t["name"], "datatype": t["datatype"], "shape": shape, "data": data})
    params: dict[str, Any] = {}
    if timeout_us is not None:
        params["timeout"] = timeout_us
    if priority is not None:
        params["priority"] = priority
    return orjson.dumps({"inputs": inputs, **({"parameters": params} if params else {})})


async def _request(session: Any, base: str, method: str, path: str,
                   body: bytes | None = None) -> tuple[int, bytes, dict[str, str], float]:
    """(status, body, headers, seconds); status 0 = no answer within CLIENT_TIMEOUT_S (hung), -1 = connection."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.request(method, base + path, data=body,
                                   timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as r:
            data = await r.read()
            return r.status, data, dict(r.headers), time.perf_counter() - t0
    except TimeoutError:
        return 0, b"", {}, time.perf_counter() - t0
    except aiohttp.ClientError as e:
        return -1, str(e).encode(), {}, time.perf_counter() - t0


async def _conformance(base: str, direct: str, metas: dict[str, Any]) -> dict[str, Any]:
    """The same v2 checks through Serve and against a plain daemon; statuses and answers must agree."""
    import aiohttp

    name = "digits_mlp"
    checks: list[tuple[str, str, str, bytes | None]] = [
        ("live", "GET", "/v2/health/live", None),
        ("ready", "GET", "/v2/health/ready", None),
        ("model_ready", "GET", f"/v2/models/{name}/ready", None),
        ("unknown_model_ready", "GET", "/v2/models/nope/ready", None),
        ("infer_json", "POST", f"/v2/models/{name}/infer", _infer_body(metas[name])),
        ("infer_priority", "POST", f"/v2/models/{name}/infer", _infer_body(metas[name], priority=1)),
        ("infer_deadline_passed", "POST", f"/v2/models/{name}/infer", _infer_body(metas[name], timeout_us=1)),
        ("infer_unknown_model", "POST", "/v2/models/nope/infer", _infer_body(metas[name])),
        ("infer_bad_input", "POST", f"/v2/models/{name}/infer",
         orjson.dumps({"inputs": [{"name": "WRONG", "datatype": "FP32", "shape": [1, 64], "data": DIGIT}]})),
        ("infer_bad_json", "POST", f"/v2/models/{name}/infer", b"{not json"),
        ("infer_binary_output", "POST", f"/v2/models/{name}/infer", orjson.dumps(
            {**orjson.loads(_infer_body(metas[name])), "outputs": [{"name": "OUTPUT__0",
                                                                    "parameters": {"binary_data": True}}]})),
    ]
    checks += [(f"metadata_{m}", "GET", f"/v2/models/{m}", None) for m in metas]
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s:
        for label, method, path, body in checks:
            a = await _request(s, base, method, path, body)
            b = await _request(s, direct, method, path, body)
            same = a[0] == b[0]
            if same and a[0] == 200 and label.startswith(("metadata", "infer_json", "infer_priority")):
                same = orjson.loads(a[1]) == orjson.loads(b[1])
            if same and label == "infer_binary_output":
                same = a[1] == b[1] or a[2].get("Inference-Header-Content-Length") is not None
            out[label] = {"serve": a[0], "direct": b[0], "agree": same,
                          **({} if same else {"serve_body": a[1][:300].decode(errors="replace"),
                                              "direct_body": b[1][:300].decode(errors="replace")})}
    return out


async def _spread(base: str, metas: dict[str, Any], n: int, concurrency: int,
                  at: tuple[int, Any] | None = None) -> tuple[dict[str, dict[str, int]], dict[int, int], list[float]]:
    """n requests over the models, round robin; per model, how many each replica answered. `at`:
    (k, f): f() runs once k requests have been answered (the kill lands with requests in flight)."""
    import aiohttp

    names = sorted(metas)
    by_model: dict[str, dict[str, int]] = {m: {} for m in names}
    statuses: dict[int, int] = {}
    lat: list[float] = []
    errors: dict[str, int] = {}  # what a failed request was told, first 200 characters
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> None:
            m = names[i % len(names)]
            async with sem:
                st, data, h, dt = await _request(s, base, "POST", f"/v2/models/{m}/infer", _infer_body(metas[m]))
            statuses[st] = statuses.get(st, 0) + 1
            if at is not None and sum(statuses.values()) == at[0]:
                at[1]()
            if st != 200:
                msg = f"{st}: {data[:200].decode(errors='replace')}"
                errors[msg] = errors.get(msg, 0) + 1
            if st == 200:
                r = h.get("escapement-replica", "?")
                by_model[m][r] = by_model[m].get(r, 0) + 1
                lat.append(dt)
        await asyncio.gather(*(one(i) for i in range(n)))
    _ERRORS.clear()
    _ERRORS.update(errors)
    return by_model, statuses, lat


def _affinity(by_model: dict[str, dict[str, int]]) -> float:
    total = sum(sum(c.values()) for c in by_model.values())
    return sum(max(c.values(), default=0) for c in by_model.values()) / total if total else float("nan")


async def _sequential(base: str, body: bytes, path: str, n: int) -> list[float]:
    import aiohttp

    lat = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            st, _, _, dt = await _request(s, base, "POST", path, body)
            if st == 200:
                lat.append(dt)
    return lat


def _pcts(lat: list[float]) -> tuple[float, float]:
    a = np.array(lat) * 1e3
    return (float(np.percentile(a, 50)), float(np.percentile(a, 99))) if len(a) else (float("nan"), float("nan"))


def _wait(cond: Any, limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not within {limit_s:g} s")


def _running_replicas() -> int:
    from ray import serve

    app = serve.status().applications["escapement"]
    dep = app.deployments["EscapementReplica"]
    return int(dep.replica_states.get("RUNNING", 0)) if dep.status == "HEALTHY" else -1


def _replica_infos(n_calls: int = 16) -> dict[str, dict[str, Any]]:
    from ray import serve

    h = serve.get_deployment_handle("EscapementReplica", "escapement")
    infos = [h.info.remote().result(timeout_s=30) for _ in range(n_calls)]
    return {i["replica"]: i for i in infos}


def _forecasts(n_calls: int = 8) -> dict[str, int]:
    """What each replica reports to the routers (record_routing_stats): models in its forecast."""
    from ray import serve

    from daemon.routing import NodeForecast

    h = serve.get_deployment_handle("EscapementReplica", "escapement")
    out: dict[str, int] = {}
    for _ in range(n_calls):
        stats = h.record_routing_stats.remote().result(timeout_s=30)
        parsed = NodeForecast.parse(stats)
        out[str(stats.get("replica"))] = -1 if parsed is None else len(parsed.models)
    return out


def _ready(base: str) -> bool:
    import urllib.request

    with urllib.request.urlopen(base + "/v2/health/ready", timeout=5) as r:
        return bool(r.status == 200)


def run(quick: bool = False, json_out: str | None = None, nodes: int = 3, requests: int | None = None,
        kill_requests: int | None = None, latency_n: int | None = None, concurrency: int = 4,
        router: str = "deadline") -> dict[str, Any]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray resolves 127.0.0.1 to the host's address for a "cluster"; this keeps every address on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    ray_constants.ENABLE_RAY_CLUSTER = False  # the same, where ray was imported before the variable was set

    from daemon.rayserve import build

    requests = requests or (60 if quick else 300)
    kill_requests = kill_requests or (200 if quick else 600)
    latency_n = latency_n or (100 if quick else 400)
    repo = str(demo_repo())
    metas = {}
    tmp = tempfile.mkdtemp(prefix="escapement-bench-ray-")
    port, direct_port = _free_port(), _free_port()
    base, direct = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{direct_port}"
    sock = os.path.join(tmp, "direct.sock")
    with open(Path(tmp) / "direct.log", "wb") as log:  # the child keeps its own descriptor
        direct_proc = subprocess.Popen([sys.executable, "-m", "daemon", "serve", "--models", repo, "--http",
                                        f"127.0.0.1:{direct_port}", "--grpc", "", "--socket", sock],
                                       stdout=subprocess.DEVNULL, stderr=log)
    node_args = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "object_store_memory": 200 * 2**20}
    cluster = None
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    notes: list[str] = []
    t_start = time.monotonic()
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="ERROR")
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _wait(lambda: _ready(direct), 120, "the direct daemon")
        with SocketClient(sock) as c:
            metas = {m["name"]: c.metadata(m["name"]) for m in c.index()}

        # 1. one replica, then two
        t0 = time.monotonic()
        serve.run(build(repo, num_replicas=1, router=router), name="escapement", route_prefix="/")
        _wait(lambda: _ready(base), 240, "one replica")
        startup_s = time.monotonic() - t0
        by1, st1, _ = asyncio.run(_spread(base, metas, 2 * len(metas), concurrency))
        one_replica = {r for c in by1.values() for r in c}
        t0 = time.monotonic()
        serve.run(build(repo, num_replicas=2, router=router), name="escapement", route_prefix="/")
        _wait(lambda: _running_replicas() == 2, 240, "two replicas")
        scale_s = time.monotonic() - t0
        infos = _replica_infos()
        nodes_used = len({i["node_id"] for i in infos.values()})

        # 2. affinity and spread over the two
        by2, st2, _ = asyncio.run(_spread(base, metas, requests, concurrency))
        two_replicas = {r for c in by2.values() for r in c}
        reports = _forecasts()
        scale_ok = len(one_replica) == 1 and len(two_replicas) == 2 and set(st1) == {200} and set(st2) == {200}
        rows.append({"label": "one replica", "requests": sum(st1.values()), "statuses": st1,
                     "replicas_answering": len(one_replica)})
        rows.append({"label": "two replicas, spread", "requests": sum(st2.values()), "statuses": st2,
                     "replicas_answering": len(two_replicas), "by_model": by2,
                     "affinity_hit_rate": _affinity(by2)})

        # 3. conformance through Serve vs a daemon of its own
        conf = asyncio.run(_conformance(base, direct, metas))
        rows.append({"label": "conformance", **{k: v["agree"] for k, v in conf.items()}})

        # 4. latency, one at a time
        body, path = _infer_body(metas["digits_mlp"]), "/v2/models/digits_mlp/infer"
        lat_serve = asyncio.run(_sequential(base, body, path, latency_n))
        lat_http = asyncio.run(_sequential(direct, body, path, latency_n))
        x = {"INPUT__0": np.array([DIGIT], np.float32)}
        lat_sock = []
        with SocketClient(sock) as c:
            for _ in range(latency_n):
                t = time.perf_counter()
                c.infer("digits_mlp", x)
                lat_sock.append(time.perf_counter() - t)
        for label, lat in (("serve http json", lat_serve), ("direct http json", lat_http),
                           ("direct socket", lat_sock)):
            p50, p99 = _pcts(lat)
            rows.append({"label": f"latency, {label}", "requests": len(lat), "p50_ms": p50, "p99_ms": p99})

        # 5. a replica killed mid-load
        victim = max(infos, key=lambda r: sum(c.get(r, 0) for c in by2.values()))
        info = infos[victim]

        t0 = time.monotonic()
        _, stk, _ = asyncio.run(_spread(base, metas, kill_requests, 8,
                                        (kill_requests // 4, lambda: os.kill(info["pid"], signal.SIGKILL))))
        kill_s = time.monotonic() - t0
        kill_errors = dict(_ERRORS)
        time.sleep(2.0)
        daemon_orphaned = _alive(info["daemon_pid"])
        _wait(lambda: _running_replicas() == 2, 240, "the replacement replica")
        recovered_s = time.monotonic() - t0
        replaced = victim not in _replica_infos() and not _alive(info["pid"])
        _, str_, _ = asyncio.run(_spread(base, metas, 4 * len(metas), concurrency))
        hung = stk.get(0, 0)
        failed = sum(v for k, v in stk.items() if k not in (0, 200))
        rows.append({"label": "replica killed mid-load", "requests": sum(stk.values()), "statuses": stk,
                     "seconds": kill_s, "recovered_s": recovered_s, "after_recovery": str_})

        p50, p99 = _pcts(lat_serve)
        d50, d99 = _pcts(lat_sock)
        h50, h99 = _pcts(lat_http)
        summary = {
            "router": router, "nodes": len(ray.nodes()), "replica_nodes_used": nodes_used,
            "startup_s": round(startup_s, 1), "scale_1_to_2_s": round(scale_s, 1),
            "scale_1_to_2_ok": scale_ok,
            "models_spread_ok": len(two_replicas) == 2 and all(len(c) >= 1 for c in by2.values()),
            "affinity_hit_rate": round(_affinity(by2), 4),
            "forecast_models_by_replica": reports,
            "forecasts_ok": bool(reports) and all(n >= 0 for n in reports.values()),
            "conformance_ok": all(v["agree"] for v in conf.values()),
            "conformance_checks": len(conf),
            "conformance_disagree": {k: v for k, v in conf.items() if not v["agree"]},
            "killed_replica_requests": sum(stk.values()),
            "killed_replica_answered": stk.get(200, 0),
            "killed_replica_failed_cleanly": failed,
            "killed_replica_failed_statuses": {k: v for k, v in stk.items() if k not in (0, 200)},
            "killed_replica_errors": kill_errors,
            "killed_replica_hung": hung,
            "killed_replica": victim,
            "killed_replica_replaced": replaced,
            "killed_replica_daemon_orphaned": daemon_orphaned,
            "recovered_after_kill_ok": set(str_) == {200}, "recovery_s": round(recovered_s, 1),
            "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
            "direct_socket_p50_ms": round(d50, 2), "direct_socket_p99_ms": round(d99, 2),
            "direct_http_p50_ms": round(h50, 2), "direct_http_p99_ms": round(h99, 2),
            "serve_over_socket_p50_ms": round(p50 - d50, 2),
            "wall_s": round(time.monotonic() - t_start, 1),
        }
        notes = [f"{nodes} Ray nodes on this machine (1 CPU each), 2 replicas of num_cpus=1; demo repository "
                 f"({len(metas)} models); batch-1 JSON requests; client timeout {CLIENT_TIMEOUT_S:g} s (0 = hung).",
                 "Latency: one request at a time, digits_mlp; Serve = HTTP JSON through Serve's proxy, the ingress "
                 "deployment and the replica; direct = the same daemon build, its own listeners.",
                 "Kill: SIGKILL of the replica process answering most requests once a quarter of the load is answered "
                 "(8 in flight).",
                 "Routing: " + ("the deadline-aware DeadlineRouter (daemon/routing.py), fed each daemon's forecast "
                                "every 0.5 s" if router == "deadline" else "Serve's multiplexed affinity") + "."]
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        with contextlib.suppress(Exception):
            ray.shutdown()
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.shutdown()
        direct_proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            direct_proc.wait(15)
        if direct_proc.poll() is None:
            direct_proc.kill()
    config = {"command": command("rayserve", quick), "nodes": nodes, "requests": requests,
              "kill_requests": kill_requests, "latency_n": latency_n, "concurrency": concurrency, "router": router}
    return results.write("rayserve", config, rows, summary, json_out, notes=notes,
                         columns=["label", "requests", "statuses", "replicas_answering", "affinity_hit_rate",
                                  "p50_ms", "p99_ms"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
