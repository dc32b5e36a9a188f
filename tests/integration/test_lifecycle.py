"""The daemon under a stand-in for systemd: a real process, its notify socket and signals; and the unit files."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon.client import SocketClient
from daemon.config import load_settings
from daemon.notify import Notifier
from daemon.runtime.faults import FaultSpec
from tests.harness import DaemonProcess, run_daemon
from tests.support import settings, short_tmpdir

ROOT = Path(__file__).resolve().parents[2]
Message = dict[str, str]


class NotifySocket:
    """What systemd binds for a Type=notify service: a datagram socket the daemon writes to."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.seen: list[Message] = []

    def wait_for(self, want: Callable[[Message], bool], daemon: DaemonProcess, timeout: float = 60) -> list[Message]:
        """Read messages until one satisfies `want`; returns all read meanwhile, that one last."""
        got: list[Message] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(min(left, 1.0))
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                if daemon.poll() is not None:
                    raise AssertionError(f"the daemon exited ({daemon.poll()}):\n{daemon.log()}") from None
                continue
            msg = dict(line.split("=", 1) for line in data.decode().split("\n"))
            got.append(msg)
            self.seen.append(msg)
            if want(msg):
                return got
        raise AssertionError(f"no such message in {timeout} s; got {got}\n{daemon.log()}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def statuses(msgs: list[Message]) -> list[str]:
    return [m["STATUS"] for m in msgs if "STATUS" in m]


@pytest.mark.slow
def test_notify_watchdog_reload_and_stop(demo_repo: Path, tmp_path: Path, run_dir: Path) -> None:
    repo = tmp_path / "models"
    shutil.copytree(demo_repo / "digits_mlp", repo / "digits_mlp")
    cfg_path = repo / "digits_mlp" / "config.toml"
    cfg_path.write_text("preload_replicas = 1\n" + cfg_path.read_text())  # READY=1 must wait for it
    sock = run_dir / "d.sock"
    config = tmp_path / "escapement.toml"
    config.write_text(f'[server]\nhttp = "127.0.0.1:0"\nsocket = "{sock}"\n[models]\nrepository = "{repo}"\n'
                      '[runtime]\ndevices = ["cpu:0"]\nwarmup_reps = 1\n')
    notify = NotifySocket(run_dir / "notify.sock")
    proc = DaemonProcess.with_config(config, cwd=tmp_path,
                                     env={"NOTIFY_SOCKET": str(run_dir / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        # 1. Start-up: progress in STATUS=, then READY=1 once the preloaded model is on its device.
        before = notify.wait_for(lambda m: "READY" in m, proc)
        status = statuses(before)
        assert status[0] == "starting: devices" and "loading model 1/1: digits_mlp:1" in status
        assert any(s.startswith("preloading digits_mlp:1") for s in status), status
        assert re.fullmatch(r"ready: 1 model version\(s\) serving; HTTP 127\.0\.0\.1:\d+; socket .*", status[-1])
        with SocketClient(str(sock)) as c:
            stats = c.call({"op": "stats"})["controller"]
            assert "digits_mlp:1" in stats["devices"]["cpu:0"]["models"]  # loaded before READY=1, not on demand
            assert [m["state"] for m in c.index()] == ["READY"]
        # 2. The watchdog: keep-alives every WATCHDOG_USEC / 2.
        notify.wait_for(lambda m: m == {"WATCHDOG": "1"}, proc)
        notify.wait_for(lambda m: m == {"WATCHDOG": "1"}, proc)
        # 3. SIGHUP with a new model in the repository: RELOADING=1, then READY=1, and it serves.
        shutil.copytree(demo_repo / "mlp_784", repo / "mlp_784")
        proc.send_signal(signal.SIGHUP)
        reloading = notify.wait_for(lambda m: "RELOADING" in m, proc)[-1]
        assert int(reloading["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        during = notify.wait_for(lambda m: "READY" in m, proc)
        assert "loading model 1/1: mlp_784:1" in statuses(during)
        assert during[-1]["STATUS"].startswith("ready: 2 model version(s) serving")
        with SocketClient(str(sock)) as c:
            r = c.infer("mlp_784", {"INPUT__0": np.zeros((3, 784), np.float32)})
            assert r.outputs["OUTPUT__0"].shape == (3, 10)
        # 4. SIGTERM: STOPPING=1, a drain, and a clean exit.
        proc.send_signal(signal.SIGTERM)
        notify.wait_for(lambda m: "STOPPING" in m, proc)
        assert proc.wait(60) == 0
        assert "[shutdown] done" in proc.log()
        assert not sock.exists()
    finally:
        proc.kill()
        notify.close()
    assert sum(1 for m in notify.seen if "READY" in m) == 2  # start-up and the reload, nothing else


async def test_stop_drains_accepted_requests_and_says_so(demo_repo: Path, run_dir: Path) -> None:
    """In process: a request still running at SIGTERM is answered, and STATUS= shows the drain."""
    repo = run_dir / "models"
    shutil.copytree(demo_repo / "mlp_784", repo / "mlp_784")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(run_dir / "notify.sock"))
    notify.settimeout(30)
    try:
        async with run_daemon(settings(repo, run_dir, runtime={"warmup_reps": 1}),
                              notifier=Notifier(str(run_dir / "notify.sock"))) as d:
            d.executors["cpu:0"].faults.set(FaultSpec(add_ms=1000))  # it is still running at the stop
            gw = d.gateway
            req = gw.new_request(gw.admit("mlp_784", None), (np.zeros((1, 784), np.float32),), 1, 5_000_000, None, "")
            running = asyncio.ensure_future(gw.infer(req))
            await asyncio.sleep(0)  # submitted
            d.stop()
            out = (await running).outputs[0]
            await d.wait_stopped()
        assert out.shape == (1, 10)
        msgs: list[bytes] = []
        while not msgs or msgs[-1] != b"STATUS=stopped":
            msgs.append(notify.recv(4096))
        stop = msgs.index(b"STOPPING=1\nSTATUS=stopping: closing listeners")
        draining, rest = msgs[stop + 1:-2], msgs[-2:]
        # once, and again every second the drain lasts
        assert draining and set(draining) == {b"STATUS=stopping: draining 1 request(s)"}, msgs
        assert rest == [b"STATUS=stopping: executors", b"STATUS=stopped"]
    finally:
        notify.close()


# ------------------------------------------------------------------ the unit files

SYSTEMD = ROOT / "systemd"


def test_systemd_config_example_is_valid() -> None:
    s = load_settings(str(ROOT / "config" / "escapement.systemd.toml"))
    assert s.server.socket == "/run/escapement/escapement.sock"
    unit = (SYSTEMD / "escapement.service").read_text()
    stop = float(re.search(r"^TimeoutStopSec=(\d+)s?$", unit, re.M).group(1))  # type: ignore[union-attr]
    assert stop > s.server.drain_timeout_s + 5  # systemd must not SIGKILL a drain in progress
    assert re.search(r"^Type=notify$", unit, re.M)
    # The socket's directory is made by tmpfiles (group escapement-clients, set-group-ID), not by
    # RuntimeDirectory= (which would give it the daemon's group); the unit lets the daemon write it.
    assert not re.search(r"^RuntimeDirectory=", unit, re.M)
    assert re.search(r"^ReadWritePaths=(.*\s)?/run/escapement(\s|$)", unit, re.M)
    tmpfiles = (SYSTEMD / "escapement.tmpfiles.conf").read_text()
    assert re.search(r"^d\s+/run/escapement\s+2750\s+escapement\s+escapement-clients\s", tmpfiles, re.M)
    # The repository is the one the unit makes read-only, and the token comes from the credential.
    assert re.search(rf"^ReadOnlyPaths=(.*\s)?{re.escape(s.models.repository)}(\s|$)", unit, re.M)
    assert s.server.admin_token == "" and s.server.admin_token_file == ""
    assert re.search(r"^LoadCredential=admin-token:", unit, re.M)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """`systemd-analyze verify` on a copy whose ExecStart points at a binary that exists here (it
    rejects a unit whose binary is missing, which is not a fault of the unit)."""
    unit = (SYSTEMD / "escapement.service").read_text()
    exec_start = re.search(r"^ExecStart=(\S+)", unit, re.M)
    assert exec_start is not None and exec_start.group(1) == "/usr/bin/escapement"
    (tmp_path / "escapement.service").write_text(unit.replace("ExecStart=/usr/bin/escapement",
                                                              f"ExecStart={sys.executable} -m daemon"))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "escapement.service")],
                       capture_output=True, text=True, timeout=60)
    # Lines about the host rather than the unit (no systemd as PID 1 in a container, no
    # `escapement` user here) are not the unit's fault.
    noise = re.compile(r"(Failed to connect to bus|No such file or directory.*(bus|private)|"
                       r"user .?escapement.?|Cannot find unit for|System has not been booted with systemd|"
                       r"Failed to (set up|create) .*manager|Operation not permitted|"
                       r"^$)", re.I)
    problems = [line for line in (r.stdout + r.stderr).splitlines() if not noise.search(line)]
    assert not problems, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
                    reason="needs systemd-sysusers and systemd-tmpfiles")
def test_sysusers_and_tmpfiles_create_the_user_and_directories(tmp_path: Path) -> None:
    """Applied to an empty root directory, as a package's post-install would on the real one."""
    for kind in ("sysusers", "tmpfiles"):
        d = tmp_path / "usr" / "lib" / f"{kind}.d"
        d.mkdir(parents=True)
        shutil.copy(SYSTEMD / f"escapement.{kind}.conf", d / "escapement.conf")
    (tmp_path / "etc").mkdir()
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    user = next(line for line in (tmp_path / "etc" / "passwd").read_text().splitlines()
                if line.startswith("escapement:"))
    assert user.endswith(":/var/lib/escapement:/usr/sbin/nologin")
    r = subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    models = tmp_path / "var" / "lib" / "escapement" / "models"
    assert models.is_dir() and models.stat().st_mode & 0o777 == 0o750
