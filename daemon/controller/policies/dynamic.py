"""The `dynamic` policy: Triton / Clipper-style dynamic batching, kept as the baseline.

- A device runs one batch at a time (like one Triton model instance). When it is free, the
  model on it whose oldest request has waited longest gets a batch of as many queued samples
  as fit in `max_batch_size`, once the batch is full or `max_queue_delay` has passed.
- Requests that cannot finish by their deadline at that point are answered at once with a
  deadline error rather than run late.
- A model with queued requests that is on no device is loaded on demand, onto the device with
  the most free weight memory, unloading least-recently-used models nobody is waiting for
  first when the budget is full.
- Cross-model batching (controller/sharing.py, as under `clockwork`): a batch of a model whose
  leading stage other models share takes in their queued requests too, each with at most as
  many rows as the policy would run for it alone, when every request still meets its deadline
  by the stage estimates, on devices that keep shared weights once; the stage then runs once.
"""

from __future__ import annotations

from daemon.actions import Result
from daemon.controller import sharing
from daemon.controller.decisions import Drop, Infer, Load, Steps, Unload
from daemon.controller.memory import CallableRules
from daemon.controller.policy import Policy
from daemon.controller.state import LATEST_GRACE, DeviceState, ModelEntry
from daemon.controller.view import ControllerView
from daemon.errors import Unavailable
from daemon.model import ModelSpec
from daemon.request import InferenceRequest


class DynamicBatchingPolicy(Policy):
    name = "dynamic"

    def __init__(self, max_queue_delay: float = 0.0, cross_model: bool = True) -> None:
        self.max_queue_delay = max_queue_delay
        self.cross_model = cross_model
        self._wake: float | None = None

    def next_wakeup(self, view: ControllerView, now: float) -> float | None:
        return self._wake

    def on_submit(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, now: float) -> None:
        pass

    def on_result(self, view: ControllerView, result: Result, now: float) -> None:
        pass

    def on_queued(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        pass

    def on_late(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        pass

    def schedule(self, view: ControllerView, now: float) -> Steps:
        self._wake = None
        lane = view.late_work()
        for entry in view.active() + [e for e in lane if not e.queue.requests]:
            if not any(d.memory.state(entry.key) is not None for d in view.devices.values()):
                yield from self._place(view, entry, now)
        for dev in view.devices.values():
            while dev.infer_inflight == 0:
                picked = self._pick(view, dev, now)
                if picked is None:
                    # nothing on time to run here: the best-effort lane, oldest first
                    yield from self._dispatch_lane(view, dev, lane)
                    break
                if not (yield from self._dispatch(view, dev, picked, now)):
                    break

    # ---------------------------------------------------------------- batches

    def _pick(self, view: ControllerView, dev: DeviceState, now: float) -> ModelEntry | None:
        best: ModelEntry | None = None
        best_arrival = float("inf")
        for entry in view.active():
            key = entry.key
            if not dev.memory.is_ready(key):
                continue
            if not dev.healthy_for(key, now) and any(
                    view.devices[n].healthy_for(key, now) for n in view.ready_on.get(key, ()) if n != dev.name):
                continue  # another device holding it serves it (failures here just now, a warm-up)
            head = entry.queue.head()
            if head is None:
                continue
            full = entry.queue.samples >= self._cap(entry.spec)
            due = head.arrival + self.max_queue_delay
            if not full and now < due:
                self._wake = due if self._wake is None else min(self._wake, due)
                continue
            if head.arrival < best_arrival:
                best, best_arrival = entry, head.arrival
        return best

    def _cap(self, spec: ModelSpec) -> int:
        """The most samples one batch of `spec` may hold: its max_batch_size (AIMD adapts it)."""
        return spec.max_batch_size

    def _dispatch(self, view: ControllerView, dev: DeviceState, entry: ModelEntry, now: float) -> Steps:
        spec, q = entry.spec, entry.queue
        taken: list[InferenceRequest] = []
        samples = 0
        cap = self._cap(spec)
        for r in q.first(cap):  # oldest deadlines first, as many as fit (the first one always)
            if taken and samples + r.samples > cap:
                break
            taken.append(r)
            samples += r.samples
        if not taken:
            return False
        while True:  # drop what cannot finish in time; the batch may then shrink
            b = spec.batch_size_for(samples)
            est = view.estimate(spec.key, samples, dev)
            keep = [r for r in taken if now + est <= r.deadline]
            for r in taken:
                if now + est > r.deadline:
                    yield Drop(r)
            if len(keep) == len(taken):
                break
            taken, samples = keep, sum(r.samples for r in keep)
            if not taken:
                return True  # the device is still free: look for more work
        deadline = min(r.deadline for r in taken)
        group = self._group(view, entry, taken, dev, now) if self.cross_model else None
        if group is not None:
            members, est = group
            samples, deadline = sharing.joined(members, samples, deadline)
            b = spec.batch_size_for(samples)
        latest = max(deadline - est, now + LATEST_GRACE)
        yield Infer(spec, dev.name, taken, b, latest, est, group=group[0] if group is not None else None)
        return True

    def _group(self, view: ControllerView, entry: ModelEntry, taken: list[InferenceRequest], dev: DeviceState,
               now: float) -> tuple[sharing.Members, float] | None:
        """Other models' requests that can join this batch to share its prefix (sharing.py)."""
        if not sharing.allowed(dev, entry):
            return None
        cands = sharing.candidates(view, entry)
        if not cands:
            return None
        return sharing.extend(view, dev, entry, taken, now, cands, now, limit=self._cap)

    @staticmethod
    def _dispatch_lane(view: ControllerView, dev: DeviceState, lane: list[ModelEntry]) -> Steps:
        ready = [e for e in lane if e.late.requests and dev.memory.is_ready(e.spec.key)]
        if not ready:
            return
        entry = min(ready, key=lambda e: (h.rank, h.arrival) if (h := e.late.head()) is not None else (0, 0.0))
        spec = entry.spec
        taken: list[InferenceRequest] = []
        rows = 0
        for r in entry.late.first(spec.max_batch_size):
            if rows + r.samples > spec.max_batch_size:
                break
            taken.append(r)
            rows += r.samples
        if taken:
            yield Infer(spec, dev.name, taken, spec.batch_size_for(rows), float("inf"),
                        view.estimate(spec.key, rows, dev), best_effort=True)

    # ---------------------------------------------------------------- loads

    def _place(self, view: ControllerView, entry: ModelEntry, now: float) -> Steps:
        nbytes = entry.weight_bytes
        fits = [d for d in view.devices.values() if d.memory.budget >= nbytes]
        if not fits:
            err = Unavailable(f"model {entry.spec.name} needs {nbytes} bytes of weights, more than any "
                              "device's weight budget" if view.lost < len(view.devices) else
                              "every device of this daemon has failed")
            for r in list(entry.queue):
                yield Drop(r, err)
            return
        fits = [d for d in fits if d.can_load(entry.key, now)]
        free = [d for d in fits if d.memory.free >= d.memory.missing(nbytes, entry.blocks_on(d.kind))]
        if free:
            dev = min(free, key=lambda d: (d.infer_inflight + d.load_inflight, -d.memory.free))
            yield Load(entry.spec, dev.name)
            return

        def wanted(k: str) -> bool:  # (work in its lane counts: evicting it for another lane model thrashes)
            e = view.models.get(k)
            return e is not None and (e.queue.requests > 0 or e.late.requests > 0)

        # Best-effort work alone never displaces a model with work of its own (it would thrash: each
        # lane model evicting the last one before it ran).
        lane_only = not entry.queue.requests
        options = []
        for d in fits:
            def evictable(k: str, d: DeviceState = d) -> bool:
                return d.busy[k] == 0 and not (lane_only and wanted(k))
            blocks = entry.blocks_on(d.kind)
            victims = d.memory.victims(d.memory.missing(nbytes, blocks), CallableRules(evictable, wanted),
                                       keep=d.memory.present(blocks))
            if victims is not None:
                options.append((sum(wanted(k) for k in victims), len(victims), d.name, d, victims))
        if not options:
            return  # everything is busy; try again when a result frees something
        *_, dev, victims = min(options, key=lambda o: o[:3])
        for k in victims:
            victim = view.models[k].spec if k in view.models else None
            if victim is not None:
                yield Unload(victim, dev.name)
        yield Load(entry.spec, dev.name)
