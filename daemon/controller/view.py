"""The read-only view of the controller's state that policies and the ParM workflow decide from.

The scheduler is its one implementation (a subclass); deciders import this class, never the
scheduler, and change nothing they read: what they decide comes back as steps (`decisions.py`)
the scheduler applies.

A class rather than a `Protocol` because the decision loop is compiled (mypyc): through a
Protocol every read of the view and every call of a policy's hook from compiled code was a
generic attribute lookup or method call (~250-400 instructions each, a dozen a request; issue
12's callgrind), where a compiled base class's fields are read directly and its methods called
through a table. The containers are the scheduler's own, typed as what they are so that
compiled reads stay fast; a decider only reads them.
"""

from __future__ import annotations

from daemon.controller.estimates import Estimator
from daemon.controller.state import DeviceState, ModelEntry
from daemon.request import InferenceRequest


class ControllerView:
    # Every device: its memory map, lanes' timelines, actions in flight, back-offs.
    devices: dict[str, DeviceState]
    # Every served model: its spec, queue and weight size.
    models: dict[str, ModelEntry]
    # Model key -> the devices holding its weights ready.
    ready_on: dict[str, set[str]]
    # Model key -> the devices holding or loading its weights.
    placed_on: dict[str, set[str]]
    # The device kinds present (each has its own latency profile).
    kinds: list[str]
    # Devices lost for good (a sticky error, a hang).
    lost: int
    # Latency estimates (read them; only the scheduler feeds them).
    estimator: Estimator
    # The models that may have requests in their best-effort lane (a superset: it is pruned when
    # `late_work` is read); empty means no lane work anywhere, at no cost.
    late_keys: set[str]

    def estimate(self, key: str, samples: int, where: DeviceState | str) -> float:
        """Seconds to run `samples` samples of a model on a device (or any device of a kind)."""
        raise NotImplementedError

    def best_case(self, req: InferenceRequest) -> float:
        """The shortest time `req` could take on an idle device with its model loaded."""
        raise NotImplementedError

    def active(self) -> list[ModelEntry]:
        """The models with queued requests."""
        raise NotImplementedError

    def late_work(self) -> list[ModelEntry]:
        """The models with requests in their best-effort lane."""
        raise NotImplementedError
