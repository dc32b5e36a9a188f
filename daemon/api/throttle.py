"""Answers that cost the event loop real time to compute (metrics, statistics), kept from being
used to stall it.

`GET /metrics` renders every series (milliseconds with many models); a client pipelining
thousands of them would hold the loop for seconds. A `RenderBudget` renders on demand while
rendering has taken less than `share` of the loop in the current window, and past that answers
with the last rendering (at most `max_age` seconds old) until the window turns. A scrape every
few seconds, or a test reading its counters, always gets a fresh answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class RenderBudget(Generic[T]):
    def __init__(self, render: Callable[[], T], share: float = 0.05, window_s: float = 1.0, max_age_s: float = 5.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.render = render
        self.budget = share * window_s  # seconds of rendering per window
        self.window_s = window_s
        self.max_age_s = max_age_s
        self.clock = clock
        self._window_start = -float("inf")
        self._spent = 0.0
        self._last: T | None = None
        self._last_at = -float("inf")
        self.rendered = 0
        self.reused = 0

    def get(self) -> T:
        now = self.clock()
        if now - self._window_start >= self.window_s:
            self._window_start, self._spent = now, 0.0
        if self._spent >= self.budget and self._last is not None and now - self._last_at <= self.max_age_s:
            self.reused += 1
            return self._last
        out = self.render()
        end = self.clock()
        self._spent += end - now
        self._last, self._last_at = out, now
        self.rendered += 1
        return out
