"""Device timelines: when each lane of a device (exec, copy) will next be free.

A lane's timeline is the work planned on it: the actions issued and not yet reported, each
with its expected duration, after the moment the lane began that run of work. Results
correct it: a reported end becomes the new beginning of what is left, so errors in the
estimates never accumulate. A head action that runs longer than expected by more than `lag`
is assumed to keep running for another `lag` (Clockwork's tracker assumes instead that it
started `lag` ago, which makes a hung device look free and piles work onto it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from daemon.controller.floats import fmax

DEFAULT_LAG: Final = 0.010


@dataclass(slots=True)
class LaneTimeline:
    lag: float = DEFAULT_LAG
    begin: float = 0.0  # when the lane began its current run of work
    total: float = 0.0  # expected seconds of outstanding work
    # action id -> expected s, in the order issued (a plain dict: compiled code reads it directly,
    # where an OrderedDict is a generic object)
    outstanding: dict[int, float] = field(default_factory=dict)
    # the first outstanding action and its expected seconds, kept as they change (free_at runs
    # several times per request, an action is done once)
    head_id: int = -1
    head: float = 0.0

    def free_at(self, now: float) -> float:
        """When the lane is expected to have done everything it was given."""
        if not self.outstanding:
            return now
        start = self.begin
        head = self.head
        if now > start + head + self.lag:  # the head overran: assume it runs on for another `lag`
            return now + self.lag + (self.total - head)
        return fmax(now, start + self.total)

    def add(self, action_id: int, duration: float, now: float) -> float:
        """Plan an action; returns its expected start."""
        start = self.free_at(now)
        if not self.outstanding:
            self.begin = now
            self.head_id, self.head = action_id, duration
        self.outstanding[action_id] = duration
        self.total += duration
        return start

    def done(self, action_id: int, end: float) -> None:
        """An action finished (or was refused) at `end`: what remains begins there."""
        outstanding = self.outstanding
        d = outstanding.pop(action_id, None)
        if d is None:
            return
        if outstanding:
            self.total = fmax(0.0, self.total - d)
            if action_id == self.head_id:
                for k, v in outstanding.items():  # (the next in issue order)
                    self.head_id, self.head = k, v
                    break
        else:
            self.total = 0.0
        self.begin = end

    def __len__(self) -> int:
        return len(self.outstanding)


@dataclass(slots=True)
class DeviceTimeline:
    exec: LaneTimeline = field(default_factory=LaneTimeline)
    copy: LaneTimeline = field(default_factory=LaneTimeline)
