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
