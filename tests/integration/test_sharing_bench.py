"""`python -m bench run sharing` on a family of three: its figures exist and say what they should."""

from __future__ import annotations

import json
from pathlib import Path

from bench.scenarios import get


def test_three_variants_share_their_backbone_and_answer_as_alone(tmp_path: Path) -> None:
    out = tmp_path / "sharing.json"
    get("sharing")(quick=True, json_out=str(out), variants=3, load_reps=1, load=False)
    s = json.loads(out.read_text())["summary"]
    assert s["outputs_identical"] is True
    assert s["backend_agrees_with_controller"] is True
    # three copies of the backbone against one: close to 3x on the device and in host weights
    assert 2.5 < s["memory_ratio"] < 3.0 and 2.5 < s["host_weight_ratio"] < 3.0
    assert s["capacity_ratio"] is None and s["p99_ratio"] is None  # the load phase was not asked for
