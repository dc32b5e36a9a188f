"""Overload detection from the event loop's own lag.

When the loop cannot keep up, requests wait in the kernel's socket buffers, where no queue
bound or admission rule sees them; by the time they are parsed their deadlines have passed,
and the loop spends itself on work nobody will use (goodput collapse). The lag of a periodic
timer measures that hidden wait. While it is over `server.shed_lag_ms`, frontends refuse new
inference at once (503, Retry-After) without decoding it, which costs a small fraction of
serving it, so the loop catches up and goodput stays near capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

STALL_FACTOR = 4.0  # one tick this many thresholds late counts as overload at once


class LagTracker:
    """Pure state: how late a periodic tick ran, smoothed, and whether that means overload."""

    def __init__(self, threshold_s: float, alpha: float = 0.3) -> None:
        self.threshold_s = threshold_s
        self.alpha = alpha
        self.lag_s = 0.0  # smoothed
        self.last_s = 0.0  # the latest tick's
        self.max_s = 0.0
        self.shed = 0  # requests refused while overloaded

    def observe(self, expected: float, actual: float) -> None:
        lag = max(0.0, actual - expected)
        self.last_s = lag
        self.max_s = max(self.max_s, lag)
        self.lag_s += self.alpha * (lag - self.lag_s)

    @property
    def overloaded(self) -> bool:
        # Sustained lag, or one stall so long that what queued up behind it is already late; a single
        # short stall (a GC pass, one big body) is not overload and must not turn clients away.
        return self.threshold_s > 0 and (self.lag_s > self.threshold_s or self.last_s > STALL_FACTOR * self.threshold_s)


class LoopMonitor:
    """Runs a tick every `interval_s` on the loop and feeds its lateness to a LagTracker."""

    def __init__(self, tracker: LagTracker, interval_s: float = 0.005,
                 clock: Callable[[], float] | None = None) -> None:
        self.tracker = tracker
        self.interval_s = interval_s
        self._clock = clock
        self._handle: asyncio.TimerHandle | None = None
        self._expected = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        now = self._now(loop)
        self._expected = now + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick, loop)

    def _now(self, loop: asyncio.AbstractEventLoop) -> float:
        return self._clock() if self._clock else loop.time()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = self._now(loop)
        self.tracker.observe(self._expected, now)
        self._expected = now + self.interval_s
        self._handle = loop.call_later(self.interval_s, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
