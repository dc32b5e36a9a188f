"""Fault injection for tests, demos and benchmarks: a device made slow, failing or hung.

Per device: a slowdown (a factor on INFER durations and/or an added delay) that is sustained,
periodic (the first `duty` of every `period_s`) or in random bursts (windows of `burst_s`, each
slowed with probability `duty`, decided by a seeded hash so runs repeat); INFER failures with a
probability; and a hang (INFER blocks until the fault is cleared). Off by default; set in the
config (`[[faults]]`) or at run time (`POST /v2/admin/faults`).
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
from dataclasses import asdict, dataclass
from typing import Any, Literal

FaultMode = Literal["sustained", "periodic", "random"]


_RANGES = (  # field, lowest, highest: a fault slows a device for a test, never past a minute per INFER
    ("slowdown", 1.0, 1000.0),
    ("add_ms", 0.0, 60_000.0),
    ("period_s", 0.0, 86_400.0),
    ("duty", 0.0, 1.0),
    ("burst_s", 0.0, 86_400.0),
    ("fail_probability", 0.0, 1.0),
)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    slowdown: float = 1.0  # factor on INFER durations
    add_ms: float = 0.0  # added to each INFER
    mode: FaultMode = "sustained"
    period_s: float = 1.0  # periodic: the cycle
    duty: float = 0.5  # periodic: the slowed share of each cycle; random: the chance a window is slowed
    burst_s: float = 0.1  # random: the window length
    fail_probability: float = 0.0
    hang: bool = False
    seed: int = 0
    hang_load: bool = False  # LOADs block until the fault is cleared (a read from a dead disk, a stuck driver)

    def __post_init__(self) -> None:
        # Checked whole before anything is applied: a fault comes from a config file or a JSON body,
        # and a NaN or an hour-long delay would stall a device as surely as a bug.
        for name, low, high in _RANGES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} = {value!r}: expected a number")
            if not (math.isfinite(value) and low <= value <= high):
                raise ValueError(f"{name} = {value!r}: expected a number in [{low:g}, {high:g}]")
        for name in ("hang", "hang_load"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected true or false")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed = {self.seed!r}: expected an integer in [0, 2**63)")
        if self.mode not in ("sustained", "periodic", "random"):
            raise ValueError(f"fault mode {self.mode!r}: expected sustained, periodic or random")
        if self.period_s <= 0 or self.burst_s <= 0:
            raise ValueError("period_s and burst_s must be positive")

    def slowed(self, t: float) -> bool:
        if self.mode == "sustained":
            return True
        if self.mode == "periodic":
            return (t % self.period_s) < self.duty * self.period_s
        window = int(t // self.burst_s)
        h = hashlib.blake2b(f"{self.seed}:{window}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.duty

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Faults:
    """The faults of one device; thread-safe (set from the loop, read by executor threads)."""

    def __init__(self) -> None:
        self._spec: FaultSpec | None = None
        # Whether any fault is set: read by the executor before each call below (two interpreted
        # calls an INFER, ~1.5k instructions, on a device that has no fault, which is every one in
        # production)
        self.active = False
        self._lock = threading.Lock()
        self._unhang = threading.Event()
        self._unhang.set()
        self._rng = random.Random(0)

    @property
    def spec(self) -> FaultSpec | None:
        return self._spec

    def set(self, spec: FaultSpec | None) -> None:
        rng = random.Random(spec.seed if spec else 0)  # before the lock: nothing half-applied
        with self._lock:
            self._spec = spec
            self._rng = rng
            self.active = spec is not None
            if spec is not None and (spec.hang or spec.hang_load):
                self._unhang.clear()
            else:
                self._unhang.set()

    def before(self) -> None:
        """Called before an INFER runs: hang until cleared, or fail with the set probability."""
        spec = self._spec
        if spec is None:
            return
        if spec.hang:
            self._unhang.wait()
        with self._lock:
            fail = spec.fail_probability > 0 and self._rng.random() < spec.fail_probability
        if fail:
            raise RuntimeError("injected failure")

    def before_load(self) -> None:
        """Called before a LOAD runs: hang until cleared."""
        spec = self._spec
        if spec is not None and spec.hang_load:
            self._unhang.wait()

    def extra(self, duration: float, t: float) -> float:
        """Seconds to add to an INFER that took `duration` and started at `t`."""
        spec = self._spec
        if spec is None or not spec.slowed(t):
            return 0.0
        return duration * (spec.slowdown - 1.0) + spec.add_ms / 1000.0

    def release(self) -> None:
        self._unhang.set()
