"""The daemon's lifecycle phases, read by the parts that must behave differently as it starts or stops."""

from __future__ import annotations

import enum


class State(enum.IntEnum):
    STARTING = 0
    RUNNING = 1
    DRAINING = 2  # listeners closed, accepted requests still answered
    STOPPING = 3  # executors stopping
    STOPPED = 4
