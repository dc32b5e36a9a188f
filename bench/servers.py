"""Servers under test as separate processes: escapement (and, in peers.py, the peers).

Each server runs in its own process so it has its own GIL and its CPU time can be read from
/proc: every result says how many cores the server and the generator used.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores used by a process between start() and stop()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._t0 = self._c0 = 0.0

    def start(self) -> None:
        self._t0, self._c0 = time.monotonic(), cpu_seconds(self.pid)

    def stop(self) -> float:
        wall = time.monotonic() - self._t0
        return (cpu_seconds(self.pid) - self._c0) / wall if wall > 0 else 0.0


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


class Escapement:
    """`escapement serve` in a child process on an ephemeral port and a private socket."""

    def __init__(self, repo: str | Path, faults: list[dict[str, Any]] | None = None,
                 log_file: str | Path | None = None, tree: str | Path | None = None,
                 prefix: Sequence[str] = (), **sections: dict[str, Any]) -> None:
        self.prefix = list(prefix)  # a command the daemon runs under (valgrind, for a count of instructions)
        self.tree = Path(tree) if tree is not None else ROOT  # whose code runs (an older checkout for an A/B)
        self.log_file = Path(log_file) if log_file is not None else None  # every line, where kept
        self.dir = Path(tempfile.mkdtemp(prefix="escb-", dir="/tmp"))
        self.socket = str(self.dir / "d.sock")
        cfg: dict[str, dict[str, Any]] = {
            "server": {"http": "127.0.0.1:0", "socket": self.socket, "log_level": "info"},
            "models": {"repository": str(repo)},
            "runtime": {"devices": ["cpu:0"]},
        }
        for k, v in sections.items():
            cfg.setdefault(k, {}).update(v)
        cfg["server"]["log_level"] = "info"  # start() reads the port and readiness from the info log
        self.config = cfg
        text = "".join(f"[{sec}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in t.items()) for sec, t in cfg.items())
        text += "".join("[[faults]]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in f.items()) for f in faults or ())
        (self.dir / "bench.toml").write_text(text)
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.log: deque[str] = deque(maxlen=200)
        self._drainer: threading.Thread | None = None

    def __enter__(self) -> Escapement:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 300) -> None:
        cmd = [*self.prefix, sys.executable, "-m", "daemon", "serve", "--config", str(self.dir / "bench.toml")]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=self.tree)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        for line in self.proc.stderr:
            self._keep(line)
            m = re.search(r"HTTP listening on [^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
            if "escapement.server: ready:" in line:
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("escapement exited during start-up:\n" + "".join(self.log))
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self._keep(line)

    def _keep(self, line: str) -> None:
        self.log.append(line)
        if self.log_file is not None:
            with self.log_file.open("a") as f:
                f.write(line)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the daemon (no drain, no close): `start()` starts it again on the same files."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        if self._drainer is not None:
            self._drainer.join(10)  # it ends at the pipe's EOF
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            if self._drainer is not None:
                self._drainer.join(10)  # it ends at the pipe's EOF
            self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)
