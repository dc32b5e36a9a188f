"""bench/gpu/errors.py on a made-up trace: INFER errors by circumstance, and gross overestimates
traced to a slow run still in the estimator's window."""

from __future__ import annotations

from typing import Any

from bench.gpu.errors import markdown, summarize


def _infer(begin: float, device_s: float, expected: float, host_s: float = 0.0001) -> dict[str, Any]:
    return {"ev": "action", "kind": "INFER", "status": "OK", "model": "m:1", "device": "cuda:0", "batch": 1,
            "begin": begin, "end": begin + device_s + host_s, "duration": device_s, "expected": expected}


def test_an_overestimate_is_traced_to_the_slow_cold_run_before_it() -> None:
    lines: list[dict[str, Any]] = [
        {"ev": "action", "kind": "LOAD", "status": "OK", "model": "m:1", "device": "cuda:0", "begin": 0.0, "end": 0.01},
        _infer(0.02, 0.009, 0.0005),  # the first run after its LOAD: cold, 9 ms
        *[_infer(0.05 + i * 0.01, 0.0005, 0.009) for i in range(5)],  # estimated from it: 9 ms
        _infer(2.0, 0.0005, 0.009),  # the slow run has aged out: not explained by it
    ]
    s = summarize(lines)
    assert s["infers"] == 7 and s["by_circumstance"]["first_after_load"]["count"] == 1
    o = s["overestimates"]
    assert o["count"] == 6 and o["explained_by_a_recent_slow_run"] == 5
    assert o["slow_run_circumstances"] == {"first_after_load": 5}
    assert "match a slow run still in the estimator's window" in markdown(s)
