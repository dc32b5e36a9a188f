"""The daemon's CPU by thread (observability/threads.py): a named thread's work is its own."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from daemon.observability.threads import thread_cpu


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_busy_named_thread_is_charged_its_cpu() -> None:
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:
        while time.thread_time() < 0.08:  # this thread's own CPU, not wall time
            pass
        spun.set()
        done.wait()

    t = threading.Thread(target=spin, name="test-spinner")
    t.start()
    try:
        assert spun.wait(30)
        cpu = thread_cpu()
    finally:
        done.set()
        t.join()
    assert cpu["test-spinner"] >= 0.05  # (/proc counts in ticks of 10 ms)
    assert "MainThread" in cpu and cpu["other"] >= 0.0


def test_a_bench_reads_cores_per_thread_between_two_readings() -> None:
    from bench.scenarios.many_models import thread_cores

    before = {"MainThread": 1.0, "cuda:0/infer": 2.0, "other": 0.5}
    after = {"MainThread": 1.5, "cuda:0/infer": 4.0, "other": 0.502, "cuda:0/load": 0.25}
    # busiest first; a thread that started between the readings counts from zero; under 0.005 left out
    assert list(thread_cores(before, after, 2.0).items()) == [("cuda:0/infer", 1.0), ("MainThread", 0.25),
                                                              ("cuda:0/load", 0.125)]
    assert thread_cores(before, after, 0.0) == {}
