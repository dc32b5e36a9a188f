"""The one result format every scenario writes, and the statistics behind its rows.

A result is a JSON object: `scenario`, `machine` (cores, torch version, devices, git commit),
`config` (what was run), `rows` (one per measured point) and `summary` (the headline figures).
Each scenario also writes a markdown table and, where a curve says more, a PNG plot, all under
`bench/results/`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import CONN_ERROR, NO_ANSWER, POOL_FULL, Run

RESULTS = Path(__file__).resolve().parent / "results"
# A generator whose sends are later than this at p99 did not deliver the offered load: the
# run measured the generator, not the server. Noise on a shared VM reaches a few ms.
LAG_LIMIT_S = 0.005
LAG_LIMIT_SLO_FRACTION = 0.05

ERROR_NAMES = {NO_ANSWER: "no_answer", CONN_ERROR: "connection", POOL_FULL: "generator_pool_full",
               400: "bad_request", 404: "not_found", 413: "too_large", 499: "cancelled", 500: "internal",
               503: "unavailable", 504: "deadline", 507: "insufficient_storage"}


def machine() -> dict[str, Any]:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(), "cpu": cpu, "torch": torch.__version__, "python": platform.python_version(),
        "devices": devices or ["cpu"], "git_commit": commit + ("-dirty" if dirty else ""),
        "platform": platform.platform(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def percentile(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else float("nan")


def row(run: Run, label: str, slo_s: float, **extra: Any) -> dict[str, Any]:
    """Statistics of one run's measured window (after its warm-up)."""
    r = run.records
    win = run.window()
    n = int(win.sum())
    window_s = max(run.duration - run.warmup, 1e-9)
    status = r.status[win]
    ok = status == 200
    lat = r.latency[win]
    ok_lat = lat[ok]
    met = ok & (lat <= slo_s)
    lag = r.lag[win]
    lag = lag[~np.isnan(lag)]
    errors = Counter(ERROR_NAMES.get(int(s), f"status_{int(s)}") for s in status[~ok])
    lag_p99 = percentile(lag, 99)
    out: dict[str, Any] = {
        "label": label,
        "offered_rps": n / window_s,
        "achieved_rps": int(ok.sum()) / window_s,
        "goodput_rps": int(met.sum()) / window_s,
        "slo_ms": slo_s * 1e3,
        "slo_attainment": float(met.sum()) / n if n else float("nan"),
        "requests": n,
        "p50_ms": percentile(ok_lat, 50) * 1e3,
        "p90_ms": percentile(ok_lat, 90) * 1e3,
        "p99_ms": percentile(ok_lat, 99) * 1e3,
        "p999_ms": percentile(ok_lat, 99.9) * 1e3,
        "max_ms": (float(ok_lat.max()) if len(ok_lat) else float("nan")) * 1e3,
        "errors": dict(errors),
        "error_messages": {ERROR_NAMES.get(k, f"status_{k}"): v for k, v in getattr(r, "messages", {}).items()},
        "reconstructed": int((r.reconstructed[win] & ok).sum()),
        "generator_lag_p50_ms": percentile(lag, 50) * 1e3,
        "generator_lag_p99_ms": lag_p99 * 1e3,
        "generator_bound": bool(lag_p99 > max(LAG_LIMIT_S, LAG_LIMIT_SLO_FRACTION * slo_s))
        or errors.get("generator_pool_full", 0) > 0,
    }
    out.update(extra)
    return out


def write(scenario: str, config: dict[str, Any], rows: list[dict[str, Any]], summary: dict[str, Any],
          json_path: str | Path | None = None, notes: list[str] | None = None,
          columns: list[str] | None = None) -> dict[str, Any]:
    result = {"scenario": scenario, "machine": machine(), "config": config, "rows": rows, "summary": summary,
              "notes": notes or []}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(json_path) if json_path else RESULTS / f"{scenario}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(result, columns))
    return result


def _jsonable(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} as JSON")


DEFAULT_COLUMNS = ["label", "offered_rps", "achieved_rps", "goodput_rps", "slo_attainment", "p50_ms", "p90_ms",
                   "p99_ms", "p999_ms", "max_ms", "errors", "generator_bound"]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:  # nan
            return "-"
        return f"{v:.4f}" if abs(v) < 1 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {n}" for k, n in v.items()) or "-"
    return str(v)


def markdown(result: dict[str, Any], columns: list[str] | None = None) -> str:
    m = result["machine"]
    cols = columns or DEFAULT_COLUMNS
    lines = [f"# {result['scenario']}", "",
             f"{m['date']} · commit {m['git_commit']} · {m['cores']} cores ({m['cpu']}) · torch {m['torch']} · "
             f"devices {', '.join(m['devices'])}", "",
             "Command: `" + result["config"].get("command", "") + "`", ""]
    if result["summary"]:
        lines += ["## Summary", ""]
        lines += [f"- **{k}**: {_fmt(v)}" for k, v in result["summary"].items()]
        lines.append("")
    if result["rows"]:
        lines += ["## Rows", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in result["rows"]:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        lines.append("")
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def plot_curve(name: str, rows: list[dict[str, Any]], slo_ms: float, title: str,
               hlines: dict[str, float] | None = None, vlines: dict[str, float] | None = None,
               group: str = "label") -> Path | None:
    """p50 and p99 against offered load, one line pair per `group`; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if "offered_rps" in r:
            groups.setdefault(str(r.get(group, "")), []).append(r)
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["offered_rps"])
        x = [r["offered_rps"] for r in rs]
        (line,) = ax.plot(x, [r["p99_ms"] for r in rs], "o-", label=f"{label} p99")
        ax.plot(x, [r["p50_ms"] for r in rs], "s--", color=line.get_color(), alpha=0.6, label=f"{label} p50")
    ax.axhline(slo_ms, color="red", linestyle=":", label=f"SLO {slo_ms:g} ms")
    for text, y in (hlines or {}).items():
        ax.axhline(y, color="gray", linestyle="-.", label=text)
    for text, x in (vlines or {}).items():
        ax.axvline(x, color="black", linestyle="-.", label=text)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_goodput(name: str, rows: list[dict[str, Any]], title: str, group: str = "label") -> Path | None:
    """Goodput against offered load, one line per `group`, with the y = x line; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(str(r.get(group, "")), []).append(r)
    top = 0.0
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: r["offered_rps"])
        ax.plot([r["offered_rps"] for r in rs], [r["goodput_rps"] for r in rs], "o-", label=label)
        top = max(top, max(r["offered_rps"] for r in rs))
    ax.plot([0, top], [0, top], color="gray", linestyle=":", label="goodput = offered")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    out = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def capacity_at_slo(rows: list[dict[str, Any]], min_attainment: float = 0.99) -> float:
    """The highest offered load whose p99 is within the SLO with enough requests answered in it.

    Rows where the generator fell behind are not counted as the server's capacity.
    """
    good = [r["offered_rps"] for r in rows
            if r["p99_ms"] <= r["slo_ms"] and r["slo_attainment"] >= min_attainment and not r["generator_bound"]]
    return max(good) if good else 0.0
