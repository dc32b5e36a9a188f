"""Tabulate several `peers` results: `python bench/peers/summarize.py OUT.md RUN.json ...`

One table per figure (capacity at SLO, fraction of the machine's limit, p99 at the common load
and at 1,000 req/s, start-up, idle memory), a row per run, a column per system; then the median
capacity ratio of escapement to the best peer over the runs; and, when the runs have them, the
gRPC and shared-memory rows (escapement and Triton) with their median ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ORDER = ["escapement", "triton", "pytriton", "torchserve", "ray-serve", "plain-aiohttp"]


def _fmt(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "rps":
        return f"{v:,.0f}"
    if unit == "frac":
        return f"{v:.3f}"
    return f"{v:.1f}"


def main(argv: list[str]) -> int:
    out, files = Path(argv[0]), [Path(a) for a in argv[1:]]
    runs = [(f.stem, json.loads(f.read_text())) for f in files]
    systems = [s for s in ORDER if any(s in r["summary"].get("capacity_at_slo_rps", {}) for _, r in runs)]
    m = runs[0][1]["machine"]
    lines = ["# peers: repeated runs", "",
             f"Machine: {m['cores']} cores, {m['cpu']}, torch {m['torch']}, commit {m['git_commit']}.", "",
             "Commands: " + "; ".join(f"`{r['config']['command']} --json .../{name}.json`" for name, r in runs), ""]
    figures = [("Capacity at SLO (req/s)", "capacity_at_slo_rps", "rps"),
               ("Fraction of the machine's limit", "fraction_of_limit", "frac"),
               ("p99 at the common load (ms)", "p99_ms_at_common_load", "ms"),
               ("p99 at 1,000 req/s (ms)", "p99_ms_at_1000_rps", "ms"),
               ("Start-up (s)", "startup_s", "s"),
               ("Idle memory (MiB, process tree)", "idle_rss_mb", "mb")]
    for title, key, unit in figures:
        lines += [f"## {title}", "", "| run | " + " | ".join(systems) + " | extra |",
                  "|---|" + "---|" * (len(systems) + 1)]
        for name, r in runs:
            s = r["summary"]
            vals = s.get(key, {})
            extra = ""
            if key == "capacity_at_slo_rps":
                extra = f"limit {s.get('limit_rps', 0):,.0f}; best peer {s.get('best_peer')}; ratio " \
                        f"{s.get('capacity_ratio_vs_best_peer', float('nan')):.2f}"
            elif key == "p99_ms_at_common_load":
                left = ", ".join(s.get("left_out_of_common_load", [])) or "-"
                extra = f"at {s.get('common_load_rps')} req/s; left out: {left}"
            lines.append(f"| {name} | " + " | ".join(_fmt(vals.get(x), unit) for x in systems) + f" | {extra} |")
        lines.append("")
    ratios = [r["summary"]["capacity_ratio_vs_best_peer"] for _, r in runs
              if "capacity_ratio_vs_best_peer" in r["summary"]]
    if ratios:
        lines.append(f"Median capacity ratio escapement / best peer over {len(ratios)} runs: "
                     f"**{statistics.median(ratios):.2f}** (each: {', '.join(f'{x:.2f}' for x in ratios)}).")
    torchserve = [r["summary"]["capacity_at_slo_rps"]["escapement"] / r["summary"]["capacity_at_slo_rps"]["torchserve"]
                  for _, r in runs if r["summary"].get("capacity_at_slo_rps", {}).get("torchserve")]
    if torchserve:
        lines.append(f"Median capacity ratio escapement / torchserve (HTTP JSON) over {len(torchserve)} runs: "
                     f"**{statistics.median(torchserve):.2f}** (each: {', '.join(f'{x:.2f}' for x in torchserve)}).")
    for kind, what in (("grpc", "gRPC (ModelInfer, raw_input_contents)"),
                       ("shm", "HTTP with system shared memory")):
        if not any(f"{kind}_capacity_at_slo_rps" in r["summary"] for _, r in runs):
            continue
        both = ["escapement", "triton"]
        for title, key, unit in ((f"Capacity at SLO over {what} (req/s)", f"{kind}_capacity_at_slo_rps", "rps"),
                                 (f"p99 at 1,000 req/s over {what} (ms)", f"{kind}_p99_ms_at_1000_rps", "ms")):
            lines += ["", f"## {title}", "", "| run | " + " | ".join(both) + " |", "|---|" + "---|" * len(both)]
            lines += [f"| {name} | " + " | ".join(_fmt(r["summary"].get(key, {}).get(x), unit) for x in both) + " |"
                      for name, r in runs]
        ratios = [r["summary"][f"{kind}_capacity_ratio_vs_triton"] for _, r in runs
                  if f"{kind}_capacity_ratio_vs_triton" in r["summary"]]
        if ratios:
            lines += ["", f"Median capacity ratio escapement / triton over {what} over {len(ratios)} runs: "
                          f"**{statistics.median(ratios):.2f}** (each: {', '.join(f'{x:.2f}' for x in ratios)})."]
    stats = [(name, r["summary"].get("triton_stats_us_per_request")) for name, r in runs]
    if any(s for _, s in stats):
        lines += ["", "## Triton's own statistics (µs per request, python backend)", "",
                  "| run | queue | compute input | compute infer | compute output |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {s['queue_us']:.0f} | {s['compute_input_us']:.0f} | {s['compute_infer_us']:.0f} | "
                  f"{s['compute_output_us']:.0f} |" for n, s in stats if s]
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
