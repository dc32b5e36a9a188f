"""Device timelines: when each lane of a device (exec, copy) will next be free.

A lane's timeline is the work planned on it: the actions issued and not yet reported, each
with its expected duration, after the moment the lane began that run of work. Results
correct it: a reported end becomes the new beginning of what is left, so errors in the
estimates never accumulate. A head action that runs longer than expected by more than `lag`
is assumed to keep running for another `lag` (Clockwork's tracker assumes instead that it
started `lag` ago, which makes a hung device look free and piles work onto it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from daemon.controller.floats import fmax

DEFAULT_LAG = 0.010


@dataclass(slots=True)
class LaneTimeline:
    lag: float = DEFAULT_LAG
    begin: float = 0.0  # when the lane began its current run of work
    total: float = 0.0  # expected seconds of outstanding work
    outstanding: OrderedDict[int, float] = field(default_factory=OrderedDict)  # action id -> expected s

    def free_at(self, now: float) -> float:
        """When the lane is expected to have done everything it was given."""
        if not self.outstanding:
            return now
        start = self.begin
        head = next(iter(self.outstanding.values()))
        if now > start + head + self.lag:  # the head overran: assume it runs on for another `lag`
            return now + self.lag + (self.total - head)
        return fmax(now, start + self.total)

    def add(self, action_id: int, duration: float, now: float) -> float:
        """Plan an action; returns its expected start."""
        start = self.free_at(now)
        if not self.outstanding:
            self.begin = now
        self.outstanding[action_id] = duration
        self.total += duration
        return start

    def done(self, action_id: int, end: float) -> None:
        """An action finished (or was refused) at `end`: what remains begins there."""
        d = self.outstanding.pop(action_id, None)
        if d is None:
            return
        self.total = fmax(0.0, self.total - d) if self.outstanding else 0.0
        self.begin = end

    def __len__(self) -> int:
        return len(self.outstanding)


@dataclass(slots=True)
class DeviceTimeline:
    exec: LaneTimeline = field(default_factory=LaneTimeline)
    copy: LaneTimeline = field(default_factory=LaneTimeline)
