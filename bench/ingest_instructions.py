"""Instructions the controller process spends per request with a frontend worker, counted by callgrind.

The controller loop's CPU per request with frontend workers on (issue 15) is ~50-110 µs on this
machine, and timings of one tree differ by ±15-30% rep to rep: a change of a few percent to the
loop's glue cannot be seen by timing. An instruction count can. The daemon of TREE runs under
callgrind with instrumentation off through start-up (torch's import) and a warm-up; it is switched
on (`callgrind_control -i on`) for REQUESTS requests, sent by CLIENTS closed-loop clients over the
socket or HTTP binary through one frontend worker (the worker is not under callgrind), then
dumped. Reported: instructions per request of the controller process's main thread (the event
loop: the link's records, the gateway, the compiled controller, runs on the latency path,
answers) and of all its threads. The latency path's bound is raised to its maximum, so that a lone
request runs on the loop as it does at full speed (under callgrind its estimate is ~50x longer).
The frontend's 5 ms state tick is counted too: it runs per second, not per request, so under
callgrind's slowdown it comes ~30x more often per request than at full speed (~13-18k instructions
a request here, under 1k at full speed), and more on a busy machine (a slower run): the figure
`loop_instructions_per_request_less_tick` leaves it out (the tick's own inclusive count).
One client keeps every request alone (a batch of one on
the latency path), which makes the count repeatable (±1% run to run); more clients batch by
timing, and under callgrind the daemon runs ~50x slower than its clients, so their batches are
larger than real.

    python -m bench.ingest_instructions TREE [--protocol socket|http] [--clients 1]
        [--requests 2000] [--warm 300] [--latency-path on|off] [--out FILE.json]

`--latency-path off` counts the loop as a GPU node has it: every run on the device's thread, the
loop handing each INFER over and taking its result back (the latency path runs only on CPU
devices, so on a GPU the model's own work is never on the loop).

Needs valgrind. A run takes ~3-5 minutes (start-up under valgrind). For an A/B, run it for each
tree; the counts compare exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import servers
from bench.scenarios.common import http_binary, socket_frame, spec_of
from bench.scenarios.ingest import MODEL, _build_repo


async def _socket_client(path: str, frame: Any, quota: list[int], counts: list[int]) -> None:
    reader, writer = await asyncio.open_unix_connection(path)
    i = 0
    try:
        while quota[0] > 0:
            quota[0] -= 1
            i += 1
            writer.write(frame.with_id(i))
            n = int.from_bytes(await reader.readexactly(4), "big")
            answer = await reader.readexactly(n)
            counts[0 if b"\xa6status\xcc\xc8" in answer else 1] += 1
    finally:
        writer.close()


async def _http_client(port: int, request: bytes, quota: list[int], counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while quota[0] > 0:
            quota[0] -= 1
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
            counts[0 if head.startswith(b"HTTP/1.1 200") else 1] += 1
    finally:
        writer.close()


def _drive(protocol: str, server: servers.Escapement, spec: Any, clients: int, n: int) -> list[int]:
    """`n` requests from `clients` closed-loop clients; [answered 200, other]."""
    quota, counts = [n], [0, 0]

    async def go() -> None:
        if protocol == "http":
            raw = http_binary(spec).raw
            await asyncio.gather(*(_http_client(server.port, raw, quota, counts) for _ in range(clients)))
        else:
            frame = socket_frame(spec)
            await asyncio.gather(*(_socket_client(server.socket, frame, quota, counts) for _ in range(clients)))
    asyncio.run(go())
    return counts


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def _totals(path: Path) -> int:
    """A dump's instruction total: its `totals:` line (its `summary:` line is 0 where
    instrumentation was switched on after the start)."""
    total = 0
    for line in path.read_text().splitlines():
        m = re.match(r"totals:\s+(\d+)", line)
        if m:
            total = int(m.group(1))
    return total


def _tick(dump: Path) -> int:
    """Instructions of a dump spent in the frontend's state tick (`FrontendWorkers._on_tick`, with
    what it calls, and its timer's re-arming), by callgrind_annotate's inclusive count."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
                         capture_output=True, text=True, timeout=600).stdout
    total = 0
    for line in out.splitlines():
        # (the compiled entry point called from the timer: inclusive of the tick's whole work)
        if re.search(r":CPyPy_frontends___FrontendWorkers____on_tick\b", line):
            total += int(line.split()[0].replace(",", ""))
    return total


def measure(tree: Path, protocol: str, clients: int, requests: int, warm: int, keep: str = "",
            latency_path: bool = True) -> dict[str, Any]:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind (callgrind and callgrind_control)")
    with tempfile.TemporaryDirectory(prefix="ingest-instr-") as tmp:
        repo = _build_repo(Path(tmp) / "repo")
        # (a generous SLO: under callgrind a request takes ~50x longer; none may miss for that)
        cfg = repo / MODEL / "config.toml"
        cfg.write_text(cfg.read_text().replace("slo_ms = 100.0", "slo_ms = 60000.0"))
        spec = spec_of(repo, MODEL)
        out = Path(tmp) / "cg"
        out.mkdir()
        prefix = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                  f"--callgrind-out-file={out}/cg.%p"]
        servers.ROOT = tree
        with servers.Escapement(repo, prefix=prefix, server={"frontend_workers": 1, "shed_lag_ms": 0},
                                # (a lone request's run is estimated ~50x longer under callgrind: the
                                # latency path's bound is raised so that it runs on the loop as at full speed)
                                controller={"latency_path_max_ms": 100.0, "latency_path": latency_path},
                                log_file=Path(tmp) / "daemon.log") as server:
            pid = str(server.pid)
            warmed = _drive(protocol, server, spec, clients, warm)
            _control("-i", "on", pid)
            t0 = time.monotonic()
            counted = _drive(protocol, server, spec, clients, requests)
            wall = time.monotonic() - t0
            _control("-i", "off", pid)
            _control("-d", pid)
            dumps = sorted(out.glob(f"cg.{pid}*"))
            per_thread = {p.name: _totals(p) for p in dumps}
            tick = sum(_tick(p) for p in dumps if p.name.endswith("-01"))
            if keep:
                shutil.copytree(tmp, keep, dirs_exist_ok=True)
        # the main thread's dump is the one of thread 1 (`-01`); a thread that ran nothing has 0
        main = sum(v for k, v in per_thread.items() if k.endswith("-01"))
        total = sum(per_thread.values())
    return {"tree": str(tree), "protocol": protocol, "clients": clients, "requests": requests,
            "latency_path": latency_path,
            "warm_answered": warmed[0], "answered": counted[0], "failed": counted[1], "wall_s": wall,
            "loop_instructions_per_request": main / max(counted[0], 1),
            # less the frontend's 5 ms state tick: it runs per second of wall time, not per
            # request, so its share here depends on how slowly the run went (a busy machine, more
            # ticks); this figure compares across runs on a shared machine
            "loop_instructions_per_request_less_tick": (main - tick) / max(counted[0], 1),
            "process_instructions_per_request": total / max(counted[0], 1),
            "threads": per_thread}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree")
    ap.add_argument("--protocol", choices=("socket", "http"), default="socket")
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=300)
    ap.add_argument("--out", default="")
    ap.add_argument("--keep", default="", help="copy the dumps and the daemon's log to this folder")
    ap.add_argument("--latency-path", choices=("on", "off"), default="on",
                    help="off: every run on the device's thread, as on a GPU (the path runs on CPU devices only)")
    a = ap.parse_args()
    r = measure(Path(a.tree).resolve(), a.protocol, a.clients, a.requests, a.warm, a.keep, a.latency_path == "on")
    print(json.dumps({k: v for k, v in r.items() if k != "threads"}, indent=1))
    print("threads:", r["threads"])
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
