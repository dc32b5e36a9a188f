"""A tiny run of the benchmark harness: the result format is complete and its figures make sense.

This is a smoke test of the harness, not a benchmark: the figures are not checked for speed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bench import loadgen, results
from bench.scenarios.common import measure, spec_of
from bench.servers import Escapement

ROW_FIELDS = {"label", "offered_rps", "achieved_rps", "goodput_rps", "slo_ms", "slo_attainment", "p50_ms", "p90_ms",
              "p99_ms", "p999_ms", "max_ms", "errors", "reconstructed"}


def test_schedules() -> None:
    p = loadgen.poisson(200, 5, seed=1)
    assert 800 < len(p) < 1200 and np.all(np.diff(p.times) >= 0) and p.duration < 5
    c = loadgen.constant(100, 2)
    assert len(c) == 200 and c.times[1] == pytest.approx(0.01)
    g = loadgen.gamma(200, 10, cv=4, seed=1)
    gaps = np.diff(g.times)
    assert gaps.std() / gaps.mean() > 2  # burstier than Poisson (cv 1)
    o = loadgen.on_off(100, 4, period=1.0, duty=0.25)
    assert np.all(o.times % 1.0 < 0.25)
    z = loadgen.poisson(500, 4, n_targets=10, weights=loadgen.zipf_weights(10), seed=2)
    counts = np.bincount(z.targets, minlength=10)
    assert counts[0] > counts[9] * 3


def test_trace_schedule(tmp_path: Path) -> None:
    f = tmp_path / "t.txt"
    f.write_text("# seconds model\n0.5 b\n0.1 a\n0.2 b\n")
    s = loadgen.trace(f, ["a", "b"])
    assert s.times.tolist() == [0.1, 0.2, 0.5] and s.targets.tolist() == [0, 1, 1]
    f.write_text("0.1 c\n")
    with pytest.raises(ValueError, match="unknown model 'c'"):
        loadgen.trace(f, ["a", "b"])


def test_a_tiny_run_writes_every_field(demo_repo: Path, tmp_path: Path) -> None:
    spec = spec_of(demo_repo, "digits_mlp")
    with Escapement(demo_repo) as server:
        rows = []
        for fe in ("socket", "http", "http-json"):
            m = measure(loadgen.poisson(200, 1.0, seed=3), fe, server.pid, ["digits_mlp"], socket_path=server.socket,
                        port=server.port, specs=[spec])
            rows.append(results.row(m.run, fe, spec.slo_s, server_cores=m.server_cores))
        bad = measure(loadgen.constant(50, 0.2), "socket", server.pid, ["nope"], socket_path=server.socket,
                      specs=[spec])
        rows.append(results.row(bad.run, "unknown model", spec.slo_s))
    out = tmp_path / "smoke.json"
    results.write("smoke", {"command": "pytest"}, rows, {"ok": True}, out)
    data = json.loads(out.read_text())
    assert set(data) >= {"scenario", "machine", "config", "rows", "summary"}
    assert set(data["machine"]) >= {"cores", "torch", "devices", "git_commit"}
    for r in data["rows"][:3]:
        assert set(r) >= ROW_FIELDS
        assert 100 < r["offered_rps"] < 300 and r["achieved_rps"] <= r["offered_rps"] + 1e-9
        assert r["slo_attainment"] == 1.0 and r["errors"] == {}
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["p999_ms"] <= r["max_ms"] < spec.slo_s * 1e3
        assert r["reconstructed"] == 0
    assert data["rows"][3]["errors"] == {"not_found": 10} and data["rows"][3]["achieved_rps"] == 0
    assert (tmp_path / "smoke.md").read_text().startswith("# smoke")
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_soak_finds_no_crash_5xx_or_leak(demo_repo: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m bench run soak` at a tenth of --quick (capacity given, not measured): the harness
    runs both phases and reports every figure; the daemon neither crashes nor answers a mistake
    with a 5xx nor leaks a request, its memory or a connection. Timing checks (health, refusals,
    goodput) are left to the real run."""
    from bench.scenarios import soak

    monkeypatch.setenv("ESCAPEMENT_BENCH_MODELS", str(demo_repo))
    r = soak.run(quick=True, json_out=str(tmp_path / "soak.json"), fuzz_inputs=400, overload_s=2.0,
                 capacity_rps=200.0)
    s, c = r["summary"], r["checks"]
    assert s["fuzz_http_inputs"] >= 400 and s["fuzz_socket_inputs"] >= 400
    assert s["fuzz_http_bad_5xx"] == 0 and s["fuzz_socket_bad_5xx"] == 0, s
    assert s["fuzz_crashes"] == 0 and s["fuzz_serves_after"], s
    assert s["fuzz_requests_leaked"] == 0 and s["fuzz_connections_leaked"] == 0, s
    assert s["fuzz_request_memory_leaked_bytes"] == 0, s
    assert c["overload_no_crash"] and s["overload_requests_leaked"] == 0 and s["overload_connections_leaked"] == 0, s
    over = r["overload"]
    assert over["offered_rps"] > 500 and over["health"]["probes"] > 10 and over["memory"]["rss_mib_peak"] > 0
    assert "--capacity-rps 200.0" in r["config"]["command"]
    assert json.loads((tmp_path / "soak.json").read_text())["checks"] == c
    assert (tmp_path / "soak.md").read_text().startswith("# soak")


@pytest.mark.parametrize("server_closes", [False, True])
def test_unanswered_requests_are_no_answer_and_broken_connections_are_connection_errors(
        tmp_path: Path, server_closes: bool) -> None:
    """A request the run's drain ended before an answer came is NO_ANSWER (closing our own
    connections then is not a broken connection); one whose connection the server closed is
    CONN_ERROR. The two were one figure, which read late answers as dropped connections."""
    import asyncio

    path = str(tmp_path / "s.sock")

    async def go() -> loadgen.Run:
        ended = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readexactly(4)  # a frame begins: never answered
                if not server_closes:
                    while await reader.read(65536):  # until the client closes its end
                        pass
                writer.close()
                await writer.wait_closed()
            finally:
                ended.set()

        server = await asyncio.start_unix_server(handle, path)
        frame = loadgen.SocketFrame({"model_name": "m", "inputs": []})
        try:
            run = await loadgen.run_socket(loadgen.constant(50, 0.1), path, [frame], ["m"], drain_s=0.2,
                                           connections=1)
            await asyncio.wait_for(ended.wait(), 10)
            return run
        finally:
            server.close()

    statuses = set(asyncio.run(go()).records.status.tolist())
    if server_closes:  # (those sent after it closed were never in flight on it: unanswered)
        assert loadgen.CONN_ERROR in statuses and statuses <= {loadgen.CONN_ERROR, loadgen.NO_ANSWER}
    else:
        assert statuses == {loadgen.NO_ANSWER}
