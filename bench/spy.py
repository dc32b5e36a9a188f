"""Sample a running daemon with py-spy while a load runs: which Python functions of which thread
hold its CPU (issue 11: on an H200 the controller process stopped at one core).

    with Spy(pid, seconds, out_path) as spy:   # no-op where py-spy is not installed
        ... run the load ...
    spy.summary  # {thread: {"samples": n, "share": s, "top": [[frame, share], ...]}} or {}

py-spy is found on PATH, beside this interpreter (a venv's bin/), or under a `bin/` of any
PYTHONPATH entry (where `pip install --target DIR` puts it: the GPU machine's carried wheels).
It samples without stopping the process (`--nonblocking`), 250 times a second, every thread that
is running (`--threads`; idle ones are left out), and writes the raw stacks to `out_path`.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

RATE_HZ = 250


def find() -> str | None:
    """The py-spy executable, or None."""
    here = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if here:
        return here
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        candidate = Path(entry) / "bin" / "py-spy"
        if entry and candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


class Spy:
    def __init__(self, pid: int, seconds: float, out: Path, top: int = 8) -> None:
        self.pid, self.seconds, self.out, self.top = pid, seconds, out, top
        self.summary: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Spy:
        exe = find()
        if exe is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._proc = subprocess.Popen(
                [exe, "record", "--nonblocking", "--threads", "-r", str(RATE_HZ),
                 "-d", str(max(1, round(self.seconds))), "-f", "raw", "-o", str(self.out), "--pid", str(self.pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._proc is None:
            return
        try:
            _, err = self._proc.communicate(timeout=self.seconds + 30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        if self.out.exists():
            self.summary = summarize(self.out.read_text(errors="replace"), self.top)
        elif err:
            self.summary = {"error": err.decode(errors="replace").strip()[-300:]}


def summarize(raw: str, top: int = 8) -> dict[str, Any]:
    """Per thread (py-spy's raw format: `thread (tid): name;frame;...;frame count` a line): its
    samples, its share of all, and its busiest frames by self samples."""
    per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or n == "0":
            continue
        thread, *frames = stack.split(";")
        per[_thread_name(thread)][short_frame(frames[-1]) if frames else "(no Python frame)"] += int(n)
    total = sum(sum(c.values()) for c in per.values()) or 1
    out: dict[str, Any] = {}
    for name, frames in sorted(per.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(frames.values())
        out[name] = {"samples": n, "share": round(n / total, 4),
                     "top": [[f, round(k / n, 4)] for f, k in frames.most_common(top)]}
    return out


def _thread_name(label: str) -> str:
    # "thread (0x7f..): cuda:0/infer" or "thread (123)" -> the name where there is one
    _, _, name = label.partition("): ")
    return name.strip() or label.strip()


def short_frame(frame: str, line: bool = True) -> str:
    """"func (path/to/file.py:123)" -> "func (to/file.py:123)", or without the line ("func
    (to/file.py)": one row per function where lines would split it)."""
    name, _, where = frame.partition(" (")
    path, _, number = where.rstrip(")").rpartition(":")
    if not path:
        return frame
    return f"{name} ({'/'.join(Path(path).parts[-2:])}{':' + number if line else ''})"


def markdown(summary: dict[str, Any], title: str) -> list[str]:
    """Lines: per thread its share of the samples and its busiest frames."""
    if not summary:
        return []
    if "error" in summary:
        return ["", f"{title}: py-spy failed: {summary['error']}"]
    lines = ["", f"{title} (py-spy, {RATE_HZ} Hz, running threads; share of samples):", "",
             "| thread | share | busiest frames (share of the thread's samples) |", "|---|---|---|"]
    for name, t in summary.items():
        frames = "; ".join(f"`{f}` {s:.0%}" for f, s in t["top"])
        lines.append(f"| {name} | {t['share']:.0%} | {frames} |")
    return lines
