"""`python -m bench run NAME [--quick] [--json OUT] [--opt value ...]` and `python -m bench all [--quick]`."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from typing import Any

from bench.results import RESULTS
from bench.scenarios import NOT_IN_ALL, SCENARIOS, get


def _options(extra: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    it = iter(extra)
    for key in it:
        if not key.startswith("--"):
            raise SystemExit(f"unexpected argument {key!r}")
        value = next(it, None)
        if value is None:
            raise SystemExit(f"{key} needs a value")
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        opts[key[2:].replace("-", "_")] = parsed
    return opts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one scenario")
    r.add_argument("name", choices=list(SCENARIOS))
    r.add_argument("--quick", action="store_true", help="a short version (under two minutes on 2 cores)")
    r.add_argument("--json", dest="json_out", help="where to write the JSON result (default bench/results/NAME.json)")
    a = sub.add_parser("all", help="run every scenario and write a dated summary")
    a.add_argument("--quick", action="store_true")
    args, extra = ap.parse_known_args(argv)
    if args.cmd == "run":
        result = get(args.name)(quick=args.quick, json_out=args.json_out, **_options(extra))
        print(json.dumps(result["summary"], indent=2, default=str))
        return 0
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    lines = [f"# Benchmarks, {stamp}{' (quick)' if args.quick else ''}", ""]
    failed = 0
    for name in [n for n in SCENARIOS if n not in NOT_IN_ALL]:
        t0 = time.monotonic()
        try:
            result = get(name)(quick=args.quick, json_out=None)
        except Exception as e:  # one broken scenario must not hide the others' figures
            failed += 1
            lines += [f"## {name}: FAILED", "", f"    {type(e).__name__}: {e}", ""]
            print(f"{name}: failed: {e}", file=sys.stderr)
            continue
        lines += [f"## {name} ({time.monotonic() - t0:.0f} s)", ""]
        lines += [f"- {k}: {v}" for k, v in result["summary"].items()] + [""]
    (RESULTS / f"summary-{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
