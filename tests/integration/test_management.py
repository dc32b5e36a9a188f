"""Management endpoints against a real daemon: who may call them, from where, with what.

The rules (daemon/api/http.py, "management"): a bearer token (a file or a systemd credential),
or an explicit loopback opt-in; no foreign Origin or Host, no body typed as anything but JSON;
fault injection off unless allowed, and a fault that is not valid is refused whole. Also here:
client priorities are clamped unless the operator allows them, and a request that names no
version goes to the newest READY one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from daemon.catalog import ModelState
from daemon.errors import ConfigError
from daemon.server import read_admin_token
from tests.support import DaemonThread, settings, short_tmpdir

TOKEN = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def repo(demo_repo: Path, tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(demo_repo / "digits_mlp", root / "digits_mlp")
    return root


@contextlib.contextmanager
def start(repo: Path, **server: Any) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    # the test settings open management on loopback; these tests set what they check themselves
    server = {"admin_open_loopback": False, "allow_faults": False, **server}
    try:
        with DaemonThread(settings(repo, d, server=server, runtime={"warmup_reps": 1})) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def guarded(demo_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonThread]:
    """A daemon whose token comes from a file, with fault injection allowed."""
    root = tmp_path_factory.mktemp("guarded")
    shutil.copytree(demo_repo / "digits_mlp", root / "repo" / "digits_mlp")
    token_file = root / "admin-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    with start(root / "repo", admin_token_file=str(token_file), allow_faults=True) as dt:
        yield dt


def call(dt: DaemonThread, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None, token: str | None = TOKEN) -> tuple[int, Any]:
    host, port = dt.http.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        data = r.read()
        return r.status, orjson.loads(data) if data else None
    finally:
        conn.close()


def faults(dt: DaemonThread) -> dict[str, Any]:
    status, body = call(dt, "GET", "/v2/admin/faults")
    assert status == 200, body
    return body


# ------------------------------------------------------------------ who may call


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v2/repository/models/digits_mlp/load"),
    ("POST", "/v2/repository/models/digits_mlp/unload"),
    ("GET", "/v2/admin/faults"),
    ("POST", "/v2/admin/faults"),
    ("DELETE", "/v2/admin/faults/cpu:0"),
])
def test_no_token_or_a_wrong_one_is_403(guarded: DaemonThread, method: str, path: str) -> None:
    body = b'{"device": "cpu:0", "hang": true}' if path == "/v2/admin/faults" and method == "POST" else None
    for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
        status, answer = call(guarded, method, path, body, {"Content-Type": "application/json"}, token=token)
        assert status == 403 and "Bearer" in answer["error"], (token, answer)
    assert faults(guarded) == {"cpu:0": None}  # nothing was applied


def test_the_token_file_opens_management(guarded: DaemonThread) -> None:
    assert faults(guarded) == {"cpu:0": None}
    status, _ = call(guarded, "POST", "/v2/repository/index", token=None)  # reading needs no token
    assert status == 200


@pytest.mark.parametrize("headers", [
    {"Origin": "http://evil.example"},  # a page on another site
    {"Origin": "null"},  # a sandboxed page or a file:// page
    {"Host": "evil.example:8000"},  # DNS rebinding: the page's name now points at 127.0.0.1
    {"Host": "evil.example", "Origin": "http://evil.example"},
])
def test_a_cross_site_request_is_403_even_with_the_token(guarded: DaemonThread, headers: dict[str, str]) -> None:
    status, answer = call(guarded, "POST", "/v2/admin/faults", b'{"device": "cpu:0", "hang": true}',
                          {"Content-Type": "application/json", **headers})
    assert status == 403, answer
    assert faults(guarded) == {"cpu:0": None}


def test_the_same_origin_is_allowed(guarded: DaemonThread) -> None:
    status, answer = call(guarded, "GET", "/v2/admin/faults", headers={"Origin": f"http://{guarded.http}"})
    assert status == 200, answer


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x"])
def test_a_body_a_form_could_send_is_415(guarded: DaemonThread, ctype: str) -> None:
    status, answer = call(guarded, "POST", "/v2/admin/faults", b'{"device": "cpu:0", "hang": true}',
                          {"Content-Type": ctype})
    assert status == 415, answer
    assert faults(guarded) == {"cpu:0": None}


@pytest.mark.parametrize("path", [
    "/v2/repository/models/digits_mlp%2Funload",  # an encoded "/" is part of the name
    "/v2/repository/models/digits_mlp%2F..%2F..%2Fadmin%2Ffaults/load",
    "/v2/admin%2Ffaults",
])
def test_an_encoded_slash_never_reaches_another_route(guarded: DaemonThread, path: str) -> None:
    status, answer = call(guarded, "POST", path, b"{}", {"Content-Type": "application/json"})
    assert status in (400, 404), (status, answer)
    assert faults(guarded) == {"cpu:0": None}


def test_management_is_refused_without_a_token_unless_opened_to_loopback(repo: Path) -> None:
    with start(repo) as dt:
        status, answer = call(dt, "POST", "/v2/repository/models/digits_mlp/load", token=None)
        assert status == 403 and "admin_open_loopback" in answer["error"]
    with start(repo, admin_open_loopback=True) as dt:
        status, answer = call(dt, "POST", "/v2/repository/models/digits_mlp/load", token=None)
        assert status == 200, answer
        status, answer = call(dt, "GET", "/v2/admin/faults", token=None)
        assert status == 403 and "allow_faults" in answer["error"]  # faults stay off


def test_a_token_file_is_checked_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(ConfigError, match="does not exist"):
        read_admin_token("", str(tmp_path / "missing"))
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="shorter than 16"):
        read_admin_token("", str(tmp_path / "short"))
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "admin-token").write_text(TOKEN + "\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert read_admin_token("inline-token-in-the-toml", "") == TOKEN  # the credential wins over the TOML
    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    assert read_admin_token("inline-token-in-the-toml", "") == "inline-token-in-the-toml"


# ------------------------------------------------------------------ the fault API


@pytest.mark.parametrize("body", [
    b'{"device": "cpu:0", "slowdown": NaN}',
    b'{"device": "cpu:0", "slowdown": "3"}',
    b'{"device": "cpu:0", "slowdown": true}',
    b'{"device": "cpu:0", "slowdown": 0.5}',
    b'{"device": "cpu:0", "slowdown": 1e9}',
    b'{"device": "cpu:0", "add_ms": -1}',
    b'{"device": "cpu:0", "add_ms": 1e12}',
    b'{"device": "cpu:0", "add_ms": 1e999}',
    b'{"device": "cpu:0", "duty": 2}',
    b'{"device": "cpu:0", "period_s": 0}',
    b'{"device": "cpu:0", "fail_probability": [0.5]}',
    b'{"device": "cpu:0", "hang": "yes"}',
    b'{"device": "cpu:0", "hang": 1}',
    b'{"device": "cpu:0", "seed": 1.5}',
    b'{"device": "cpu:0", "seed": [1]}',
    b'{"device": "cpu:0", "seed": 1180591620717411303424}',
    b'{"device": "cpu:0", "mode": "sometimes"}',
    b'{"device": "cpu:0", "mode": ["periodic"]}',
    b'{"device": "cpu:0", "hang": true, "explode": true}',
    b'{"device": ["cpu:0"], "hang": true}',
    b'{"hang": true}',
    b'[1, 2]',
    b'{"device": "cpu:0", "hang": tru',
], ids=lambda b: b.decode()[:48])
def test_a_bad_fault_is_400_and_applies_nothing(guarded: DaemonThread, body: bytes) -> None:
    status, answer = call(guarded, "POST", "/v2/admin/faults", body, {"Content-Type": "application/json"})
    assert status == 400, (body, answer)
    assert faults(guarded) == {"cpu:0": None}


def test_an_unknown_device_is_404(guarded: DaemonThread) -> None:
    status, answer = call(guarded, "POST", "/v2/admin/faults", b'{"device": "cpu:9", "hang": true}')
    assert status == 404 and "cpu:0" in answer["error"]
    status, _ = call(guarded, "DELETE", "/v2/admin/faults/cpu:9")
    assert status == 404


def test_a_valid_fault_is_applied_and_cleared(guarded: DaemonThread) -> None:
    status, answer = call(guarded, "POST", "/v2/admin/faults",
                          b'{"device": "cpu:0", "add_ms": 2, "mode": "periodic", "seed": 3}')
    assert status == 200 and answer["add_ms"] == 2 and answer["mode"] == "periodic", answer
    assert faults(guarded)["cpu:0"]["seed"] == 3
    status, _ = call(guarded, "DELETE", "/v2/admin/faults/cpu:0")
    assert status == 200 and faults(guarded) == {"cpu:0": None}


# ------------------------------------------------------------------ what a request may ask


def test_a_client_priority_is_clamped_unless_allowed(guarded: DaemonThread) -> None:
    dt = guarded
    spec = dt.daemon.catalog.resolve("digits_mlp")
    x = (np.zeros((1, 784), np.float32),)
    default = dt.daemon.settings.controller.default_priority
    urgent = dt.call(dt.daemon.gateway.new_request, spec, x, 1, None, 1, "c")
    lazy = dt.call(dt.daemon.gateway.new_request, spec, x, 1, None, default + 5, "c")
    assert urgent.rank == default  # may not jump everyone
    assert lazy.rank == default + 5  # may lower its own


def test_a_request_with_no_version_goes_to_the_newest_ready_one(guarded: DaemonThread) -> None:
    dt = guarded
    reg = dt.daemon.catalog
    ready = reg.resolve("digits_mlp")
    newer = dataclasses.replace(ready, version=99)

    def add_loading() -> None:
        reg.add(newer, ModelState.LOADING)

    dt.call(add_loading)
    try:
        assert dt.call(reg.resolve, "digits_mlp") is ready  # not version 99, still loading
        dt.call(reg.set_state, newer, ModelState.UNAVAILABLE, "failed to load")
        assert dt.call(reg.resolve, "digits_mlp") is ready
        dt.call(reg.set_state, newer, ModelState.READY)
        assert dt.call(reg.resolve, "digits_mlp").version == 99
    finally:
        dt.call(reg.remove, "digits_mlp", 99)
