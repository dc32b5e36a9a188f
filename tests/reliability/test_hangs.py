"""Hangs the daemon cannot recover from by itself: it says so, keeps serving what it can, asks
systemd for a restart (the watchdog keep-alives stop), and still stops within a bound.

The process test runs the real daemon under a stand-in for systemd's notify socket; the
executor tests hold a lane thread inside an action that never returns.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.client import SocketClient
from daemon.clock import MonotonicClock
from daemon.runtime.executor import Lane
from daemon.runtime.workers import WorkerPool
from tests.harness import DaemonProcess
from tests.integration.test_lifecycle import NotifySocket
from tests.support import short_tmpdir
from tests.unit.harness import make_spec


@pytest.mark.slow
def test_a_hung_load_is_left_the_service_asks_for_a_restart_and_stops_in_time(demo_repo: Path,
                                                                                tmp_path: Path) -> None:
    run_dir = short_tmpdir()
    repo = tmp_path / "models"
    shutil.copytree(demo_repo / "digits_mlp", repo / "digits_mlp")
    cfg = repo / "digits_mlp" / "config.toml"
    cfg.write_text("preload_replicas = 2\n" + cfg.read_text())
    sock = run_dir / "d.sock"
    config = tmp_path / "escapement.toml"
    # the warm-up takes cpu:0 (both are empty: the first by name); the preload's LOAD on cpu:1 hangs
    config.write_text(f'[server]\nhttp = ""\nsocket = "{sock}"\nallow_faults = true\n'
                      f'[models]\nrepository = "{repo}"\n'
                      '[runtime]\ndevices = ["cpu:0", "cpu:1"]\nwarmup_reps = 1\nhung_action_s = 1.0\n'
                      '[[faults]]\ndevice = "cpu:1"\nhang_load = true\n')
    notify = NotifySocket(run_dir / "notify.sock")
    proc = DaemonProcess.with_config(config, cwd=tmp_path,
                                     env={"NOTIFY_SOCKET": str(run_dir / "notify.sock"), "WATCHDOG_USEC": "200000"})
    try:
        # The preload waits for its LOADs; the hung one is given up after hung_action_s, not never.
        notify.wait_for(lambda m: "READY" in m, proc)
        def wanted(m: dict[str, str]) -> bool:
            return m.get("STATUS", "").startswith("restart wanted")

        if not any(wanted(m) for m in notify.seen):  # it may come before READY=1 or after
            notify.wait_for(wanted, proc)
        (status,) = [m["STATUS"] for m in notify.seen if wanted(m)]
        assert "cpu:1: LOAD of digits_mlp:1 has not returned" in status
        # The keep-alives have stopped: systemd (WatchdogSec) would now restart the service.
        t0 = time.monotonic()
        notify.sock.settimeout(0.5)
        late = []
        while time.monotonic() - t0 < 1.0:  # five keep-alive intervals
            try:
                late.append(notify.sock.recv(4096))
            except TimeoutError:
                pass
        assert b"WATCHDOG=1" not in late
        # Meanwhile what can be served is: cpu:0 holds the model.
        with SocketClient(str(sock)) as c:
            r = c.infer("digits_mlp", {"INPUT__0": np.zeros((4, 64), np.float32)})
            assert r.outputs["OUTPUT__0"].shape == (4, 10)
            devices = c.call({"op": "stats"})["controller"]["devices"]
            assert devices["cpu:1"]["failed"].startswith("hung: LOAD of digits_mlp:1")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 15  # drain (nothing left), executors (5 s at most), workers
        text = proc.log()
        assert "[shutdown] done" in text and "Traceback" not in text
    finally:
        proc.kill()
        notify.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
def test_sigterm_during_a_warm_up_that_hangs_stops_in_time(demo_repo: Path, tmp_path: Path) -> None:
    """A start-up stuck in a warm-up (its LOAD hangs) still stops on SIGTERM within the bound:
    systemd's stop timeout holds from any state."""
    run_dir = short_tmpdir()
    repo = tmp_path / "models"
    shutil.copytree(demo_repo / "digits_mlp", repo / "digits_mlp")
    for p in repo.rglob("profile.json"):
        p.unlink()  # measured at start-up: the warm-up runs (and its LOAD hangs)
    config = tmp_path / "escapement.toml"
    config.write_text(f'[server]\nhttp = ""\nsocket = "{run_dir / "d.sock"}"\n[models]\nrepository = "{repo}"\n'
                      '[runtime]\ndevices = ["cpu:0"]\nwarmup_reps = 1\n'
                      '[[faults]]\ndevice = "cpu:0"\nhang_load = true\n')
    notify = NotifySocket(run_dir / "notify.sock")
    proc = DaemonProcess.with_config(config, cwd=tmp_path, env={"NOTIFY_SOCKET": str(run_dir / "notify.sock")})
    try:
        notify.wait_for(lambda m: m.get("STATUS", "").startswith("warming digits_mlp:1"), proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        took = time.monotonic() - t0
        text = proc.log()
        assert took < 15, (took, text)  # drain (nothing), executors (5 s at most), workers (5 s at most)
        assert "start-up abandoned" in text and "[shutdown] done" in text and "Traceback" not in text
        assert not any("READY" in m for m in notify.seen)
    finally:
        proc.kill()
        notify.close()
        shutil.rmtree(run_dir, ignore_errors=True)


# ------------------------------------------------------------------ threads that never return


@pytest.mark.slow  # asserts in wall-clock time
def test_a_lane_stuck_in_an_action_is_left_behind_within_the_bound() -> None:
    release = threading.Event()
    started = threading.Event()
    results: list[Result] = []

    def run(action: Action, received: float) -> Result:
        started.set()
        release.wait()  # a driver call that never comes back
        return Result(action, ResultStatus.OK, received, received, received)

    lane = Lane("cpu:9/load", run, MonotonicClock(), results.append, lambda: None)
    lane.start()
    try:
        spec = make_spec()
        now = time.monotonic()
        lane.submit(Action(ActionKind.LOAD, spec, "cpu:9", now, float("inf")))
        queued = Action(ActionKind.LOAD, spec, "cpu:9", now + 0.001, float("inf"))
        lane.submit(queued)
        assert started.wait(10)
        t0 = time.monotonic()
        lane.begin_stop()
        assert not lane.join(time.monotonic() + 0.2)  # stuck: given up on, within the bound
        assert time.monotonic() - t0 < 2.0 and lane.alive
        assert [r.action for r in results] == [queued] and results[0].status == ResultStatus.CANCELLED
    finally:
        release.set()
    assert lane.join(time.monotonic() + 10) and not lane.alive


@pytest.mark.slow  # asserts in wall-clock time
def test_the_worker_pool_never_waits_past_its_bound_for_a_stuck_job() -> None:
    release = threading.Event()
    pool = WorkerPool(max_workers=2, timeout_s=0.2)
    try:
        stuck = pool.submit(release.wait)
        assert pool.submit(lambda x: x * 2, 21).result(10) == 42
        t0 = time.monotonic()
        pool.shutdown(wait=True)
        assert time.monotonic() - t0 < 2.0
        assert len(pool.stuck) == 1 and not stuck.done()
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(print)
    finally:
        release.set()
    assert stuck.result(10) is True


def test_the_worker_pool_passes_errors_and_reuses_its_threads() -> None:
    pool = WorkerPool(max_workers=4, name="reuse")
    try:
        for i in range(50):
            assert pool.submit(pow, i, 2).result(10) == i * i
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(10)
        # at most max_workers threads were ever started, whatever the number of jobs
        started = {t.name for t in threading.enumerate() if t.name.startswith("reuse-")}
        assert started and started <= {f"reuse-{i}" for i in range(4)}
    finally:
        pool.shutdown()
    assert pool.stuck == []
