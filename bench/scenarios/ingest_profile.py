"""Where the controller process's loop (and a frontend worker's) spends its time per request.

Not a registered scenario: `python -m bench.scenarios.ingest_profile [--protocol http|socket|grpc]
[--seconds 8] [--workers 1] [--out DIR]`. It starts the daemon on the ingest scenario's null model
with frontend workers, drives it with the ingest scenario's closed-loop clients and samples the
controller's main thread and the worker's with py-spy (`--nonblocking`, 1 kHz) meanwhile. It prints,
per process, the share of the loop thread's samples by self frame and by the inclusive frames
that matter (the controller's step, the link, the gateway), and CPU µs per request of each loop
thread from /proc (schedstat), so that a share converts to µs per request.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import pstats
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.ingest_clients import grpc_clients, http_client, socket_client
from bench.scenarios.common import http_binary, socket_frame, spec_of
from bench.scenarios.ingest import (
    MODEL,
    _build_repo,
    _grpc_port,
    _thread_cpu_ns,
    grpc_infer_message,
)
from bench.servers import ROOT, Escapement
from bench.spy import short_frame


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _load(protocol: str, server: Escapement, spec: Any, clients: int, seconds: float, counts: list[int]) -> None:
    request = http_binary(spec).raw
    frame = socket_frame(spec)

    async def go() -> None:
        stop = time.monotonic() + seconds
        if protocol == "http":
            await asyncio.gather(*(http_client(server.port, request, stop, counts) for _ in range(clients)))
        elif protocol == "grpc":
            await grpc_clients(_grpc_port(server), grpc_infer_message(spec), stop, counts, clients)
        else:
            await asyncio.gather(*(socket_client(server.socket, frame, stop, counts) for _ in range(clients)))

    uvloop.run(go())


def _main_thread_stacks(raw: str) -> list[tuple[list[str], int]]:
    """py-spy raw lines ("thread (TID): NAME;frame;... count") of the main thread (the event loop's)."""
    out = []
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not frames[0].endswith("MainThread"):
            continue
        out.append((frames[1:] or ["<no Python frame> (uvloop)"], int(n)))
    return out


def summarize(stacks: list[tuple[list[str], int]], us_per_request: float, top: int = 30) -> str:
    total = sum(n for _, n in stacks) or 1
    self_by: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        self_by[short_frame(frames[-1], line=False)] += n
        for f in {short_frame(f, line=False) for f in frames}:
            incl[f] += n
    lines = [f"samples {total}; loop thread {us_per_request:.1f} us/request (schedstat)", "",
             "| self frame | share | us/request |", "|---|---|---|"]
    for f, n in self_by.most_common(top):
        lines.append(f"| `{f}` | {n / total:.1%} | {n / total * us_per_request:.1f} |")
    lines += ["", "| inclusive frame | share | us/request |", "|---|---|---|"]
    for f, n in incl.most_common(top * 2):
        if n / total < 0.01:
            break
        lines.append(f"| `{f}` | {n / total:.1%} | {n / total * us_per_request:.1f} |")
    return "\n".join(lines)


def profile(protocol: str, seconds: float, workers: int, clients: int, out: Path,
            syscalls: bool = False, perf: bool = False, cprofile: bool = False) -> dict[str, Any]:
    spy = str(ROOT / ".venv" / "bin" / "py-spy")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ingest-prof-") as tmp:
        repo = _build_repo(Path(tmp) / "repo")
        spec = spec_of(repo, MODEL)
        hook = ROOT / "bench" / "scenarios" / "_profile_hook"
        env = {"ESCAPEMENT_CPROFILE": str(out), "PYTHONPATH": f"{hook}:{ROOT}"} if cprofile else {}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the daemon (and its workers) inherit it
        server = Escapement(repo, server={"frontend_workers": workers,
                                          **({"grpc": "127.0.0.1:0"} if protocol == "grpc" else {})})
        with server:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            pids = {"controller": server.pid}
            kids = _children(server.pid)
            if kids:
                pids["worker"] = kids[0]
            counts = [0, 0]
            _load(protocol, server, spec, clients, 1.5, [0, 0])  # warm-up
            t = threading.Thread(target=_load, args=(protocol, server, spec, clients, seconds + 1.0, counts))
            cpu0 = {k: _thread_cpu_ns(p, p) for k, p in pids.items()}
            t.start()
            if cprofile:
                for p in pids.values():
                    os.kill(p, signal.SIGUSR1)
                time.sleep(seconds)  # the measured window (the load runs in its thread meanwhile)
                for p in pids.values():
                    os.kill(p, signal.SIGUSR2)
            spies = {} if cprofile else {
                k: subprocess.Popen([spy, "record", "--nonblocking", "--threads", "--format", "raw", "-r", "1000",
                                     "-d", str(int(seconds)), "-p", str(p), "-o", str(out / f"{protocol}-{k}.raw")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for k, p in pids.items()}
            if syscalls and not cprofile:  # the loop threads' syscalls (strace -c: exact counts, inflated times)
                spies.update({f"{k}-strace": subprocess.Popen(
                    ["timeout", "-s", "INT", str(int(seconds)), "strace", "-c",
                     "-o", str(out / f"{protocol}-{k}.strace"), "-p", str(p)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k, p in pids.items()})
            if perf and not cprofile:  # on-CPU samples only (py-spy also counts a runnable, preempted thread)
                spies.update({f"{k}-perf": subprocess.Popen(
                    ["perf", "record", "-q", "-e", "task-clock", "-F", "2000", "-t", str(p),
                     "-o", str(out / f"{protocol}-{k}.perf"), "--", "sleep", str(int(seconds))],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k, p in pids.items()})
            for s in spies.values():
                s.wait()
            t.join()
            cpu = {k: (_thread_cpu_ns(p, p) - cpu0[k]) / 1e3 for k, p in pids.items()}
    ok = counts[0]
    report: dict[str, Any] = {"requests": ok, "failed": counts[1]}
    for k in pids:
        us = cpu[k] / max(ok, 1)
        if cprofile:
            report[k] = us
            prof = out / f"{pids[k]}.prof"
            for _ in range(100):  # written by the process's SIGUSR2 handler, at its next bytecode
                if prof.exists():
                    break
                time.sleep(0.05)
            text = cprofile_summary(prof, ok)
            (out / f"{protocol}-{k}-cprofile.txt").write_text(text)
            print(f"## {protocol} {k} (pid {pids[k]}) cProfile (CPU clock)\n{text}\n")
            continue
        stacks = _main_thread_stacks((out / f"{protocol}-{k}.raw").read_text())
        text = summarize(stacks, us)
        (out / f"{protocol}-{k}.md").write_text(text + "\n")
        report[k] = us
        print(f"## {protocol} {k} (pid {pids[k]})\n{text}\n")
    return report


def cprofile_summary(path: Path, requests: int, top: int = 45) -> str:
    """pstats by own time and by cumulative time, in CPU us per request (requests over the whole run:
    the profiled window is most of it, so these are upper bounds; compare the shares)."""
    st = pstats.Stats(str(path))
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append((tt, ct, nc, f"{fn} ({'/'.join(Path(file).parts[-2:])}:{line})"))
    total = sum(r[0] for r in rows) or 1e-9
    out = [f"profiled CPU {total:.3f} s; share by own time (calls per request over the window)", "",
           "| function | own | cumulative | calls |", "|---|---|---|---|"]
    for tt, ct, nc, name in sorted(rows, reverse=True)[:top]:
        out.append(f"| `{name}` | {tt / total:.1%} | {ct / total:.1%} | {nc} |")
    out += ["", "| function (by cumulative) | cumulative | own |", "|---|---|---|"]
    for tt, ct, _, name in sorted(rows, key=lambda r: -r[1])[:top]:
        out.append(f"| `{name}` | {ct / total:.1%} | {tt / total:.1%} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", default="http", choices=("http", "socket", "grpc"))
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--out", default="/tmp/ingest-profile")
    ap.add_argument("--syscalls", action="store_true", help="also strace -c the loop threads (slows them)")
    ap.add_argument("--perf", action="store_true", help="also perf record the loop threads (on-CPU samples)")
    ap.add_argument("--cprofile", action="store_true",
                    help="instead of py-spy: cProfile on each loop thread's CPU clock (bench/scenarios/_profile_hook)")
    a = ap.parse_args()
    print(profile(a.protocol, a.seconds, a.workers, a.clients, Path(a.out), a.syscalls, a.perf, a.cprofile))


if __name__ == "__main__":
    main()
