"""The one way a test runs a daemon: `run_daemon(settings)` in process, `DaemonProcess` as a subprocess.

`run_daemon` goes through the path `escapement serve` takes (`Daemon.serve`: start-up, serving,
the ordered shutdown) on the running loop and yields a `RunningDaemon`: its addresses, the
gateway, the executors (for fault injection), a wait until idle, and the ERRORs it logged.
`tests.support.DaemonThread` runs it on a thread of its own for blocking clients.

`DaemonProcess` is `python -m daemon serve ...` for what only a process shows: the CLI, signals,
systemd's notify socket, RSS, exit codes.

The loop: uvloop (what `escapement serve` runs), or asyncio's own with ESCAPEMENT_TEST_LOOP=asyncio;
tests/conftest.py hands the same choice to pytest-asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvloop

from daemon.clock import Clock
from daemon.config import Settings
from daemon.gateway import Gateway
from daemon.notify import Notifier
from daemon.runtime.executor import Executor
from daemon.server import Daemon

LOOP_ENV = "ESCAPEMENT_TEST_LOOP"
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"uvloop": uvloop.new_event_loop,
                                                            "asyncio": asyncio.new_event_loop}


def loop_name() -> str:
    """The event loop tests run on: $ESCAPEMENT_TEST_LOOP (uvloop unless it says asyncio)."""
    name = os.environ.get(LOOP_ENV, "uvloop") or "uvloop"
    if name not in LOOPS:
        raise ValueError(f"{LOOP_ENV}={name!r}: expected one of {sorted(LOOPS)}")
    return name


def new_event_loop() -> asyncio.AbstractEventLoop:
    return LOOPS[loop_name()]()


class ErrorRecords(logging.Handler):
    """ERROR (and worse) records of the loggers it is attached to."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class RunningDaemon:
    """A daemon `run_daemon` started: what tests use of it, all public."""

    def __init__(self, daemon: Daemon, serving: asyncio.Task[None], log: ErrorRecords) -> None:
        self.daemon = daemon
        self.serving = serving  # Daemon.serve(): done once the daemon has stopped
        self.log = log  # the ERRORs its loggers wrote while it ran
        self.loop_errors: list[dict[str, Any]] = []  # what reached the loop's exception handler

    @property
    def settings(self) -> Settings:
        return self.daemon.settings

    @property
    def gateway(self) -> Gateway:
        return self.daemon.gateway

    @property
    def executors(self) -> dict[str, Executor]:
        """One per device: tests inject faults through `executors[name].faults`."""
        return self.daemon.executors

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.daemon.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.daemon.grpc_port}"

    @property
    def socket(self) -> str:
        return self.settings.server.socket

    @property
    def errors(self) -> list[str]:
        """Every ERROR the daemon logged and every exception that reached its loop."""
        return [r.getMessage() for r in self.log.records] + [str(c.get("message")) for c in self.loop_errors]

    async def wait_idle(self) -> int:
        """Until no request is pending, no action in flight and no coding group left (on the
        controller's own event, never a sleep); returns the requests pending. Bound it with
        `asyncio.timeout`."""
        ctl = self.daemon.controller
        await ctl.settled()
        return ctl.scheduler.pending

    def stop(self) -> None:
        """Ask for the ordered shutdown (SIGTERM's); `wait_stopped` waits for it."""
        self.daemon.request_stop()

    async def wait_stopped(self) -> int:
        """Until the daemon has stopped (asked to, or by itself: every device lost); its exit code."""
        await asyncio.shield(self.serving)
        return self.daemon.exit_code


@contextlib.asynccontextmanager
async def run_daemon(settings: Settings, *, clock: Clock | None = None,
                     notifier: Notifier | None = None) -> AsyncIterator[RunningDaemon]:
    """A daemon serving `settings` on the running loop until the block ends (then stopped in order).
    Raises what made its start-up fail."""
    async with serve_daemon(Daemon(settings, clock=clock, notifier=notifier)) as running:
        yield running


@contextlib.asynccontextmanager
async def serve_daemon(daemon: Daemon) -> AsyncIterator[RunningDaemon]:
    """`run_daemon` for a Daemon already built (a test that sets it up before it starts)."""
    loop = asyncio.get_running_loop()
    log = ErrorRecords()
    logging.getLogger("escapement").addHandler(log)
    handler = loop.get_exception_handler()
    running = RunningDaemon(daemon, loop.create_task(daemon.serve(), name="daemon"), log)

    def on_error(loop: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        running.loop_errors.append(ctx)
        loop.default_exception_handler(ctx)  # logs it (ERROR, "asyncio"): the test fails unless expected

    loop.set_exception_handler(on_error)
    try:
        started = loop.create_task(daemon.started.wait())
        try:
            await asyncio.wait({started, running.serving}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the test was cancelled while the daemon started
            daemon.request_stop()
            await asyncio.gather(running.serving, return_exceptions=True)
            raise
        finally:
            started.cancel()
        if not daemon.started.is_set():
            await running.serving  # raises the start-up's error
            raise RuntimeError("the daemon stopped before it was started")
        try:
            yield running
        finally:
            daemon.request_stop()
            await asyncio.shield(running.serving)
    finally:
        # the daemon made its worker pool the loop's default executor and shut it down: a loop the
        # test goes on using (asyncio.to_thread) gets a plain one back
        loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="loop-default"))
        loop.set_exception_handler(handler)
        logging.getLogger("escapement").removeHandler(log)


# ------------------------------------------------------------------ a daemon as a subprocess


class DaemonProcess:
    """`python -m daemon serve ARGS` with its log (stderr) read on a thread: waits on log lines,
    never sleeps. `args` is everything after `serve` (`--config FILE`, or flags such as
    `--models DIR --socket PATH`); `env` is added to the test's environment."""

    def __init__(self, args: list[str], *, socket_path: str = "", cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.socket = socket_path
        self.scenario = ""  # what the test set up this daemon for, for its figures
        self.proc = subprocess.Popen([sys.executable, "-m", "daemon", "serve", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, cwd=cwd,
                                     env={**os.environ, **env} if env else None)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.eof = False
        # The log must be read all the time: a full pipe would block the daemon's logging.
        self.reader = threading.Thread(target=self.read_log, name="daemon-log", daemon=True)
        self.reader.start()
        self.http_port: int | None = None

    @classmethod
    def with_config(cls, config: Path, socket_path: str = "", cwd: Path | None = None,
                    env: dict[str, str] | None = None) -> DaemonProcess:
        return cls(["--config", str(config)], socket_path=socket_path, cwd=cwd, env=env)

    def read_log(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60.0) -> re.Match[str]:
        """Block until a log line matches `pattern` (a regex); raises with the log if the daemon exits first."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = end - time.monotonic()
                if self.eof or left <= 0:
                    raise AssertionError(f"no log line matched {pattern!r}:\n" + "".join(self.lines[-60:]))
                self.cond.wait(left)

    def start(self, timeout: float = 120.0, http: bool = True) -> DaemonProcess:
        """Wait until it is ready (its HTTP port read from the log, unless `http` is False)."""
        if http:
            self.http_port = int(self.wait_for(r"HTTP listening on [^:]+:(\d+)", timeout).group(1))
        self.wait_for(r"escapement\.server: ready:", timeout)
        return self

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    def poll(self) -> int | None:
        return self.proc.poll()

    def rss_bytes(self) -> int:
        return _status_kib(self.proc.pid, "VmRSS") * 1024

    def peak_rss_bytes(self) -> int:
        return _status_kib(self.proc.pid, "VmHWM") * 1024

    def send_signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        self.reader.join(timeout)
        self.close_pipe()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.reader.join(30)
        self.close_pipe()

    def close_pipe(self) -> None:
        if self.proc.stderr is not None and not self.reader.is_alive():
            self.proc.stderr.close()

    def log(self) -> str:
        with self.cond:
            return "".join(self.lines)

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)
