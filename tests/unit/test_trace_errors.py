"""bench/gpu/errors.py: INFER prediction errors put in their circumstances and split into the
device's part and the host's, from trace lines."""

from __future__ import annotations

from typing import Any

import pytest

from bench.gpu import errors


def action(kind: str, model: str, begin: float, end: float, expected: float = 0.001, duration: float = 0.0,
           device: str = "cuda:0", status: str = "OK") -> dict[str, Any]:
    return {"ev": "action", "kind": kind, "model": model, "device": device, "begin": begin, "end": end,
            "expected": expected, "duration": duration, "status": status, "batch": 1}


def test_each_infer_is_put_in_its_circumstance_and_its_error_split() -> None:
    lines = [
        action("LOAD", "a", 1.000, 1.010, expected=0.005),
        action("INFER", "b", 1.002, 1.006, duration=0.0035),  # while a's LOAD ran: 3 ms over, 2.5 on the device
        action("INFER", "a", 1.020, 1.0215, duration=0.0010),  # a's first after its LOAD
        action("INFER", "a", 1.030, 1.031, duration=0.0009),  # then an ordinary one
        action("INFER", "b", 1.004, 1.006, device="cuda:1", duration=0.0011),  # a LOAD elsewhere does not count
        action("INFER", "c", 1.05, 1.06, expected=0.0, duration=0.001),  # no estimate: not counted
        action("INFER", "c", 1.05, 1.06, status="FAILED"),
        {"ev": "request", "model": "a"},
    ]
    got = errors.infers(lines)
    assert [g["circumstance"] for g in got] == ["during_load", "neither", "first_after_load", "neither"]
    during = got[0]
    assert during["error"] == pytest.approx(0.003)
    assert during["device_part"] == pytest.approx(0.0025) and during["host_part"] == pytest.approx(0.0005)
    s = errors.summarize(lines)
    assert s["infers"] == 4
    assert s["by_circumstance"]["during_load"]["share_of_top_1pct"] == 1.0  # the largest error is the LOAD's
    assert s["by_circumstance"]["neither"]["count"] == 2
    assert "during_load" in errors.markdown(s)


def test_a_trace_without_estimated_infers_says_so() -> None:
    s = errors.summarize([action("LOAD", "a", 0.0, 0.01)])
    assert s == {"infers": 0} and "No INFER" in errors.markdown(s)
