"""The scheduler core: the controller's state and the rules every policy shares. Pure code.

It owns requests, per-model queues, latency estimates and the map of which weights are where;
a policy (`controller/policy.py`) decides which actions to take from that state. Nothing here
does I/O or reads a clock: `now` is passed in, so tests drive it with a fake clock.

Rules kept here for every policy:
- admission: unknown models, full queues and deadlines that cannot be met even on an idle
  device with the model loaded are refused at once;
- a queued request whose deadline can no longer be met is answered at once with a deadline
  error (never held until it times out);
- results: outputs are split back to requests; an action refused for its window returns its
  requests to the queue if they can still make it; estimates learn from every timing.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daemon.actions import Action, ActionKind, Result, ResultStatus
from daemon.config import ControllerSettings
from daemon.controller.estimates import EXACT_ROW_KINDS, Estimator
from daemon.controller.memory import DeviceMemory
from daemon.controller.queues import ModelQueue
from daemon.controller.telemetry import Telemetry
from daemon.errors import DeadlineExceeded, EscapementError, InternalError, NotFound, Overloaded, Unavailable
from daemon.repository import ModelSpec
from daemon.request import InferenceRequest, RequestStatus
from daemon.runtime.devices import Device

if TYPE_CHECKING:
    from daemon.controller.policy import Policy

log = logging.getLogger("escapement.controller")

LATEST_GRACE = 0.002  # an action may start this much after the plan before it is refused


@dataclass(slots=True, eq=False)
class DeviceState:
    device: Device
    memory: DeviceMemory
    infer_inflight: int = 0
    load_inflight: int = 0
    busy: Counter[str] = field(default_factory=Counter)  # model key -> its actions in flight here

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def kind(self) -> str:
        return self.device.kind


@dataclass(slots=True)
class Decision:
    actions: list[Action] = field(default_factory=list)
    finished: list[InferenceRequest] = field(default_factory=list)


@dataclass(slots=True)
class ModelEntry:
    spec: ModelSpec
    weight_bytes: int
    queue: ModelQueue = field(default_factory=ModelQueue)
    load_failures: int = 0


class Scheduler:
    def __init__(self, devices: list[Device], policy: Policy, settings: ControllerSettings,
                 estimator: Estimator | None = None, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.policy = policy
        self.estimator = estimator or Estimator()
        self.telemetry = telemetry or Telemetry()
        self.devices: dict[str, DeviceState] = {d.name: DeviceState(d, DeviceMemory(d.weight_budget))
                                                for d in devices}
        self.kinds = sorted({d.kind for d in devices})
        self.models: dict[str, ModelEntry] = {}
        self.inflight: dict[int, Action] = {}
        self._active: set[str] = set()  # models that may have queued requests (pruned lazily)
        # Where each model's weights are, derived from the devices' memory maps and kept with them.
        self.ready_on: dict[str, set[str]] = {}  # model key -> devices holding it ready
        self.placed_on: dict[str, set[str]] = {}  # model key -> devices holding or loading it
        self.pending = 0  # requests accepted and not yet finished
        self.counters: Counter[str] = Counter()  # monotonic event counts, read by stats and benchmarks
        self._expiry: list[tuple[float, int, InferenceRequest]] = []
        self._decision = Decision()

    # ---------------------------------------------------------------- models

    def add_model(self, spec: ModelSpec, weight_bytes: int, seeds: dict[int, float] | None = None,
                  seed_kind: str = "cpu") -> None:
        self.models[spec.key] = ModelEntry(spec, weight_bytes)
        if seeds:
            self.estimator.seed_infer(spec.key, seed_kind, seeds, spec.batch_sizes)

    def seed(self, key: str, kind: str, infer: dict[int, float], load: float | None) -> None:
        """Seed a model's estimates on one device kind from a profile (measured, or stored)."""
        entry = self.models[key]
        self.estimator.seed_infer(key, kind, infer, entry.spec.batch_sizes)
        if load is not None:
            self.estimator.observe_load(key, kind, load)

    def remove_model(self, key: str, now: float) -> Decision:
        """Stop serving a model: fail its queued requests and unload it everywhere."""
        entry = self.models.pop(key, None)
        if entry is not None:
            while entry.queue.head() is not None:
                self._finish(entry.queue.pop(), RequestStatus.FAILED,
                             Unavailable(f"model {entry.spec.name} version {entry.spec.version} was unloaded"), now)
            for dev in self.devices.values():
                if dev.memory.state(key) is not None and not dev.busy[key]:
                    self.issue_unload(entry.spec, dev, now)
        return self._take()

    # ---------------------------------------------------------------- requests

    def submit(self, req: InferenceRequest, now: float) -> None:
        """Admit a request or raise the error to answer with at once."""
        entry = self.models.get(req.model.key)
        if entry is None:
            raise NotFound(f"unknown model {req.model.name} version {req.model.version}")
        if self.pending >= self.settings.max_pending:
            self.counters["refused_overload"] += 1
            raise Overloaded(f"the daemon holds {self.pending} requests, its limit (controller.max_pending)")
        if entry.queue.requests >= self.settings.max_pending_per_model:
            self.counters["refused_overload"] += 1
            raise Overloaded(f"model {req.model.name} has {entry.queue.requests} requests queued, its limit "
                             "(controller.max_pending_per_model)")
        best = self.best_case(req)
        if now + best > req.deadline:
            self.counters["refused_deadline"] += 1
            raise DeadlineExceeded(
                f"deadline cannot be met: {max(req.deadline - now, 0) * 1e3:.3f} ms left, but running "
                f"{req.samples} sample(s) of {req.model.name} takes at least {best * 1e3:.3f} ms")
        req.cold_start = not any(d.memory.is_ready(req.model.key) for d in self.devices.values())
        self.counters["admitted"] += 1
        self.counters["cold_starts"] += req.cold_start
        req.status = RequestStatus.QUEUED
        entry.queue.push(req)
        self._active.add(req.model.key)
        self.pending += 1
        heapq.heappush(self._expiry, (req.deadline - best, req.id, req))
        self.policy.on_submit(self, req, now)

    def cancel(self, req: InferenceRequest, now: float) -> Decision:
        """The client went away. A queued request is dropped; a running one's answer is discarded."""
        if req.status == RequestStatus.QUEUED:
            self.models[req.model.key].queue.discard(req)
            self._finish(req, RequestStatus.CANCELLED, None, now)
        elif req.status == RequestStatus.RUNNING:
            req.status = RequestStatus.CANCELLED  # the result is dropped when it comes back
            self.pending -= 1
        return self._take()

    def active(self) -> list[ModelEntry]:
        """The models with queued requests: what policies need to look at, not every model."""
        out = []
        for key in list(self._active):
            entry = self.models.get(key)
            if entry is None or not entry.queue.requests:
                self._active.discard(key)
            else:
                out.append(entry)
        return out

    def best_case(self, req: InferenceRequest) -> float:
        """The shortest time `req` could take on an idle device with its model loaded."""
        ests = [e for k in self.kinds if (e := self._infer_est(req.model, req.samples, k)) is not None]
        return min(ests) if ests else 0.0

    def _infer_est(self, spec: ModelSpec, samples: int, kind: str) -> float | None:
        rows = samples if kind in EXACT_ROW_KINDS else spec.batch_size_for(samples)
        return self.estimator.infer(spec.key, rows, kind)

    def estimate(self, key: str, samples: int, kind: str) -> float:
        """Seconds to run `samples` samples of a model on a device of `kind` (padded where it pads)."""
        spec = self.models[key].spec if key in self.models else None
        if spec is None:
            return 0.0
        est = self._infer_est(spec, samples, kind)
        if est is None:  # unseen here: borrow any kind's estimate rather than assume zero
            known = [e for k in self.kinds if (e := self._infer_est(spec, samples, k)) is not None]
            est = max(known) if known else 0.0
        return est

    # ---------------------------------------------------------------- scheduling

    def schedule(self, now: float) -> Decision:
        self._expire(now)
        self.policy.schedule(self, now)
        return self._take()

    def next_wakeup(self, now: float) -> float | None:
        """When `schedule` next has something to do without new requests or results."""
        while self._expiry and self._expiry[0][2].status != RequestStatus.QUEUED:
            heapq.heappop(self._expiry)
        times = [t for t in (self._expiry[0][0] if self._expiry else None, self.policy.next_wakeup(self, now))
                 if t is not None]
        return min(times) if times else None

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if req.status != RequestStatus.QUEUED:
                continue
            best = self.best_case(req)
            if now + best <= req.deadline:  # still feasible (the estimate improved since it was queued)
                # strictly later than now, or a request exactly at its boundary would spin here
                heapq.heappush(heap, (max(req.deadline - best, now + 1e-6), req.id, req))
                continue
            self.models[req.model.key].queue.discard(req)
            self._finish(req, RequestStatus.FAILED, self.deadline_error(req, now), now)

    @staticmethod
    def deadline_error(req: InferenceRequest, now: float) -> DeadlineExceeded:
        return DeadlineExceeded(f"deadline cannot be met: {max(req.deadline - now, 0) * 1e3:.3f} ms left after "
                                f"{(now - req.arrival) * 1e3:.3f} ms queued")

    def _take(self) -> Decision:
        d, self._decision = self._decision, Decision()
        return d

    def _finish(self, req: InferenceRequest, status: RequestStatus, error: EscapementError | None,
                now: float = 0.0) -> None:
        req.status = status
        req.error = error
        req.finished_at = now
        self.pending -= 1
        self._decision.finished.append(req)
        self.telemetry.request(req)
        if status == RequestStatus.SUCCEEDED:
            self.counters["succeeded"] += 1
            self.counters["met_deadline" if now <= req.deadline else "missed_deadline"] += 1
        elif status == RequestStatus.CANCELLED:
            self.counters["cancelled"] += 1
        else:
            self.counters[f"failed_{type(error).__name__}"] += 1

    # ---------------------------------------------------------------- actions (used by policies)

    def issue(self, action: Action, now: float) -> Action:
        action.issued_at = now
        self.inflight[action.id] = action
        self._decision.actions.append(action)
        return action

    def issue_infer(self, spec: ModelSpec, dev: DeviceState, requests: list[InferenceRequest], batch_size: int,
                    now: float, earliest: float, latest: float, expected: float) -> Action:
        for r in requests:
            r.status = RequestStatus.RUNNING
            r.dispatched_at = now
        dev.infer_inflight += 1
        dev.busy[spec.key] += 1
        dev.memory.touch(spec.key)
        self.counters["infer_actions"] += 1
        self.counters["infer_samples"] += sum(r.samples for r in requests)
        self.counters["infer_slots"] += batch_size
        return self.issue(Action(ActionKind.INFER, spec, dev.name, earliest, latest, expected, batch_size,
                                 requests, expected_start=earliest), now)

    def issue_load(self, spec: ModelSpec, dev: DeviceState, now: float) -> Action:
        entry = self.models[spec.key]
        dev.memory.reserve(spec.key, entry.weight_bytes)
        self.placed_on.setdefault(spec.key, set()).add(dev.name)
        self.counters["loads"] += 1
        dev.load_inflight += 1
        dev.busy[spec.key] += 1
        expected = self.estimator.load(spec.key, dev.kind) or 0.0
        return self.issue(Action(ActionKind.LOAD, spec, dev.name, now, float("inf"), expected,
                                 expected_start=now), now)

    def issue_unload(self, spec: ModelSpec, dev: DeviceState, now: float) -> Action:
        dev.memory.release(spec.key)
        self._unplace(spec.key, dev.name)
        dev.load_inflight += 1
        self.counters["unloads"] += 1
        return self.issue(Action(ActionKind.UNLOAD, spec, dev.name, now, float("inf"), expected_start=now), now)

    def _unplace(self, key: str, device: str) -> None:
        for index in (self.ready_on, self.placed_on):
            devs = index.get(key)
            if devs is not None:
                devs.discard(device)
                if not devs:
                    del index[key]

    def fail_request(self, req: InferenceRequest, error: EscapementError, now: float) -> None:
        """Finish a request the policy has taken out of its queue."""
        self._finish(req, RequestStatus.FAILED, error, now)

    # ---------------------------------------------------------------- results

    def on_result(self, result: Result, now: float) -> Decision:
        action = self.inflight.pop(result.action.id, None)
        if action is None:
            log.error("result for an unknown action %r", result.action)
            return self._take()
        dev = self.devices[action.device]
        self.telemetry.action(result)
        if action.kind == ActionKind.INFER:
            self._infer_done(action, dev, result, now)
        elif action.kind == ActionKind.LOAD:
            self._load_done(action, dev, result, now)
        else:
            dev.load_inflight -= 1
            if not result.ok:
                log.error("unload of %s on %s failed: %s", action.model.key, dev.name, result.error)
        self.policy.on_result(self, result, now)
        return self._take()

    def _infer_done(self, action: Action, dev: DeviceState, result: Result, now: float) -> None:
        dev.infer_inflight -= 1
        dev.busy[action.model.key] -= 1
        key = action.model.key
        if result.ok:
            assert result.outputs is not None
            rows = action.samples if dev.kind in EXACT_ROW_KINDS else action.batch_size
            self.estimator.observe_infer(key, rows, dev.kind, result.end - result.begin)
            off = 0
            for r in action.requests:
                n = r.samples
                if r.status == RequestStatus.RUNNING:
                    r.outputs = tuple(o[off : off + n] for o in result.outputs)
                    r.compute_s = result.duration
                    self._finish(r, RequestStatus.SUCCEEDED, None, now)
                off += n
            return
        live = [r for r in action.requests if r.status == RequestStatus.RUNNING]
        self.counters[f"infer_{result.status.name.lower()}"] += 1
        if result.status == ResultStatus.FAILED:
            log.error("%r failed: %s", action, result.error)
            for r in live:
                self._finish(r, RequestStatus.FAILED, InternalError(f"inference failed: {result.error}"), now)
            return
        # Refused for its window (or cancelled): back to the queue, if there is still time.
        entry = self.models.get(key)
        retry: list[InferenceRequest] = []
        for r in live:
            if entry is not None and now + self.best_case(r) <= r.deadline:
                r.status = RequestStatus.QUEUED
                retry.append(r)
            else:
                self._finish(r, RequestStatus.FAILED, self.deadline_error(r, now), now)
        if retry and entry is not None:
            entry.queue.push_front(retry)
            self._active.add(key)

    def _load_done(self, action: Action, dev: DeviceState, result: Result, now: float) -> None:
        dev.load_inflight -= 1
        key = action.model.key
        dev.busy[key] -= 1
        entry = self.models.get(key)
        if result.ok:
            self.estimator.observe_load(key, dev.kind, result.end - result.begin)
            dev.memory.loaded(key)
            self.ready_on.setdefault(key, set()).add(dev.name)
            if entry is None:  # removed while loading
                self.issue_unload(action.model, dev, now)
            else:
                entry.load_failures = 0
            return
        dev.memory.release(key)
        self._unplace(key, dev.name)
        self.counters["load_failures"] += 1
        log.error("load of %s on %s failed: %s", key, dev.name, result.error)
        if entry is not None:
            entry.load_failures += 1
            err = Unavailable(f"loading model {action.model.name} on {dev.name} failed: {result.error}")
            while entry.queue.head() is not None:
                self._finish(entry.queue.pop(), RequestStatus.FAILED, err, now)

    def abort_all(self, error: EscapementError, now: float) -> Decision:
        """Finish every queued and running request with `error` (late results are then dropped)."""
        for entry in self.models.values():
            while entry.queue.head() is not None:
                self._finish(entry.queue.pop(), RequestStatus.FAILED, error, now)
        for action in self.inflight.values():
            for r in action.requests:
                if r.status == RequestStatus.RUNNING:
                    self._finish(r, RequestStatus.FAILED, error, now)
        return self._take()

    # ---------------------------------------------------------------- views

    def statistics(self) -> dict[str, object]:
        return {
            "policy": self.policy.name,
            "counters": dict(self.counters),
            "telemetry": self.telemetry.summary(),
            "pending": self.pending,
            "inflight_actions": len(self.inflight),
            "queued": {k: e.queue.requests for k, e in self.models.items() if e.queue.requests},
            "devices": {n: {"used": d.memory.used, "budget": d.memory.budget, "models": d.memory.models()}
                        for n, d in self.devices.items()},
        }
