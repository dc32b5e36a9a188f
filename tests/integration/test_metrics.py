"""/metrics and the statistics extension against a real daemon: counters move exactly as requests do."""

from __future__ import annotations

import http.client
import time

import numpy as np
import orjson
import pytest
import tritonclient.http as th
from prometheus_client.parser import text_string_to_metric_families

from tests.support import DaemonThread

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def get(d: DaemonThread, path: str) -> tuple[int, dict[str, str], bytes]:
    host, port = d.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post_infer(d: DaemonThread, model: str, x: np.ndarray, **params: object) -> int:
    body = orjson.dumps({"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape),
                                     "data": x.ravel().tolist()}], "parameters": params})
    host, port = d.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", body=body)
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def scrape(d: DaemonThread) -> Samples:
    status, headers, body = get(d, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def stats(d: DaemonThread, path: str) -> list[dict[str, object]]:
    status, _, body = get(d, path)
    assert status == 200, body
    return orjson.loads(body)["model_stats"]


def test_counters_and_stats_move_exactly_with_requests(test_daemon: DaemonThread) -> None:
    m = {"model": "tiny_pt2", "version": "1"}
    before, (st0,) = scrape(test_daemon), stats(test_daemon, "/v2/models/tiny_pt2/versions/1/stats")
    t0 = time.time()
    x = np.ones((2, 4), np.float32)
    # One at a time: each request is its own execution of 2 samples.
    assert [post_infer(test_daemon, "tiny_pt2", x) for _ in range(3)] == [200, 200, 200]
    # A malformed request never reaches the model: not a failure of it (as in Triton).
    assert post_infer(test_daemon, "tiny_pt2", np.ones((2, 5), np.float32)) == 400
    # A deadline no device can meet is refused by the controller: a failure, for its deadline.
    assert post_infer(test_daemon, "tiny_pt2", x, timeout=1) == 504
    t1 = time.time()
    assert test_daemon.wait_idle() == 0
    after, (st1,) = scrape(test_daemon), stats(test_daemon, "/v2/models/tiny_pt2/versions/1/stats")

    def delta(name: str, **extra: str) -> float:
        return value(after, name, **m, **extra) - value(before, name, **m, **extra)

    assert delta("nv_inference_request_success") == 3
    assert delta("nv_inference_request_failure", reason="DEADLINE") == 1
    for reason in ("REJECTED", "CANCELED", "BACKEND", "UNAVAILABLE", "OTHER"):
        assert delta("nv_inference_request_failure", reason=reason) == 0
    assert delta("nv_inference_count") == 6
    assert delta("nv_inference_exec_count") == 3
    assert delta("escapement_slo_met_total") == 3 and delta("escapement_slo_missed_total") == 1
    assert delta("escapement_request_duration_seconds_count") == 3
    assert delta("escapement_queue_duration_seconds_count") == 3
    assert delta("escapement_compute_duration_seconds_count") == 3
    assert delta("escapement_batch_size_bucket", le="1.0") == 0
    assert delta("escapement_batch_size_bucket", le="2.0") == 3
    assert delta("escapement_batch_size_sum") == 6
    assert delta("nv_inference_request_duration_us") > 0 and delta("nv_inference_compute_input_duration_us") == 0
    assert value(after, "nv_inference_pending_request_count", **m) == 0
    assert value(after, "escapement_model_resident", **m, device="cpu:0") == 1
    assert value(after, "escapement_model_loads_total", **m, device="cpu:0") >= 1
    budget = test_daemon.daemon.devices[0].weight_budget
    assert value(after, "escapement_device_weight_budget_bytes", device="cpu:0") == budget
    assert value(after, "escapement_device_weight_used_bytes", device="cpu:0") > 0
    assert value(after, "escapement_pending_requests") == 0

    # The statistics extension counts the same events.
    assert st1["inference_count"] - st0["inference_count"] == 6
    assert st1["execution_count"] - st0["execution_count"] == 3
    i0, i1 = st0["inference_stats"], st1["inference_stats"]
    for key, n in (("success", 3), ("fail", 1), ("queue", 3), ("compute_input", 3), ("compute_infer", 3),
                   ("compute_output", 3), ("cache_hit", 0)):
        assert i1[key]["count"] - i0[key]["count"] == n, key
    assert i1["compute_infer"]["ns"] > i0["compute_infer"]["ns"] and i1["compute_input"]["ns"] == 0
    # Prometheus and the JSON read the same totals.
    assert value(after, "nv_inference_request_duration_us", **m) == pytest.approx(i1["success"]["ns"] / 1e3, abs=1)
    batches = {b["batch_size"]: b for b in st1["batch_stats"]}
    assert batches[2]["compute_infer"]["count"] - {b["batch_size"]: b for b in st0["batch_stats"]}.get(
        2, {"compute_infer": {"count": 0}})["compute_infer"]["count"] == 3
    assert sum(b["compute_infer"]["count"] for b in st1["batch_stats"]) == st1["execution_count"]
    assert t0 * 1000 - 1 <= st1["last_inference"] <= t1 * 1000 + 1
    assert st1["memory_usage"] == [{"type": "CPU", "id": 0, "byte_size": st1["memory_usage"][0]["byte_size"]}]


def test_stats_endpoints_cover_ready_versions_and_refuse_unknown(test_daemon: DaemonThread) -> None:
    everything = {(s["name"], s["version"]) for s in stats(test_daemon, "/v2/models/stats")}
    assert everything == {("tiny_pt2", "1"), ("tiny_ts", "1"), ("tiny_ts", "2"), ("all_types", "1")}
    assert [s["version"] for s in stats(test_daemon, "/v2/models/tiny_ts/stats")] == ["1", "2"]
    assert [s["version"] for s in stats(test_daemon, "/v2/models/tiny_ts/versions/2/stats")] == ["2"]
    for path, status in (("/v2/models/nope/stats", 404), ("/v2/models/tiny_ts/versions/7/stats", 404),
                         ("/v2/models/garbage/stats", 503), ("/v2/models/bad_toml/stats", 503)):
        code, headers, body = get(test_daemon, path)
        assert code == status and headers["content-type"].startswith("application/json")
        assert orjson.loads(body)["error"]
    # the unmodified tritonclient reads it
    c = th.InferenceServerClient(test_daemon.http)
    try:
        (s,) = c.get_inference_statistics("tiny_ts", "2")["model_stats"]
        assert s["name"] == "tiny_ts" and s["version"] == "2"
        assert len(c.get_inference_statistics()["model_stats"]) == 4
    finally:
        c.close()
