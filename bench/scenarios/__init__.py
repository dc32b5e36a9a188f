"""Benchmark scenarios: each module has `run(quick: bool, json_out: str | None, **options) -> dict`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

SCENARIOS = {
    "overhead": "bench.scenarios.overhead",
    "curve": "bench.scenarios.curve",
    "many-models": "bench.scenarios.many_models",
    "policies": "bench.scenarios.policies",
    "peers": "bench.scenarios.peers",
    "simulate": "bench.scenarios.simulate",
    "parity": "bench.scenarios.parity",
    "http-server": "bench.scenarios.http_server",
    "standin-races": "bench.scenarios.standin_races",
    "limit": "bench.scenarios.limit",
    "peers-tuning": "bench.scenarios.peers_tuning",
    "scale": "bench.scenarios.scale",
    "soak": "bench.scenarios.soak",
    "hostile": "bench.scenarios.hostile",
    "classes": "bench.scenarios.classes",
    "routing": "bench.scenarios.routing",
    "ingest": "bench.scenarios.ingest",
    "loop-cost": "bench.scenarios.loop_cost",
    "sharing": "bench.scenarios.sharing",
    "apps": "bench.scenarios.apps",
    "rayserve": "bench.scenarios.rayserve",
}


# Run on their own, not by `python -m bench all`: a calibration whose result is written into code, and a
# long reliability run (fuzz and overload) whose findings are inputs to fix, not figures to compare; and
# rayserve, which needs the optional `ray` extra and starts a 3-node Ray cluster.
NOT_IN_ALL = frozenset({"peers-tuning", "soak", "rayserve"})


def get(name: str) -> Callable[..., dict[str, Any]]:
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name!r}; scenarios: {', '.join(SCENARIOS)}")
    return importlib.import_module(SCENARIOS[name]).run  # type: ignore[no-any-return]
