"""bench/spy.py: py-spy's raw stacks summed per thread, busiest frames first."""

from __future__ import annotations

from bench.spy import markdown, summarize

RAW = """\
thread (11): MainThread;main (daemon/cli.py:10);_step (daemon/controller/service.py:117) 6
thread (11): MainThread;main (daemon/cli.py:10);_flush (daemon/api/link.py:108) 2
thread (12): cuda:0/infer;_loop (daemon/runtime/executor.py:125);infer (daemon/runtime/cuda.py:992) 12
thread (13) 0
garbage line
"""


def test_samples_are_summed_per_thread_with_their_busiest_frames() -> None:
    s = summarize(RAW, top=1)
    assert list(s) == ["cuda:0/infer", "MainThread"]  # busiest thread first
    assert s["cuda:0/infer"] == {"samples": 12, "share": 0.6, "top": [["infer (runtime/cuda.py:992)", 1.0]]}
    assert s["MainThread"]["samples"] == 8 and s["MainThread"]["top"] == [["_step (controller/service.py:117)", 0.75]]
    lines = markdown(s, "clockwork at 100 req/s")
    assert any(line.startswith("| cuda:0/infer | 60% |") for line in lines)
    assert markdown({}, "x") == [] and "failed" in markdown({"error": "no permission"}, "x")[1]
