"""Paired A/B of `bench run scale --quick`: an older tree against this one, interleaved, R rounds.

    git worktree add /tmp/old COMMIT
    python -m bench.scale_ab /tmp/old 3 [OUT]  # writes bench/results/scale-ab.md (or OUT)
    python -m bench.scale_ab --points /tmp/old 5  # longer single points (scale_probe point), printed

Each run is its own process on its own tree; the table gives per point the median of each side
and the median of the paired ratios (the machine is shared: only ratios of runs taken side by
side mean much).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = "import sys; sys.path.insert(0, sys.argv[1]); from bench.scenarios import scale; scale.run(quick=True, " \
       "json_out=sys.argv[2])"


def main(old: str, rounds: int, out_path: str = "") -> None:
    tmp = Path(tempfile.mkdtemp(prefix="scale-ab-"))
    trees = {"old": Path(old).resolve(), "new": ROOT}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(rounds):
        for name, tree in trees.items():
            out = tmp / f"{name}-{r}.json"
            subprocess.run([sys.executable, "-c", CODE, str(tree), str(out)], cwd=tree, check=True,
                           capture_output=True)
            runs[name].append(json.loads(out.read_text()))
    lines = [f"# scale A/B: {old} against this tree", "",
             f"Command: `python -m bench.scale_ab {old} {rounds}{' ' + out_path if out_path else ''}`", "",
             "| point | offered req/s | µs/req old | µs/req new | new/old (median of paired runs) "
             "| attainment old / new | cold starts old / new |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(runs["new"][0]["rows"]):
        o = [x["rows"][i]["controller_us_per_request"] for x in runs["old"]]
        n = [x["rows"][i]["controller_us_per_request"] for x in runs["new"]]
        ro = runs["old"][0]["rows"][i]
        ratio = statistics.median(b / a for a, b in zip(o, n, strict=True))
        lines.append(f"| {row['label']} | {row['offered_rps']:,.0f} | {statistics.median(o):.1f} | "
                     f"{statistics.median(n):.1f} | {ratio:.2f} | {ro['slo_attainment']:.4f} / "
                     f"{row['slo_attainment']:.4f} | {ro['cold_start_rate']:.3f} / {row['cold_start_rate']:.3f} |")
    for name in ("old", "new"):
        s = [x["summary"] for x in runs[name]]
        by_models = [{k: round(v) for k, v in x["us_per_request_by_models"].items()} for x in s]
        lines.append(f"\n{name}: controller_saturation_rps {[round(x['controller_saturation_rps']) for x in s]}, "
                     f"us_per_request_by_models {by_models}")
    (Path(out_path) if out_path else ROOT / "bench" / "results" / "scale-ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


POINTS = ((1000, 50000), (1000, 75000), (10000, 20000))  # (models, req/s): 0.5 s each, the 20x profile


def points(old: str, rounds: int) -> None:
    """`bench.scale_probe point` at POINTS, old then new in each round: the quick scenario's 0.3-s
    points are too short for a noisy machine; these run 0.5 s at the loads that matter."""
    trees = {"old": Path(old).resolve(), "new": ROOT}
    got: dict[tuple[int, int], dict[str, list[float]]] = {p: {"old": [], "new": []} for p in POINTS}
    for _ in range(rounds):
        for models, rate in POINTS:
            for name, tree in trees.items():
                out = subprocess.run([sys.executable, "-m", "bench.scale_probe", "point", str(tree), str(models),
                                      str(rate), "0.5", "20"], cwd=tree, check=True, capture_output=True, text=True)
                got[(models, rate)][name].append(float(out.stdout.strip().splitlines()[-1].split()[0]))
    print("| point | old µs/request (median) | new | paired new/old | median |\n|---|---|---|---|---|")
    for (models, rate), v in got.items():
        ratios = [b / a for a, b in zip(v["old"], v["new"], strict=True)]
        print(f"| {models:,} models, {rate:,} req/s | {statistics.median(v['old']):.1f} | "
              f"{statistics.median(v['new']):.1f} | {', '.join(f'{x:.2f}' for x in ratios)} | "
              f"{statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    if sys.argv[1] == "--points":
        points(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5)
    else:
        main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3, sys.argv[3] if len(sys.argv) > 3 else "")
