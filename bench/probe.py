"""A watcher of a running daemon, in a process of its own: health latency, RSS, descriptors.

`python -m bench.probe --port P --pid PID --out FILE [--interval 0.02] [--path /v2/health/ready]`
sends GET `path` on one keep-alive connection every `interval` seconds, and reads the daemon's
VmRSS, its open file descriptors and how many of them are sockets from /proc at the same
moments, until SIGTERM; then it writes the samples as JSON.

It is a separate process, standard library only, so what it measures is the daemon, not the
load generator's event loop (whose own lag would be added to every probe it made).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import time
from pathlib import Path
from typing import Any


def status_kib(pid: int, field: str) -> int:
    """A memory line of /proc/<pid>/status (VmRSS, VmHWM, ...) in KiB; -1 when absent."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def rss_kib(pid: int) -> int:
    return status_kib(pid, "VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def socket_count(pid: int) -> int:
    """Open sockets of a process: its listeners and its connections (a descriptor closed while
    being read is skipped)."""
    n = 0
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            n += os.readlink(f"{base}/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probe")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--path", default="/v2/health/ready")
    ap.add_argument("--timeout", type=float, default=5.0, help="a probe unanswered this long counts as failed")
    args = ap.parse_args(argv)
    stop = False

    def on_term(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    samples: dict[str, list[Any]] = {"t": [], "health_ms": [], "status": [], "rss_kib": [], "fds": [], "sockets": []}
    conn: http.client.HTTPConnection | None = None
    while not stop:
        t0 = time.monotonic()
        status, ms = -1, None
        try:
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=args.timeout)
            conn.request("GET", args.path)
            resp = conn.getresponse()
            resp.read()
            status, ms = resp.status, (time.monotonic() - t0) * 1e3
        except (OSError, http.client.HTTPException):
            if conn is not None:
                conn.close()
            conn = None  # a fresh connection next time; this probe counts as failed
        try:
            rss, fds, socks = rss_kib(args.pid), fd_count(args.pid), socket_count(args.pid)
        except OSError:  # the daemon is gone
            rss, fds, socks = -1, -1, -1
        for k, v in (("t", t0), ("health_ms", ms), ("status", status), ("rss_kib", rss), ("fds", fds),
                     ("sockets", socks)):
            samples[k].append(v)
        time.sleep(max(0.0, t0 + args.interval - time.monotonic()))
    if conn is not None:
        conn.close()
    Path(args.out).write_text(json.dumps(samples))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
