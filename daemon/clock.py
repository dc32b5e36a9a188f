"""Clocks. All scheduling code takes the time from an injected `Clock`; deadlines are absolute.

`MonotonicClock` is the one the daemon runs on; it is the same clock as the asyncio loop's
(`time.monotonic`), so loop timers and executor timestamps agree. `FakeClock` is moved by hand
in tests. `VirtualClock` is the clock of simulated devices.
"""

from __future__ import annotations

from time import monotonic
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic time line."""
        ...


class MonotonicClock:
    __slots__ = ()

    def now(self) -> float:
        # (the function imported, not `time.monotonic` read from the module: compiled, that read is
        # a generic attribute look-up, ~270 instructions, four times a request)
        return monotonic()


class FakeClock:
    """A clock that only moves when told; for deterministic tests."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError("a clock cannot go backwards")
        self._now = t


class VirtualClock(FakeClock):
    """Virtual time for simulated devices: advanced by the simulator to the next event."""

    __slots__ = ()


MS = 1e-3
US = 1e-6
