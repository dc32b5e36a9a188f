"""Test support: tiny models, model repositories, settings, and `DaemonThread` (tests/harness.py's
`run_daemon` on a thread of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from daemon.config import Settings, settings_from_dict
from daemon.demo import save_model
from daemon.server import Daemon
from tests.harness import ErrorRecords, RunningDaemon, new_event_loop, serve_daemon


class TinyLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
            self.fc.bias.copy_(torch.tensor([0.5, -0.5, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class AllTypes(nn.Module):
    """One input and one output of every datatype the daemon supports."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor, e: torch.Tensor,
                f: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.logical_not(a), b + 1, c * 2, d - 1, e * 2, f / 2


ALL_TYPES = [("a", "BOOL", torch.bool), ("b", "UINT8", torch.uint8), ("c", "INT32", torch.int32),
             ("d", "INT64", torch.int64), ("e", "FP16", torch.float16), ("f", "FP64", torch.float64)]


def tiny_config(inp: int = 4, out: int = 3, max_batch: int = 8, slo_ms: float = 1000.0) -> str:
    return f"""max_batch_size = {max_batch}
slo_ms = {slo_ms}
[[inputs]]
name = "INPUT__0"
datatype = "FP32"
shape = [-1, {inp}]
[[outputs]]
name = "OUTPUT__0"
datatype = "FP32"
shape = [-1, {out}]
"""


def all_types_config() -> str:
    parts = ["max_batch_size = 4", "slo_ms = 1000"]
    for name, dt, _ in ALL_TYPES:
        parts += ["[[inputs]]", f'name = "{name}"', f'datatype = "{dt}"', "shape = [-1, 3]"]
    for name, dt, _ in ALL_TYPES:
        parts += ["[[outputs]]", f'name = "out_{name}"', f'datatype = "{dt}"', "shape = [-1, 3]"]
    return "\n".join(parts) + "\n"


def build_test_repo(root: Path) -> Path:
    """Good and broken entries: tiny_pt2, tiny_ts (two versions), all_types, and four broken ones."""
    root.mkdir(parents=True, exist_ok=True)
    model = TinyLinear().eval()
    x = torch.zeros(2, 4)
    for name, fmt in (("tiny_pt2", "pt2"), ("tiny_ts", "ts")):
        save_model(model, fmt, x, 8, root / name / "1" / f"model.{fmt}")
        (root / name / "config.toml").write_text(tiny_config(), encoding="utf-8")
    save_model(model, "ts", x, 8, root / "tiny_ts" / "2" / "model.ts")

    batch = torch.export.Dim("batch", min=1, max=4)
    args = tuple(torch.zeros(2, 3, dtype=t) for _, _, t in ALL_TYPES)
    ep = torch.export.export(AllTypes().eval(), args, dynamic_shapes=tuple({0: batch} for _ in ALL_TYPES))
    (root / "all_types" / "1").mkdir(parents=True)
    torch.export.save(ep, str(root / "all_types" / "1" / "model.pt2"))
    (root / "all_types" / "config.toml").write_text(all_types_config(), encoding="utf-8")

    # Broken entries: each must be reported and must not stop the others.
    (root / "no_config" / "1").mkdir(parents=True)
    save_model(model, "pt2", x, 8, root / "no_config" / "1" / "model.pt2")
    (root / "garbage" / "1").mkdir(parents=True)
    (root / "garbage" / "1" / "model.pt2").write_bytes(b"this is not a model")
    (root / "garbage" / "config.toml").write_text(tiny_config(), encoding="utf-8")
    save_model(model, "pt2", x, 8, root / "wrong_shape" / "1" / "model.pt2")
    (root / "wrong_shape" / "config.toml").write_text(tiny_config(inp=5), encoding="utf-8")
    (root / "bad_toml" / "1").mkdir(parents=True)
    (root / "bad_toml" / "config.toml").write_text("max_batch_size = [", encoding="utf-8")
    return root


def gpu_device() -> str:
    """The device `gpu`-marked tests run on: cuda:0, or the stand-in when ESCAPEMENT_TEST_GPU=emucuda
    (`bench/gpu/check.sh --standin` runs the GPU flow on a CPU machine this way)."""
    return "emucuda:0" if os.environ.get("ESCAPEMENT_TEST_GPU") == "emucuda" else "cuda:0"


def short_tmpdir() -> Path:
    """A short directory for unix sockets (paths are limited to 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="esc-", dir="/tmp"))


def settings(repo: Path, sock_dir: Path, **sections: dict[str, Any]) -> Settings:
    data: dict[str, Any] = {
        # tests call management endpoints on their loopback listener, and inject faults
        # one process unless a test asks for frontend workers (the default depends on the cores)
        "server": {"http": "127.0.0.1:0", "socket": str(sock_dir / "d.sock"), "log_level": "warning",
                   "admin_open_loopback": True, "allow_faults": True, "frontend_workers": 0},
        "models": {"repository": str(repo)},
        "runtime": {"devices": ["cpu:0"]},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return settings_from_dict(data)


class DaemonThread:
    """A daemon served by `run_daemon` (tests/harness.py: the real start-and-serve path) on an event
    loop and a thread of its own, so blocking clients can call it from the test.

    `with DaemonThread(settings) as dt:` starts it and stops it in order; `dt.daemon` exists before
    the start, for a test that sets it up first (its notifier)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.daemon = Daemon(settings)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: RunningDaemon | None = None  # once started
        self.thread = threading.Thread(target=self.run, name="daemon", daemon=True)
        self.ready = threading.Event()  # started, or failed to
        self.error: BaseException | None = None  # what ended it (a failed start-up)

    @property
    def log(self) -> ErrorRecords:
        """ERROR (and worse) records of the daemon's loggers while it ran."""
        return self.running.log if self.running is not None else ErrorRecords()

    @property
    def loop_errors(self) -> list[dict[str, Any]]:
        """What reached the loop's exception handler."""
        return self.running.loop_errors if self.running is not None else []

    @property
    def errors(self) -> list[str]:
        """Every ERROR the daemon logged and every exception that reached its loop."""
        return self.running.errors if self.running is not None else []

    def run(self) -> None:
        loop = new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self.serve())
        finally:
            loop.close()

    async def serve(self) -> None:
        try:
            async with serve_daemon(self.daemon) as running:
                self.running = running
                self.ready.set()
                await running.wait_stopped()  # asked to (stop()), or by itself
        except BaseException as e:
            self.error = e
        finally:
            self.ready.set()

    def start(self, timeout: float = 120) -> DaemonThread:
        self.thread.start()
        if not self.ready.wait(timeout):
            raise TimeoutError("the daemon did not start")
        if self.error is not None:
            raise self.error
        return self

    def on_loop(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        """Run a coroutine on the daemon's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        """Run a plain function on the daemon's loop and return its result."""
        async def go() -> Any:
            return fn(*args)
        return self.on_loop(go(), 30)

    def wait_idle(self, timeout: float = 30) -> int:
        """Wait (on the controller's own event) until no request is pending, no action is in flight
        and no coding group is left; returns pending."""
        assert self.running is not None
        return int(self.on_loop(asyncio.wait_for(self.running.wait_idle(), timeout), timeout + 5))

    def wait_stopped(self, timeout: float = 60) -> bool:
        """Wait for the daemon to stop by itself (every device lost); whether it has."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self, timeout: float = 60) -> None:
        if self.loop is not None and self.thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the daemon stopped itself
                self.loop.call_soon_threadsafe(self.daemon.request_stop)
        self.thread.join(timeout)

    def __enter__(self) -> DaemonThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.daemon.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.daemon.grpc_port}"

    @property
    def socket(self) -> str:
        return self.settings.server.socket


@contextlib.contextmanager
def parity_daemon_on_three_cpus(demo_repo: Path) -> Iterator[DaemonThread]:
    """digits_mlp (with its k=2 parity model) preloaded on cpu:0 and cpu:1, the parity on cpu:2, in a
    daemon of its own: a fault leaves estimates behind it, so tests must not share one."""
    d = short_tmpdir()
    repo = d / "repo"
    shutil.copytree(demo_repo / "digits_mlp", repo / "digits_mlp")
    cfg = repo / "digits_mlp" / "config.toml"
    cfg.write_text("preload_replicas = 2\n" + cfg.read_text())
    try:
        with DaemonThread(settings(repo, d, runtime={"devices": ["cpu:0", "cpu:1", "cpu:2"]})) as dt:
            yield dt
    finally:
        shutil.rmtree(d, ignore_errors=True)
