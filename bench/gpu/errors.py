"""Where INFER prediction errors come from, read from a daemon's trace (`controller.trace_path`).

    python -m bench.gpu.errors TRACE.jsonl [--json OUT]

The many-models run on the H200 gave an INFER prediction error p99 of ~4 ms (|measured -
expected|, measured begin to end on the executor's thread) against INFERs of 0.5-1.8 ms, and
no way to tell why. Each INFER's trace line carries its host times and its device time (CUDA
events), so its error splits into the part the device took beyond the estimate and the host's
part (staging, launches, waiting for the GIL, polling). Each INFER is also put in the
circumstances suspected to cost it time:

- `during_load`: a LOAD on the same device ran meanwhile (its copy may hold the copy engine that
  the INFER's input copy needs, or its host work the GIL);
- `first_after_load`: the model's first INFER on that device after its LOAD (graphs just captured
  or replayed from the parking lot, caches cold);
- neither.

Per circumstance: count, p50/p99 of |error|, of its device part and of its host part (ms), and
its share of the INFERs whose error is in the top 1%. Used by `bench.gpu.manymodels`, which keeps
the summary and drops the trace.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from daemon.controller.estimates import DEFAULT_MAX_AGE, DEFAULT_WINDOW

CIRCUMSTANCES = ("during_load", "first_after_load", "neither")
GROSS_S = 0.002  # an estimate this far above the device time is looked into (`overestimates`)
WINDOW, WINDOW_AGE_S = DEFAULT_WINDOW, DEFAULT_MAX_AGE  # the estimator's defaults


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.array(xs), q)) * 1e3 if xs else None


def infers(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's successful INFERs that had an estimate, each with its circumstance and its error
    split into device and host parts (seconds)."""
    loads: dict[str, list[tuple[float, float]]] = defaultdict(list)  # device -> LOAD (begin, end), by begin
    loaded_at: dict[tuple[str, str], list[float]] = defaultdict(list)  # (model, device) -> LOAD ends
    for e in lines:
        if e.get("ev") == "action" and e.get("kind") == "LOAD" and e.get("status") == "OK" and e.get("end"):
            loads[e["device"]].append((e["begin"], e["end"]))
            loaded_at[(e["model"], e["device"])].append(e["end"])
    for v in loads.values():
        v.sort()
    for v in loaded_at.values():
        v.sort()
    seen: set[tuple[str, str, float]] = set()  # (model, device, its LOAD's end) whose first INFER was seen
    out = []
    for e in sorted((e for e in lines if e.get("ev") == "action" and e.get("kind") == "INFER"
                     and e.get("status") == "OK" and (e.get("expected") or 0) > 0), key=lambda e: e["begin"]):
        begin, end, dev = e["begin"], e["end"], e["device"]
        wall = end - begin
        device_s = e.get("duration") or 0.0
        spans = loads.get(dev, [])
        i = bisect.bisect_left(spans, (end, float("inf")))  # loads that began before this INFER ended
        during = any(b < end and en > begin for b, en in spans[max(0, i - 4):i])  # (a lane: one LOAD at a time)
        ends = loaded_at.get((e["model"], dev), [])
        j = bisect.bisect_right(ends, begin)
        first = False
        if j:
            mark = (e["model"], dev, ends[j - 1])
            first = mark not in seen
            seen.add(mark)
        what = "during_load" if during else "first_after_load" if first else "neither"
        out.append({"circumstance": what, "error": abs(wall - e["expected"]),
                    "device_part": device_s - e["expected"] if device_s else None,
                    "host_part": wall - device_s if device_s else None, "batch": e.get("batch"),
                    "model": e["model"], "device": dev, "begin": begin, "device_s": device_s,
                    "expected": e["expected"]})
    return out


def overestimates(rows: list[dict[str, Any]], gross_s: float = GROSS_S) -> dict[str, Any]:
    """INFERs whose device time fell short of the estimate by more than `gross_s`, and whether a
    recent slow run explains each: the estimator's window (controller/estimates.py: the last
    WINDOW runs of the model at that batch size on that device within WINDOW_AGE_S) held a device
    time within 10% of the estimate. If so, what that slow run's circumstance was: a cold run after
    a LOAD or one beside a LOAD lengthens the estimate of every run after it until it ages out."""
    recent: dict[tuple[str, str, Any], list[dict[str, Any]]] = defaultdict(list)
    gross = explained = 0
    causes: dict[str, int] = defaultdict(int)
    for r in rows:  # (in order of begin)
        key = (r["model"], r["device"], r["batch"])
        window = [w for w in recent[key] if r["begin"] - w["begin"] <= WINDOW_AGE_S][-WINDOW:]
        if r["device_s"] and r["expected"] - r["device_s"] > gross_s:
            gross += 1
            slow = [w for w in window if abs(w["device_s"] - r["expected"]) <= 0.1 * r["expected"]]
            if slow:
                explained += 1
                causes[slow[-1]["circumstance"]] += 1
        if r["device_s"]:
            window.append(r)
        recent[key] = window
    return {"gross_s": gross_s, "count": gross, "explained_by_a_recent_slow_run": explained,
            "slow_run_circumstances": dict(causes)}


def summarize(lines: list[dict[str, Any]]) -> dict[str, Any]:
    rows = infers(lines)
    if not rows:
        return {"infers": 0}
    cut = float(np.percentile([r["error"] for r in rows], 99))
    top = [r for r in rows if r["error"] >= cut]
    out: dict[str, Any] = {"infers": len(rows), "error_p99_ms": cut * 1e3, "by_circumstance": {}}
    for what in CIRCUMSTANCES:
        mine = [r for r in rows if r["circumstance"] == what]
        dev = [r["device_part"] for r in mine if r["device_part"] is not None]
        host = [r["host_part"] for r in mine if r["host_part"] is not None]
        out["by_circumstance"][what] = {
            "count": len(mine), "share_of_top_1pct": sum(r["circumstance"] == what for r in top) / len(top),
            "error_p50_ms": _pct([r["error"] for r in mine], 50), "error_p99_ms": _pct([r["error"] for r in mine], 99),
            # both tails: a device faster than its estimate (a negative part) also makes an error
            "device_over_estimate_p1_ms": _pct(dev, 1), "device_over_estimate_p99_ms": _pct(dev, 99),
            "host_part_p50_ms": _pct(host, 50),
            "host_part_p99_ms": _pct(host, 99)}
    out["overestimates"] = overestimates(rows)
    return out


def read(path: Path) -> list[dict[str, Any]]:
    with path.open("rb") as f:
        return [json.loads(line) for line in f if line.strip()]


def markdown(s: dict[str, Any]) -> str:
    if not s.get("infers"):
        return "No INFER with an estimate in the trace."
    def f(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"
    lines = [f"{s['infers']} INFERs; |error| p99 {s['error_p99_ms']:.2f} ms", "",
             "| circumstance | INFERs | share of the top 1% | error p50 / p99 (ms) | device time - estimate p1 / p99 "
             "(ms) | host part p50 / p99 (ms) |", "|---|---|---|---|---|---|"]
    for what, c in s["by_circumstance"].items():
        lines.append(f"| {what} | {c['count']} | {c['share_of_top_1pct']:.2f} | {f(c['error_p50_ms'])} / "
                     f"{f(c['error_p99_ms'])} | {f(c['device_over_estimate_p1_ms'])} / "
                     f"{f(c['device_over_estimate_p99_ms'])} | "
                     f"{f(c['host_part_p50_ms'])} / "
                     f"{f(c['host_part_p99_ms'])} |")
    o = s.get("overestimates")
    if o:
        lines += ["", f"Estimates more than {o['gross_s'] * 1e3:g} ms above the device time: {o['count']}; "
                  f"{o['explained_by_a_recent_slow_run']} of them match a slow run still in the estimator's "
                  f"window (within 10%), that run's circumstance: {o['slow_run_circumstances'] or '-'}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.errors")
    ap.add_argument("trace", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    s = summarize(read(args.trace))
    if args.json:
        args.json.write_text(json.dumps(s, indent=2) + "\n")
    print(markdown(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
