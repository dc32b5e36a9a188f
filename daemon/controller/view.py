"""The read-only view of the controller's state that policies and the ParM workflow decide from.

The scheduler implements it; deciders import this protocol, never the scheduler, and change
nothing they read: what they decide comes back as steps (`decisions.py`) the scheduler applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Protocol

from daemon.controller.estimates import Estimator
from daemon.controller.state import DeviceState, ModelEntry
from daemon.request import InferenceRequest


class ControllerView(Protocol):
    @property
    def devices(self) -> Mapping[str, DeviceState]:
        """Every device: its memory map, lanes' timelines, actions in flight, back-offs."""
        ...

    @property
    def models(self) -> Mapping[str, ModelEntry]:
        """Every served model: its spec, queue and weight size."""
        ...

    @property
    def ready_on(self) -> Mapping[str, Set[str]]:
        """Model key -> the devices holding its weights ready."""
        ...

    @property
    def placed_on(self) -> Mapping[str, Set[str]]:
        """Model key -> the devices holding or loading its weights."""
        ...

    @property
    def kinds(self) -> Sequence[str]:
        """The device kinds present (each has its own latency profile)."""
        ...

    @property
    def lost(self) -> int:
        """Devices lost for good (a sticky error, a hang)."""
        ...

    @property
    def estimator(self) -> Estimator:
        """Latency estimates (read them; only the scheduler feeds them)."""
        ...

    def estimate(self, key: str, samples: int, where: DeviceState | str) -> float:
        """Seconds to run `samples` samples of a model on a device (or any device of a kind)."""
        ...

    def best_case(self, req: InferenceRequest) -> float:
        """The shortest time `req` could take on an idle device with its model loaded."""
        ...

    def active(self) -> list[ModelEntry]:
        """The models with queued requests."""
        ...

    def late_work(self) -> list[ModelEntry]:
        """The models with requests in their best-effort lane."""
        ...

    @property
    def late_keys(self) -> Set[str]:
        """The models that may have requests in their best-effort lane (a superset: it is
        pruned when `late_work` is read); empty means no lane work anywhere, at no cost."""
        ...
