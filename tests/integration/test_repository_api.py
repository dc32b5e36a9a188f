"""The repository extension (index, load, unload) and reloads, against a real in-process daemon."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from daemon.client import HttpClient, InferenceServerError
from daemon.errors import Unavailable
from tests.support import DaemonThread, settings, short_tmpdir

X784 = {"INPUT__0": np.zeros((2, 784), np.float32)}
X64 = {"INPUT__0": np.zeros((2, 64), np.float32)}


@pytest.fixture
def repo(demo_repo: Path, tmp_path: Path) -> Path:
    """A repository holding only digits_mlp (with its parity model); tests add the rest."""
    root = tmp_path / "repo"
    shutil.copytree(demo_repo / "digits_mlp", root / "digits_mlp")
    return root


@contextlib.contextmanager
def start(repo: Path, **server: Any) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    try:
        with DaemonThread(settings(repo, d, server=server, runtime={"warmup_reps": 1})) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(repo: Path) -> Iterator[DaemonThread]:
    with start(repo) as dt:
        yield dt


def post(dt: DaemonThread, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    host, port = dt.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        conn.request("POST", path, body=orjson.dumps(body) if body is not None else b"", headers=headers)
        r = conn.getresponse()
        data = r.read()
        return r.status, orjson.loads(data) if data else None
    finally:
        conn.close()


def states(dt: DaemonThread) -> dict[str, tuple[str, str]]:
    return {f"{m['name']}:{m.get('version', '-')}": (m["state"], m.get("reason", ""))
            for m in dt.call(dt.daemon.catalog.index)}


def test_load_and_unload_with_tritonclient(daemon: DaemonThread, repo: Path, demo_repo: Path) -> None:
    c = th.InferenceServerClient(daemon.http)
    assert [m["name"] for m in c.get_model_repository_index()] == ["digits_mlp"]
    with pytest.raises(InferenceServerException, match="model 'mlp_784' is not in the model repository"):
        c.load_model("mlp_784")
    shutil.copytree(demo_repo / "mlp_784", repo / "mlp_784")
    c.load_model("mlp_784")  # returns once the model is ready
    assert c.is_model_ready("mlp_784")
    with HttpClient(daemon.http) as h:
        assert h.infer("mlp_784", X784).outputs["OUTPUT__0"].shape == (2, 10)
        c.unload_model("mlp_784")
        assert not c.is_model_ready("mlp_784")
        assert states(daemon)["mlp_784:1"] == ("UNAVAILABLE", "unloaded")
        with pytest.raises(InferenceServerError) as e:
            h.infer("mlp_784", X784)
        assert e.value.status == 503 and "unloaded" in e.value.message
        assert h.infer("digits_mlp", X64).outputs["OUTPUT__0"].shape == (2, 10)  # the others are untouched
        c.load_model("mlp_784")
        assert h.infer("mlp_784", X784).outputs["OUTPUT__0"].shape == (2, 10)
    # Its weights left the device when it was unloaded, and came back with the load.
    assert daemon.wait_idle() == 0
    assert "mlp_784:1" in daemon.call(lambda: daemon.daemon.executors["cpu:0"].resident)
    c.close()


def test_repository_errors_are_clear(daemon: DaemonThread, repo: Path) -> None:
    status, body = post(daemon, "/v2/repository/models/nope/unload")
    assert (status, body["error"]) == (404, "unknown model 'nope'")
    status, body = post(daemon, "/v2/repository/models/nope/load")
    assert status == 404 and "not in the model repository" in body["error"]
    status, body = post(daemon, "/v2/repository/models/digits_mlp/load", {"parameters": {"config": "{}"}})
    assert status == 501 and "config or model files" in body["error"]
    status, body = post(daemon, "/v2/repository/models/digits_mlp/unload", {"parameters": {"unload_dependents": 1}})
    assert status == 400 and "unload_dependents must be a boolean" in body["error"]
    status, body = post(daemon, "/v2/repository/models/digits_mlp/load", [1])
    assert status == 400 and "JSON object" in body["error"]
    status, body = post(daemon, "/v2/repository/other/models/digits_mlp/load")
    assert status == 501 and "'repository_name'" in body["error"]
    # A broken entry is reported on load, with the reason, and listed in the index.
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "config.toml").write_text("max_batch_size = [")
    status, body = post(daemon, "/v2/repository/models/broken/load")
    assert status == 400 and body["error"].startswith("failed to load model broken: broken: config.toml is not")
    assert states(daemon)["broken:-"][0] == "UNAVAILABLE"
    # Loading what is already served changes nothing.
    status, body = post(daemon, "/v2/repository/models/digits_mlp/load")
    assert status == 200 and body == {"loaded": [], "reloaded": [], "unloaded": [], "failed": {}, "broken": {}}


def test_management_endpoints_need_the_admin_token(repo: Path) -> None:
    with start(repo, admin_token="s3cret") as dt:
        for path in ("/v2/repository/models/digits_mlp/unload", "/v2/repository/models/digits_mlp/load"):
            for token in (None, "wrong"):
                status, body = post(dt, path, token=token)
                assert status == 403 and "Bearer" in body["error"], (path, token)
        assert states(dt)["digits_mlp:1"][0] == "READY"
        status, body = post(dt, "/v2/repository/models/digits_mlp/unload", token="s3cret")
        assert status == 200 and body["unloaded"] == ["digits_mlp:1"]
        status, _ = post(dt, "/v2/repository/index")  # reading the index needs no token
        assert status == 200


def test_unload_answers_accepted_requests_before_unloading(daemon: DaemonThread) -> None:
    d = daemon.daemon

    async def scenario() -> tuple[list[Any], dict[str, Any], BaseException | None]:
        spec = d.catalog.resolve("digits_mlp")
        x = (np.zeros((1, 64), np.float32),)
        accepted = [asyncio.ensure_future(d.gateway.infer(d.gateway.new_request(spec, x, 1, 1_000_000, None, "")))
                    for _ in range(12)]
        await asyncio.sleep(0)  # one loop turn: each is submitted, none can be answered yet
        assert d.controller.scheduler.pending == 12
        unloading = asyncio.ensure_future(d.gateway.unload_model("digits_mlp"))
        await asyncio.sleep(0)
        late: BaseException | None = None
        try:  # a request after the unload began is refused at once
            await d.gateway.infer(d.gateway.new_request(spec, x, 1, None, None, ""))
        except Unavailable as e:
            late = e
        answers = await asyncio.gather(*accepted, return_exceptions=True)
        return answers, await unloading, late

    answers, report, late = daemon.on_loop(scenario())
    assert all(not isinstance(a, BaseException) and a.outputs[0].shape == (1, 10) for a in answers), answers
    assert report["unloaded"] == ["digits_mlp:1"] and isinstance(late, Unavailable)
    assert daemon.wait_idle() == 0
    sched = d.controller.scheduler
    assert daemon.call(lambda: sorted(sched.models)) == []  # the model and its parity model
    assert daemon.call(lambda: dict(d.executors["cpu:0"].resident)) == {}  # weights unloaded everywhere


def test_reload_applies_what_changed_in_the_repository(daemon: DaemonThread, repo: Path, demo_repo: Path) -> None:
    d = daemon.daemon
    assert daemon.on_loop(d.models.reload_repository())["loaded"] == []
    # A new model, a removed one (with its parity model), and a broken entry, in one reload.
    shutil.copytree(demo_repo / "mlp_784", repo / "mlp_784")
    shutil.rmtree(repo / "digits_mlp")
    (repo / "bad").mkdir()
    (repo / "bad" / "config.toml").write_text("max_batch_size = 0\n")
    r = daemon.on_loop(d.models.reload_repository())
    assert r["loaded"] == ["mlp_784:1"] and r["unloaded"] == ["digits_mlp:1"]
    assert r["broken"] == {"bad": "bad: max_batch_size = 0: expected an integer in 1..4096"}
    assert states(daemon) == {"mlp_784:1": ("READY", ""),
                              "bad:-": ("UNAVAILABLE", "bad: max_batch_size = 0: expected an integer in 1..4096")}
    assert sorted(d.controller.scheduler.models) == ["mlp_784:1"]
    # A changed config replaces the version; the new settings serve.
    cfg = repo / "mlp_784" / "config.toml"
    cfg.write_text(cfg.read_text().replace("slo_ms = 100", "slo_ms = 250"))
    shutil.rmtree(repo / "bad")
    r = daemon.on_loop(d.models.reload_repository())
    assert r["reloaded"] == ["mlp_784:1"] and r["broken"] == {}
    assert d.catalog.resolve("mlp_784").slo_s == 0.25
    with HttpClient(daemon.http) as h:
        assert h.infer("mlp_784", X784).outputs["OUTPUT__0"].shape == (2, 10)
    # An entry that breaks keeps what it served; an unloaded model stays unloaded across reloads.
    cfg.write_text("this is [not toml")
    r = daemon.on_loop(d.models.reload_repository())
    assert "mlp_784" in r["broken"] and r["unloaded"] == []
    assert states(daemon)["mlp_784:1"] == ("READY", "")
    cfg.write_text((demo_repo / "mlp_784" / "config.toml").read_text())
    daemon.on_loop(d.gateway.unload_model("mlp_784"))
    assert daemon.on_loop(d.models.reload_repository())["loaded"] == []
    assert states(daemon)["mlp_784:1"] == ("UNAVAILABLE", "unloaded")


def test_a_reload_requested_during_a_reload_runs_once_more_after_it(repo: Path) -> None:
    from daemon.notify import Notifier

    d = short_tmpdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(d / "notify.sock"))
    sock.settimeout(30)
    dt = DaemonThread(settings(repo, d, runtime={"warmup_reps": 1}))
    dt.daemon.notifier = Notifier(str(d / "notify.sock"))
    try:
        dt.start()
        assert sock.recv(4096).startswith(b"STATUS=starting")
        daemon = dt.daemon

        async def two_sighups() -> None:
            daemon.request_reload()
            await asyncio.sleep(0)  # the reload task starts, takes the lock, and waits on its scan
            assert daemon.models.lock.locked()
            daemon.request_reload()  # during it: one more, after it
            daemon.request_reload()  # and another one now coalesces with that
            assert daemon.models.reloader is not None
            await daemon.models.reloader

        dt.on_loop(two_sighups())
        seen = []
        while len([m for m in seen if m.startswith(b"READY=1")]) < 3:  # start-up, then two reloads
            seen.append(sock.recv(4096))
        order = [m.split(b"\n")[0] for m in seen if m.startswith((b"READY=1", b"RELOADING=1"))]
        assert order == [b"READY=1", b"RELOADING=1", b"READY=1", b"RELOADING=1", b"READY=1"]
    finally:
        dt.stop()
        sock.close()
        shutil.rmtree(d, ignore_errors=True)
