"""Python-level calls the daemon makes per request, by thread: where interpreted code still runs.

With the controller compiled (daemon/native), what remains interpreted on a request's path is
invisible in a callgrind listing (one `_PyEval_EvalFrameDefault` for all of it) and costs ~1k
instructions a call. This starts the daemon with a profile hook (`sys.setprofile` and
`threading.setprofile`, installed by a `sitecustomize` put first on its PYTHONPATH), sends WARM
requests, then counts every Python function call on every thread while REQUESTS more run (one
closed-loop client through one frontend worker, the null model of the ingest scenario), and prints
the calls per thread and function, most frequent first. Compiled functions make no such call, so
on a fully compiled path the list holds only what runs per second (the frontend's state tick),
not per request.

    python -m bench.pycalls [--protocol socket|http] [--requests 1000] [--warm 300]
        [--latency-path on|off] [--top 40]

(issue 15: found asyncio's `Event.set`/`clear`, a plain Enum's `__hash__` and `tensor_bytes` on the
loop, and `torch.inference_mode`, `nn.Module.__call__` and the fault hooks on the device's thread:
bench/results/ingest-instructions-issue15.md.)
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

from bench import servers
from bench.ingest_instructions import _drive
from bench.scenarios.common import spec_of
from bench.scenarios.ingest import MODEL, _build_repo

# Installed in the daemon's interpreter: SIGUSR2 starts counting, the next one writes the counts
# (thread name, file, line, function) to $ESCAPEMENT_PYCALLS and stops.
_HOOK = '''
import os, sys, signal, threading, collections
_out = os.environ.get("ESCAPEMENT_PYCALLS")
if _out:
    _counts = collections.Counter()
    _on = [False]
    def _prof(frame, event, arg):
        if event == "call" and _on[0]:
            c = frame.f_code
            _counts[(threading.current_thread().name, c.co_filename, c.co_firstlineno, c.co_name)] += 1
    def _toggle(signum, frame):
        if _on[0]:
            _on[0] = False
            with open(_out, "w") as f:
                for (thread, path, line, name), n in _counts.most_common():
                    f.write(f"{n}\\t{thread}\\t{path}:{line}\\t{name}\\n")
        else:
            _counts.clear()
            _on[0] = True
    signal.signal(signal.SIGUSR2, _toggle)
    sys.setprofile(_prof)
    threading.setprofile(_prof)
'''


def measure(protocol: str, requests: int, warm: int, latency_path: bool) -> list[tuple[int, str, str, str]]:
    with tempfile.TemporaryDirectory(prefix="pycalls-") as tmp:
        hook = Path(tmp) / "hook"
        hook.mkdir()
        (hook / "sitecustomize.py").write_text(_HOOK)
        out = Path(tmp) / "calls.tsv"
        repo = _build_repo(Path(tmp) / "repo")
        spec = spec_of(repo, MODEL)
        saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "ESCAPEMENT_PYCALLS")}
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook), saved["PYTHONPATH"]) if p)
        os.environ["ESCAPEMENT_PYCALLS"] = str(out)
        try:
            with servers.Escapement(repo, server={"frontend_workers": 1},
                                    controller={"latency_path": latency_path}) as server:
                _drive(protocol, server, spec, 1, warm)
                os.kill(server.pid, signal.SIGUSR2)
                answered, failed = _drive(protocol, server, spec, 1, requests)
                os.kill(server.pid, signal.SIGUSR2)
                deadline = time.monotonic() + 30
                while not out.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if not out.exists():
            raise SystemExit("the daemon wrote no counts (was the hook imported?)")
        rows = []
        for line in out.read_text().splitlines():
            n, thread, where, name = line.split("\t")
            rows.append((int(n), thread, where, name))
    print(f"{answered} answered, {failed} failed")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--protocol", choices=("socket", "http"), default="socket")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=300)
    ap.add_argument("--latency-path", choices=("on", "off"), default="off")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    rows = measure(a.protocol, a.requests, a.warm, a.latency_path == "on")
    print(f"Python-level calls per request ({a.requests} requests, {a.protocol}, latency path {a.latency_path}):")
    root = str(servers.ROOT) + "/"
    for n, thread, where, name in rows[: a.top]:
        print(f"{n / a.requests:8.3f}  {thread[:16]:16}  {name:24}  {where.replace(root, '')}")


if __name__ == "__main__":
    main()
