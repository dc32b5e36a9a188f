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

import logging
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Final

import numpy as np

from daemon.actions import LOAD_FLOOR_BPS, Action, ActionKind, Failure, Result, ResultStatus
from daemon.config import ControllerSettings
from daemon.controller import due as dues
from daemon.controller.classes import max_queue
from daemon.controller.decisions import Drop, Infer, Load, Pass, Planned, Release, Save, Step, Steps, Unload
from daemon.controller.due import Due, action_due, action_of, request_due, request_of
from daemon.controller.estimates import EXACT_ROW_KINDS, Estimator
from daemon.controller.floats import fmax, fmin
from daemon.controller.memory import Blocks, CallableRules, DeviceMemory
from daemon.controller.state import (
    FAILURE_COOLDOWN,
    LOAD_BACKOFF,
    MAX_FAILURES,
    NO_MEMORY_RETRIES,
    OVERDUE_GRACE,
    Decision,
    DeviceState,
    ModelEntry,
)
from daemon.controller.view import ControllerView
from daemon.errors import (
    BadRequest,
    DeadlineExceeded,
    EscapementError,
    InternalError,
    NotFound,
    Overloaded,
    Unavailable,
)
from daemon.model import ModelSpec
from daemon.observability.telemetry import Telemetry
from daemon.parity.groups import ActionRole, Coding
from daemon.parity.planner import ParityPlanner
from daemon.request import InferenceRequest, RequestClass, RequestStatus
from daemon.runtime.devices import Device
from daemon.runtime.program import prefix_key, tail_key

if TYPE_CHECKING:
    from daemon.controller.policy import Policy

log = logging.getLogger("escapement.controller")

# How busy a backlogged model's devices really were, for admission: measured over windows of
# DRAIN_WINDOW seconds, trusted once a window spans DRAIN_MIN_SPAN; never taken below BUSY_FLOOR.
DRAIN_WINDOW = 1.0
DRAIN_MIN_SPAN = 0.2
BUSY_FLOOR: Final = 0.1
# the event count of each failure's class ("failed_DeadlineExceeded"), made once per class
_FAILED_NAMES: Final[dict[type, str]] = {}

class Scheduler(ControllerView):
    def __init__(self, devices: list[Device], policy: Policy, settings: ControllerSettings,
                 estimator: Estimator | None = None, telemetry: Telemetry | None = None,
                 hung_after_s: float = 30.0) -> None:
        self.settings = settings
        self.max_pending = settings.max_pending  # (read per request: a plain attribute, not the settings')
        self.hung_after_s = hung_after_s
        self.policy = policy
        self.estimator = estimator or Estimator()
        self.telemetry = telemetry or Telemetry()
        # Monotonic event counts, read by stats and benchmarks (an absent one reads 0) through
        # `counters`. A defaultdict, not a Counter: a class made in Python over dict reads and writes
        # items through generic calls (~1.5k instructions an increment, compiled), a defaultdict as
        # dict does. The events of every request and INFER are plain fields, folded in when
        # `counters` is read: an increment of a dict item is ~400 instructions, ~7 of them a request.
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._admitted = 0
        self._cold_starts = 0
        self._succeeded = 0
        self._met_deadline = 0
        self._missed_deadline = 0
        self._infer_actions = 0
        self._loads = 0  # (LOADs and UNLOADs too: one each per cold start at 10,000 models)
        self._unloads = 0
        self._infer_samples = 0
        self._infer_slots = 0
        self.parm = ParityPlanner(self._counts)
        self.devices: dict[str, DeviceState] = {d.name: DeviceState(d, DeviceMemory(d.model_budget,
                                                                                      d.shares_weights))
                                                for d in devices}
        self.kinds = sorted({d.kind for d in devices})
        self.models: dict[str, ModelEntry] = {}
        self.inflight: dict[int, Action] = {}
        self._active: set[str] = set()  # models that may have queued requests (pruned lazily)
        # cross-model INFER id -> (model, samples) counted in each member's `running` (a plain INFER
        # keeps its count on itself: Action.running)
        self._running_groups: dict[int, list[tuple[str, int]]] = {}
        # Where each model's weights are, derived from the devices' memory maps and kept with them.
        # model key -> devices holding it ready / holding or loading it, while any does: each set is
        # also its entry's `ready` / `placed` (set here: `mark_ready`, `mark_placed`, `_unplace`)
        self.ready_on: dict[str, set[str]] = {}
        self.placed_on: dict[str, set[str]] = {}
        self.pending = 0  # requests accepted and not yet finished
        self.lost = 0  # devices lost (a sticky error or a hang): nothing is placed there any more
        self._expiry: list[Due] = []  # request_due: when a queued request would turn hopeless
        # The best-effort lane: models with lane requests (pruned lazily), when lane requests give up,
        # and the input bytes of requests that may wait there (every one not HARD), bounded.
        self.late_keys: set[str] = set()
        self._giveup: list[Due] = []  # request_due
        self.soft_bytes = 0
        # Every action in flight, once, by when it must be looked at again: an INFER's requests
        # overdue, or it counts as hung (the last field); one entry per action rather than one
        # per watch (a heap push and pop fewer per INFER). LOADs and UNLOADs apart: they are
        # looked at only when they would count as hung, seconds on, so their entries (popped
        # long after their results) outnumbered the INFERs' tenfold at 10,000 models and deepened
        # every INFER's push and pop (issue 12's callgrind).
        self._watches: list[Due] = []  # action_due, INFERs
        self._weight_watches: list[Due] = []  # action_due, LOADs and UNLOADs
        self.hung: dict[str, str] = {}  # device -> what hangs there (it never comes back in this process)
        self._decision = Decision()
        self._load_share: dict[int, float] = {}  # LOAD id -> the share of its model's bytes it copies

    @property
    def coding(self) -> Coding:
        """ParM's coding groups (read by health checks and metrics)."""
        return self.parm.coding

    # ---------------------------------------------------------------- models


    @property
    def counters(self) -> defaultdict[str, int]:
        """Every event counted, by name. One dict, the same object at every read; the per-request and
        per-INFER counts in it are brought up to date at each read (a reference kept sees those as
        of its last read, and every other count live)."""
        c = self._counts
        for name, n in (("admitted", self._admitted), ("cold_starts", self._cold_starts),
                        ("succeeded", self._succeeded), ("met_deadline", self._met_deadline),
                        ("missed_deadline", self._missed_deadline), ("infer_actions", self._infer_actions),
                        ("infer_samples", self._infer_samples), ("infer_slots", self._infer_slots),
                        ("loads", self._loads), ("unloads", self._unloads)):
            if n:
                c[name] = n
        return c
    def add_model(self, spec: ModelSpec, weight_bytes: int, seeds: dict[int, float] | None = None,
                  seed_kind: str = "cpu", blocks: Blocks = (), prefix: str = "", stage_blocks: Blocks = ()) -> None:
        """`blocks`: the model's weights by content; devices that share blocks hold each once.
        `prefix`: a plan of stages' leading stage (models with one prefix may batch it together).
        `stage_blocks`: that stage's weights as one block, as devices that hold weights by extent
        (CUDA) share them."""
        key = spec.key
        entry = self.models[key] = ModelEntry(spec, weight_bytes, blocks, stage_blocks, prefix=prefix)
        entry.max_queued = max_queue(spec, self.settings)[0]
        entry.estimates = self.estimator.of(key)
        # (a model added again while its weights are still placed: the sets already mapped)
        entry.ready = self.ready_on.get(key) or entry.ready
        entry.placed = self.placed_on.get(key) or entry.placed
        self.telemetry.model(spec)  # its statistics, made now rather than at its first answer (on the loop)
        if seeds:
            self.estimator.seed_infer(spec.key, seed_kind, seeds, spec.batch_sizes)

    def seed_stages(self, key: str, kind: str, timings: dict[int, tuple[float, float]]) -> None:
        """Seed a plan's per-stage estimates (its prefix, shared, and the rest, its own) on a kind."""
        entry = self.models[key]
        if not entry.prefix or not timings:
            return
        sizes = entry.spec.batch_sizes
        self.estimator.seed_infer(prefix_key(entry.prefix), kind, {b: t[0] for b, t in timings.items()}, sizes)
        self.estimator.seed_infer(tail_key(key), kind, {b: t[1] for b, t in timings.items()}, sizes)

    def preload(self, key: str, replicas: int, now: float, avoid: set[str] | None = None) -> list[str]:
        """Load a model onto up to `replicas` devices with room (not those in `avoid`), least used
        first; returns the devices chosen. Used at start-up for models marked to preload."""
        entry = self.models[key]
        chosen: list[str] = []
        devs = sorted(self.devices.values(), key=lambda d: (d.name in (avoid or set()), -d.memory.free, d.name))
        for dev in devs:
            if len(chosen) >= replicas:
                break
            if dev.memory.state(key) is not None or dev.failed or \
                    dev.memory.free < dev.memory.missing(entry.weight_bytes, entry.blocks_on(dev.kind)):
                continue
            self.issue_load(entry.spec, dev, now)
            chosen.append(dev.name)
        return chosen

    def reserve(self, key: str, nbytes: int, kind: str, now: float) -> str | None:
        """Room for work outside the scheduler (a warm-up) of `nbytes` on a healthy device of `kind`,
        evicting idle models if needed; the device (the bytes stay reserved until `unreserve`), or
        None when every such device is busy or too small."""
        # the device with the least live work: a warm-up beside live INFERs delays them and
        # measures them too; while it runs, INFERs go to other devices holding their model
        devs = sorted((d for d in self.devices.values() if d.kind == kind and not d.failed and not d.warming),
                      key=lambda d: (sum(d.busy.values()), len(d.memory.ready_models()), -d.memory.free, d.name))
        for dev in devs:
            def evictable(k: str, d: DeviceState = dev) -> bool:
                return d.busy[k] == 0 and k in self.models
            victims = dev.memory.victims(nbytes, CallableRules(
                evictable, lambda k: k in self.models and self.models[k].queue.requests > 0))
            if victims is None:
                continue
            for k in victims:
                self.issue_unload(self.models[k].spec, dev, now)
            dev.memory.reserve(key, nbytes)
            dev.warming = key
            return dev.name
        return None

    def unreserve(self, key: str, device: str, now: float) -> None:
        dev = self.devices[device]
        if dev.memory.state(key) is not None:
            dev.memory.release(key)
        if dev.warming == key:
            dev.warming = ""
            for k in dev.memory.ready_models():  # work kept off the device may come back to it
                entry = self.models.get(k)
                if entry is not None and entry.queue.requests:
                    self.policy.on_queued(self, entry, now)

    def seed(self, key: str, kind: str, infer: dict[int, float], load: float | None, load_share: float = 1.0
             ) -> None:
        """Seed a model's estimates on one device kind from a profile (measured, or stored); `load_share`:
        the share of its bytes that LOAD copied (below 1 where the device held some of them)."""
        entry = self.models[key]
        self.estimator.seed_infer(key, kind, infer, entry.spec.batch_sizes)
        if load is not None:
            self.estimator.observe_load(key, kind, load, share=load_share)

    def remove_model(self, key: str, now: float) -> Decision:
        """Stop serving a model: fail its queued requests and unload it everywhere."""
        entry = self.models.pop(key, None)
        if entry is not None:
            self._fail_queued(entry, Unavailable(f"model {entry.spec.name} version {entry.spec.version} was unloaded"),
                              now)
            for dev in self.devices.values():
                if dev.memory.state(key) is not None and not dev.busy[key]:
                    self.issue_unload(entry.spec, dev, now)
        return self._take()

    # ---------------------------------------------------------------- requests

    def submit(self, req: InferenceRequest, now: float) -> None:
        """Admit a request or raise the error to answer with at once."""
        self.estimator.now = now
        entry = self.models.get(req.key)
        if entry is None:
            raise NotFound(f"unknown model {req.model.name} version {req.model.version}")
        if req.samples > entry.max_batch_size:  # the frontends check this; no batch could hold it
            raise BadRequest(f"{req.samples} samples exceed model {req.model.name}'s max_batch_size "
                             f"{entry.spec.max_batch_size}")
        if self.lost == len(self.devices):
            raise Unavailable("every device of this daemon has failed: " + "; ".join(
                f"{d.name}: {d.failed}" for d in self.devices.values()))
        if entry.load_failures and not entry.placed:
            self._refuse_backing_off(entry, now)
        if self.pending >= self.max_pending:
            self._counts["refused_overload"] += 1
            raise self.telemetry.refused(req, Overloaded(f"the daemon holds {self.pending} requests, its limit "
                                          "(controller.max_pending)"), now)
        if entry.queue.requests + entry.late.requests >= entry.max_queued:
            self._counts["refused_overload"] += 1
            key = max_queue(entry.spec, self.settings)[1]
            raise self.telemetry.refused(req, Overloaded(
                f"model {req.model.name} has {entry.queue.requests + entry.late.requests} requests queued, its "
                f"limit ({key})"), now)
        soft = req.klass != RequestClass.HARD
        nbytes = 0
        if soft:
            nbytes = req.nbytes
            if self.soft_bytes + nbytes > self.settings.best_effort_bytes:
                self._counts["refused_overload"] += 1
                raise self.telemetry.refused(req, Overloaded(
                    f"the best-effort lane holds {self.soft_bytes} bytes of requests that may be answered late, "
                    f"its limit (controller.best_effort_bytes = {self.settings.best_effort_bytes}); retry later"), now)
        best = self._best_case(req, entry)
        if soft and (req.klass == RequestClass.BEST_EFFORT or now + best > req.deadline):
            # late from the start: no deadline to refuse it for, only the lane's bounds
            self._admit(req, entry, nbytes)
            self._to_lane(req, entry, now)
            return
        if now + best > req.deadline:
            self._counts["refused_deadline"] += 1
            raise self.telemetry.refused(req, DeadlineExceeded(
                f"deadline cannot be met: {max(req.deadline - now, 0) * 1e3:.3f} ms left, but running "
                f"{req.samples} sample(s) of {req.model.name} takes at least {best * 1e3:.3f} ms"), now)
        q = entry.queue
        if not q.samples:
            entry.backlog_ended()
        elif not entry.backlog_since:
            self._backlog_began(entry, now)
        if q.samples and q.max_rank <= req.rank and q.max_deadline <= req.deadline and not soft:
            # Every queued request goes first, and what runs now. The queue runs in whole batches:
            # the request finishes with the one that holds its samples, at the rate the devices
            # holding the model get through it: their best, times the share of the time they
            # really ran batches while it waited (`_busy_share`). Past its deadline it is refused
            # now, in µs, rather than queued to miss it and be answered 504 at the deadline.
            # (Not the rate this model alone got while it waited, as before: devices busy with
            # other work give a model more as its head ages, and a queue cut short runs in smaller
            # batches that get through less, so that rate refused requests that would have made it:
            # ~2% at 75,000 req/s below capacity, ~8% of capacity at 100,000. What is admitted
            # past what the devices then run is answered 504 by its deadline instead:
            # bench/results/scale-admission-issue12.md.)
            rate = self._drain_rate(entry)
            batch = entry.max_batch_size
            batches = -(-(q.samples + req.samples) // batch)
            done = (entry.running + batches * batch) / rate if rate > 0 else 0.0
            if done > 0.0 and now + done / BUSY_FLOOR > req.deadline:  # (else no share could refuse it)
                done /= self._busy_share(entry, now)
            if now + fmax(done, best) > req.deadline:
                self._counts["refused_backlog"] += 1
                raise self.telemetry.refused(req, Overloaded(
                    f"model {req.model.name} is overloaded: with the {q.samples} sample(s) queued before it, this "
                    f"request cannot finish in under {done * 1e3:.1f} ms, and its deadline is "
                    f"{(req.deadline - now) * 1e3:.1f} ms away; retry later", retry_after_s=max(1.0, done)), now)
        self._admit(req, entry, nbytes)
        entry.queue.push(req)
        self._active.add(req.key)
        dues.push(self._expiry, request_due(req.deadline - best, req))
        self.policy.on_submit(self, entry, req, now)

    def _admit(self, req: InferenceRequest, entry: ModelEntry, nbytes: int) -> None:
        """`nbytes`: a request that is not hard holds its inputs' bytes of the best-effort lane's budget."""
        req.cold_start = not entry.ready
        self._admitted += 1
        if req.cold_start:
            self._cold_starts += 1
        req.status = RequestStatus.QUEUED
        self.pending += 1
        if nbytes:
            req.lane_bytes = nbytes
            self.soft_bytes += nbytes

    def _to_lane(self, req: InferenceRequest, entry: ModelEntry, now: float) -> None:
        """`req` cannot make its target (or never had one): it waits in its model's best-effort lane,
        to be answered late, until `give_up_at`."""
        if not req.late:
            req.late = True
            self._counts["best_effort" if req.klass == RequestClass.BEST_EFFORT else "moved_late"] += 1
        # Armed on every entry: back from an INFER that did not run, its entry was dropped while it ran
        # (next_wakeup pops those of requests not queued), and nothing else would answer it by then.
        dues.push(self._giveup, request_due(req.give_up_at, req))
        req.status = RequestStatus.QUEUED
        entry.late.push(req)
        self.late_keys.add(entry.key)
        self.policy.on_late(self, entry, now)

    def late_work(self) -> list[ModelEntry]:
        """The models with requests in their best-effort lane."""
        out = []
        for key in list(self.late_keys):
            entry = self.models.get(key)
            if entry is None or not entry.late.requests:
                self.late_keys.discard(key)
            else:
                out.append(entry)
        return out

    def _went_cold(self, entry: ModelEntry, now: float) -> None:
        """A model left a device (or the last one): the policy must place it again for the work it
        has waiting, on time and in its lane (a lane that nobody loads would wait out its maximum)."""
        if entry.queue.requests:
            self.policy.on_queued(self, entry, now)
        if entry.late.requests and not entry.placed:
            self.policy.on_late(self, entry, now)

    def _give_up(self, now: float) -> None:
        """Lane requests that waited the longest a lane request may: 504, saying so."""
        heap = self._giveup
        while heap and heap[0].at <= now:
            req = request_of(dues.pop(heap))
            if req.status != RequestStatus.QUEUED or not req.late:
                continue
            self._drop_queued(req)
            self._counts["late_expired"] += 1
            self._finish(req, RequestStatus.FAILED, DeadlineExceeded(
                f"not served in {now - req.arrival:.1f} s: the devices had no time to spare for it beside on-time "
                f"work (controller.best_effort_max_wait_s = {self.settings.best_effort_max_wait_s:g} s)"), now)

    def _fail_queued(self, entry: ModelEntry, error: EscapementError, now: float) -> None:
        """Finish every request waiting for a model (on time or in its lane) with `error`."""
        for q in (entry.queue, entry.late):
            while q.head() is not None:
                self._finish(q.pop(), RequestStatus.FAILED, error, now)
        self._unwanted(entry)

    def _refuse_backing_off(self, entry: ModelEntry, now: float) -> None:
        """A model whose LOADs failed is refused while every device backs off from it."""
        key = entry.key
        healthy = [d for d in self.devices.values() if not d.failed]
        if healthy and not any(d.can_load(key, now) for d in healthy):
            wait = min(d.load_backoff[key] for d in healthy) - now
            raise Unavailable(f"model {entry.spec.name} version {entry.spec.version} failed to load "
                              f"({entry.load_error}); the next try is in {wait:.1f} s", retry_after_s=max(wait, 0.1))

    def cancel(self, req: InferenceRequest, now: float) -> Decision:
        """The client went away. A queued request is dropped; a running one's answer is discarded."""
        if req.status == RequestStatus.QUEUED:
            self._drop_queued(req)
            self._finish(req, RequestStatus.CANCELLED, None, now)
        elif req.status == RequestStatus.RUNNING:
            req.status = RequestStatus.CANCELLED  # the result is dropped when it comes back
            req.finished_at = now
            self.pending -= 1
            self.soft_bytes -= req.lane_bytes
            req.lane_bytes = 0
            self._counts["cancelled"] += 1
            self.telemetry.request(req)
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

    def _drained(self, entry: ModelEntry, now: float) -> None:
        """A batch of the model came back while its queue may still wait: a new window every
        DRAIN_WINDOW, the last one's busy share standing until the next spans DRAIN_MIN_SPAN."""
        if not entry.queue.samples:
            entry.backlog_ended()
            return
        span = now - entry.backlog_since
        if span >= DRAIN_WINDOW:
            share = self._ran_share(entry, now) if span >= DRAIN_MIN_SPAN else 0.0
            if share > 0.0:
                entry.drain_busy = share
            self._backlog_began(entry, now)

    def _backlog_began(self, entry: ModelEntry, now: float) -> None:
        entry.backlog_since = now
        ready = entry.ready
        entry.backlog_ran = self._ran_on(ready) if ready else 0.0
        entry.backlog_devices = len(ready)

    def _ran_on(self, names: set[str]) -> float:
        """Seconds the devices `names` have run batches so far, summed (`DeviceState.ran_s`)."""
        ran = 0.0
        devices = self.devices
        for name in names:
            ran += devices[name].ran_s
        return ran

    def _ran_share(self, entry: ModelEntry, now: float) -> float:
        """The share of the time since its window began that the devices holding the model ran
        batches (BUSY_FLOOR..1); 0 when that cannot be told: other devices hold it now, or no
        batch came back since (a batch is counted when it comes back: one running for longer
        than the window is no sign of idle devices, and a device that returns nothing at all is
        the hang watchdog's)."""
        ready = entry.ready
        span = now - entry.backlog_since
        if not ready or len(ready) != entry.backlog_devices or span <= 0.0:
            return 0.0
        ran = self._ran_on(ready)
        if ran <= entry.backlog_ran:
            return 0.0
        return fmin(fmax((ran - entry.backlog_ran) / (span * len(ready)), BUSY_FLOOR), 1.0)

    def _busy_share(self, entry: ModelEntry, now: float) -> float:
        """What admission expects of a backlogged model's devices, as a share of their best: the
        current window's busy share once it spans DRAIN_MIN_SPAN, else the last window's, else 1."""
        if entry.backlog_since and now - entry.backlog_since >= DRAIN_MIN_SPAN:
            share = self._ran_share(entry, now)
            if share > 0.0:
                return share
        return entry.drain_busy if entry.drain_busy > 0.0 else 1.0

    def _drain_rate(self, entry: ModelEntry) -> float:
        """Samples per second the devices holding a model ready could run of it at most (each at its
        most efficient batch size, nothing else); 0 when none holds it."""
        ready = entry.ready
        if not ready:
            return 0.0
        est = self.estimator
        rec = entry.estimates
        version = rec.version
        if entry.rate_version == version and entry.rate_holders == len(ready) and est.now <= entry.rate_until:
            return entry.rate
        rate, until = 0.0, math.inf
        for name in ready:
            kind = self.devices[name].kind
            best = 0.0
            for batch in entry.spec.batch_sizes:
                e, valid = est.infer_until_of(rec, batch, kind, name)
                if e:
                    best = fmax(best, batch / e)
                    until = fmin(until, valid)
            rate += best
        entry.rate, entry.rate_version, entry.rate_holders, entry.rate_until = rate, version, len(ready), until
        return rate

    def best_case(self, req: InferenceRequest) -> float:
        """The shortest time `req` could take on an idle device with its model loaded."""
        return self._best_case(req, self.models.get(req.key))

    def _best_case(self, req: InferenceRequest, entry: ModelEntry | None) -> float:
        """`best_case`, given the model's entry (None: not served)."""
        est, samples, key = self.estimator, req.samples, req.key
        # Kept on the model for the last row count asked, while what it was made from holds: the
        # model's estimates (their version, and until when each holds with nothing new observed)
        # and the devices holding models ready. The version moves only when a result moves an
        # estimate (Estimator._observed), so most arrivals find it standing (~3k instructions a
        # request at 75,000 req/s, where the model is on several devices).
        if entry is not None:
            rec = entry.estimates
            version = rec.version
            if entry.best_samples == samples and entry.best_version == version \
                    and entry.best_ready == entry.ready_changes and est.now <= entry.best_until:
                return entry.best_s
            ready = entry.ready
        else:
            rec = est.of(key)
            version = rec.version
            ready = self.ready_on.get(key) or set()
        padded = 0  # the batch size that holds it, for kinds that run whole batches (found once)
        best = math.inf
        until = math.inf
        # The devices holding the model (their recent runs), and each kind's profile: what any other
        # device would run it in once loaded (a device's own runs count only while it holds it).
        if ready:
            devices = self.devices
            for name in ready:
                kind = devices[name].kind
                rows = samples
                if kind not in EXACT_ROW_KINDS:
                    padded = padded or self._padded(req)
                    rows = padded
                e, valid = est.infer_until_of(rec, rows, kind, name)
                if valid < until:
                    until = valid
                if e is not None and e < best:
                    best = e
        for kind in self.kinds:
            rows = samples
            if kind not in EXACT_ROW_KINDS:
                padded = padded or self._padded(req)
                rows = padded
            e, valid = est.infer_until_of(rec, rows, kind)
            if valid < until:
                until = valid
            if e is not None and e < best:
                best = e
        out = best if best < math.inf else 0.0
        if entry is not None:
            entry.best_samples, entry.best_version, entry.best_ready = samples, version, entry.ready_changes
            entry.best_until, entry.best_s = until, out
        return out

    def _padded(self, req: InferenceRequest) -> int:
        entry = self.models.get(req.key)
        return entry.batch_size_for(req.samples) if entry is not None else req.model.batch_size_for(req.samples)

    def _infer_est(self, spec: ModelSpec, samples: int, kind: str, device: str | None = None) -> float | None:
        rows = samples if kind in EXACT_ROW_KINDS else spec.batch_size_for(samples)
        return self.estimator.infer(spec.key, rows, kind, device)

    def estimate(self, key: str, samples: int, where: DeviceState | str) -> float:
        """Seconds to run `samples` samples of a model on a device (or any device of a kind)."""
        spec = self.models[key].spec if key in self.models else None
        if spec is None:
            return 0.0
        kind, device = (where, None) if isinstance(where, str) else (where.kind, where.name)
        est = self._infer_est(spec, samples, kind, device)
        if est is None:  # unseen here: borrow any kind's estimate rather than assume zero
            known = [e for k in self.kinds if (e := self._infer_est(spec, samples, k)) is not None]
            est = max(known) if known else 0.0
        return est

    # ---------------------------------------------------------------- scheduling

    def schedule(self, now: float) -> Decision:
        self.estimator.now = now
        if self.parm.coding.groups:
            self._run(self.parm.due(self, now), now)
        if self._expiry and self._expiry[0].at <= now:
            self._expire(now)
        if (self._watches and self._watches[0].at <= now) or \
                (self._weight_watches and self._weight_watches[0].at <= now):
            self._watch(now)
        if self._giveup and self._giveup[0].at <= now:
            self._give_up(now)
        self._drive(self.policy.schedule(self, now), now)
        return self._take()

    def _drive(self, steps: Steps | Pass | Planned | tuple[()], now: float) -> None:
        """`_run` for a policy's pass, whose return value nobody reads. Most passes decide nothing:
        such a pass ends at the first `next`, which (given a default) raises nothing, where ending
        inside `_run`'s try costs a caught StopIteration and its traceback (~6k instructions
        compiled). A pass that yields is sent each step's action back, as `_run` does, and one
        that ends with `yield None` (`Pass`) is dropped there, not resumed to its end; a list
        (`Planned`) is applied in order, with nothing to send back or end."""
        if not steps:
            return
        if isinstance(steps, list):
            for planned in steps:
                self.apply(planned, now)
            return
        assert not isinstance(steps, tuple)
        step = next(steps, None)
        if step is None:
            return
        try:
            while True:
                step = steps.send(self.apply(step, now))
                if step is None:
                    return
        except StopIteration:
            return

    def _run(self, steps: Steps | tuple[()], now: float) -> bool | None:
        """Apply a decider's steps one by one, each before it is asked for the next, sending it back
        the action each issued; returns what the decider returned. `()`: nothing to do."""
        if not steps:
            return None
        assert not isinstance(steps, tuple)
        try:
            step = next(steps)
            while True:
                step = steps.send(self.apply(step, now))
        except StopIteration as stop:
            return stop.value

    def apply(self, step: Step, now: float) -> Action | None:
        """Carry out one decision; the action it issued, if any."""
        t = type(step)
        if t is Infer:
            assert isinstance(step, Infer)
            dev = self.devices[step.device]
            if step.coded is not None or step.replica_of:
                return self._issue_extra(step, dev, now)
            # (the key from a request: compiled, `spec.key` is a generic read of an interpreted class)
            entry = self.models[step.requests[0].key if step.requests else step.spec.key]
            (entry.late if step.best_effort else entry.queue).take_all(step.requests)
            self._unwanted(entry, dev.name)  # (if wanted no more: a replica elsewhere may go)
            if step.group:
                return self._issue_group(step, dev, now)
            return self.issue_infer(step.spec, dev, step.requests, step.batch_size, now, earliest=now,
                                    latest=step.latest, expected=step.expected, best_effort=step.best_effort,
                                    entry=entry)
        if t is Drop:
            assert isinstance(step, Drop)
            req = step.request
            if step.error is None:  # it cannot make its deadline: a hard one fails, any other is late
                self._hopeless(req, now)
            else:
                self._drop_queued(req)
                self._finish(req, RequestStatus.FAILED, step.error, now)
            return None
        if t is Load:
            assert isinstance(step, Load)
            return self.issue_load(step.spec, self.devices[step.device], now, step.expected)
        if t is Unload:
            assert isinstance(step, Unload)
            return self.issue_unload(step.spec, self.devices[step.device], now)
        if t is Save:
            assert isinstance(step, Save)
            self._answer(step.action, step.outputs, now, reconstructed=True, counter=step.counter)
            if step.decode_s:
                self.telemetry.decode_time.add(step.decode_s)
            return None
        assert isinstance(step, Release)
        self._lost(step.action, Result(step.action, ResultStatus.TOO_LATE, now, now, now), now)
        return None

    def next_wakeup(self, now: float) -> float | None:
        """When `schedule` next has something to do without new requests or results."""
        # (after every step: locals, plain comparisons, no list)
        queued = RequestStatus.QUEUED
        expiry, giveup, watches, weights = self._expiry, self._giveup, self._watches, self._weight_watches
        # (dues.pop called by name, not held in a local: compiled, that is a direct call)
        while expiry and ((r := request_of(expiry[0])).status != queued or r.late):
            dues.pop(expiry)
        while giveup and ((r := request_of(giveup[0])).status != queued or not r.late):
            dues.pop(giveup)
        while watches and not action_of(watches[0]).in_flight:
            dues.pop(watches)
        while weights and not action_of(weights[0]).in_flight:
            dues.pop(weights)
        best = expiry[0].at if expiry else math.inf
        if watches and watches[0].at < best:
            best = watches[0].at
        if weights and weights[0].at < best:
            best = weights[0].at
        if giveup and giveup[0].at < best:
            best = giveup[0].at
        t = self.policy.next_wakeup(self, now)
        if t is not None and t < best:
            best = t
        if self.parm.coding.groups:
            t = self.parm.next_time()
            if t is not None and t < best:
                best = t
        return best if best < math.inf else None

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0].at <= now:
            req = request_of(dues.pop(heap))
            if req.status != RequestStatus.QUEUED or req.late:
                continue
            best = self.best_case(req)
            if now + best <= req.deadline:  # still feasible (the estimate improved since it was queued)
                # strictly later than now, or a request exactly at its boundary would spin here
                dues.push(heap, request_due(fmax(req.deadline - best, now + 1e-6), req))
                continue
            self._hopeless(req, now)

    def _hopeless(self, req: InferenceRequest, now: float) -> None:
        """A queued request that can no longer make its deadline: a hard one is answered 504 now,
        any other waits in the best-effort lane to be answered late."""
        if req.klass == RequestClass.HARD:
            self._drop_queued(req)
            self._finish(req, RequestStatus.FAILED, self.deadline_error(req, now), now)
        else:
            entry = self.models[req.key]
            entry.queue.take(req)  # (its inputs stay: it still runs)
            self._to_lane(req, entry, now)

    def _watch(self, now: float) -> None:
        """Actions whose watch is due: an INFER's requests not answered by their deadline (plus a
        grace) are answered 504, so that a hung or lost device keeps no request unanswered; an
        action its device has not returned long past its expected end (the executor's own device
        waits give up at `hang_timeout_s`) means the device's thread is stuck where no deadline
        reaches (a driver call, a read from a dead disk): nothing more goes there, its requests are
        answered by their deadlines or retried elsewhere, its LOADs no longer hold a preload."""
        while True:
            heap = dues.first_of(self._watches, self._weight_watches)  # (in the order of one heap)
            if not heap or heap[0].at > now:
                break
            watch = dues.pop(heap)
            action, hung_at = action_of(watch), watch.hung_at
            if not action.in_flight:
                continue
            due_next = math.inf  # the earliest deadline of its requests still running, past the due ones
            for r in action.requests:
                if r.status != RequestStatus.RUNNING:
                    continue
                due = r.deadline if r.klass == RequestClass.HARD else r.give_up_at  # a late answer is still one
                if due + OVERDUE_GRACE > now:
                    due_next = fmin(due_next, due + OVERDUE_GRACE)
                    continue
                self._counts["overdue"] += 1
                self._finish(r, RequestStatus.FAILED, DeadlineExceeded(
                    f"deadline missed: {action.device} did not answer in time"), now)
            if hung_at > now:
                dues.push(heap, action_due(fmin(due_next, hung_at), action, hung_at))
                continue
            self._counts["actions_hung"] += 1
            self.declare_hung(action.device, f"{action.kind.name} of {action.model.key} has not returned for "
                              f"{now - action.issued_at:.1f} s", now)
            if due_next < math.inf:  # its requests are still answered by their deadlines
                dues.push(heap, action_due(due_next, action, math.inf))

    def declare_hung(self, device: str, why: str, now: float) -> None:
        """`device` holds a thread that never returns: it is lost for this process."""
        self.hung.setdefault(device, why)
        self._device_lost(self.devices[device], f"hung: {why}", now)

    @staticmethod
    def deadline_error(req: InferenceRequest, now: float) -> DeadlineExceeded:
        return DeadlineExceeded(f"deadline cannot be met: {max(req.deadline - now, 0) * 1e3:.3f} ms left after "
                                f"{(now - req.arrival) * 1e3:.3f} ms queued")

    def _take(self) -> Decision:
        d = self._decision
        if d.actions or d.finished:  # (most passes decide nothing: no new object for those)
            self._decision = Decision()
        return d

    def _drop_queued(self, req: InferenceRequest) -> None:
        """A queued request finished in place: its queue entry goes lazily, its tensors at once (a
        cancelled request's memory must not wait for its entry to reach the top of a heap)."""
        entry = self.models[req.key]
        (entry.late if req.late else entry.queue).discard(req)
        req.inputs = ()
        self._unwanted(entry)

    def _unwanted(self, entry: ModelEntry, but: str = "") -> None:
        """If a model has no waiting work any more (served, dropped, cancelled, failed): on the
        devices holding it, but `but` (where it now runs: its result eases that one), it may now be
        evicted."""
        if entry.queue.requests or entry.late.requests:
            return
        placed = entry.placed
        if placed and (len(placed) > 1 or but not in placed):
            devices = self.devices
            key = entry.key
            for name in placed:
                if name != but:
                    devices[name].ease(key)

    def _finish(self, req: InferenceRequest, status: RequestStatus, error: EscapementError | None,
                now: float = 0.0) -> None:
        req.status = status
        req.error = error
        req.finished_at = now
        self.pending -= 1
        if req.lane_bytes:
            self.soft_bytes -= req.lane_bytes
            req.lane_bytes = 0
        self._decision.finished.append(req)
        self.telemetry.request(req)
        if status == RequestStatus.SUCCEEDED:
            self._succeeded += 1
            if now <= req.deadline:
                self._met_deadline += 1
            else:
                self._missed_deadline += 1
        elif status == RequestStatus.CANCELLED:
            self._counts["cancelled"] += 1
        else:
            kind = type(error)
            name = _FAILED_NAMES.get(kind)
            if name is None:  # (an f-string per failed request: ~1k instructions, ~10% of requests overloaded)
                name = _FAILED_NAMES[kind] = f"failed_{kind.__name__}"
            self._counts[name] += 1

    # ---------------------------------------------------------------- actions (used by policies)

    def issue(self, action: Action, now: float, dev: DeviceState | None = None, due: float = math.inf) -> Action:
        """`dev`: the action's device's state, where the caller has it; `due`: an INFER's earliest
        deadline, by which (plus a grace) its requests are answered if it has not come back."""
        action.issued_at = now
        self.inflight[action.id] = action
        action.in_flight = True
        self._decision.actions.append(action)
        kind = action.kind
        if kind == ActionKind.INFER:  # planned on the device's lanes until its result is back
            action.expected_start = (dev or self.devices[action.device]).timeline.exec.add(
                action.id, action.expected_duration, now)
            moved = 0.0
        else:
            if kind == ActionKind.LOAD:
                action.expected_start = (dev or self.devices[action.device]).timeline.copy.add(
                    action.id, action.expected_duration, now)
            entry = self.models.get(action.key)
            moved = entry.weight_bytes / LOAD_FLOOR_BPS if kind == ActionKind.LOAD and entry is not None else 0.0
        # when it counts as hung: its expected end, ten times over (as the executor's device waits),
        # a LOAD's bytes at the slowest rate a healthy device moves them, then hung_after_s
        start = now if now > action.earliest else action.earliest
        hung_at = start + 10 * action.expected_duration + moved + self.hung_after_s
        due += OVERDUE_GRACE
        dues.push(self._watches if kind == ActionKind.INFER else self._weight_watches,
                  action_due(due if due < hung_at else hung_at, action, hung_at))
        return action

    def issue_infer(self, spec: ModelSpec, dev: DeviceState, requests: list[InferenceRequest], batch_size: int,
                    now: float, earliest: float, latest: float, expected: float, best_effort: bool = False,
                    entry: ModelEntry | None = None) -> Action:
        """An INFER of `requests` (taken from their queue) on `dev`; `entry`: the model's, if at hand."""
        if entry is None:
            entry = self.models[spec.key]
        samples = 0
        due = math.inf
        running = RequestStatus.RUNNING
        for r in requests:
            r.status = running
            r.dispatched_at = now
            samples += r.samples
            if r.deadline < due:
                due = r.deadline
        key = entry.key
        dev.infer_inflight += 1
        dev.busy[key] += 1
        dev.memory.touch(key)
        self._infer_actions += 1
        self._infer_samples += samples
        self._infer_slots += batch_size
        action = Action(ActionKind.INFER, spec, dev.name, earliest, latest, expected, batch_size, requests,
                        expected_start=earliest, best_effort=best_effort, key=key)
        self.issue(action, now, dev, due)
        entry.running += samples
        action.running = samples
        if entry.protected and not best_effort:  # (ParM protects on-time work only)
            self._run(self.parm.issued(self, action, now), now)
        return action

    def _issue_group(self, step: Infer, dev: DeviceState, now: float) -> Action:
        """A cross-model batch (controller/sharing.py): the lead's requests (already taken) and each
        member's, out of their queues, in one INFER that runs their shared prefix once."""
        assert step.group
        members = [(step.spec, step.requests), *step.group]
        requests: list[InferenceRequest] = []
        counted: list[tuple[str, int]] = []
        due = math.inf
        for spec, reqs in members:
            entry = self.models[spec.key]
            samples = 0
            for r in reqs:
                if spec is not step.spec:
                    entry.queue.take(r)
                r.status = RequestStatus.RUNNING
                r.dispatched_at = now
                samples += r.samples
                due = fmin(due, r.deadline)
            requests.extend(reqs)
            entry.running += samples
            self._unwanted(entry, dev.name)
            counted.append((spec.key, samples))
            dev.busy[spec.key] += 1
            dev.memory.touch(spec.key)
        dev.infer_inflight += 1
        samples = sum(n for _, n in counted)
        self._infer_actions += 1
        self._infer_samples += samples
        self._infer_slots += step.batch_size
        self._counts["cross_model_batches"] += 1
        self._counts["cross_model_members"] += len(members)
        action = self.issue(Action(ActionKind.INFER, step.spec, dev.name, now, step.latest, step.expected,
                                   step.batch_size, requests, expected_start=now,
                                   group=tuple((spec, len(reqs)) for spec, reqs in members)), now, dev, due)
        self._running_groups[action.id] = counted
        return action

    def _issue_extra(self, step: Infer, dev: DeviceState, now: float) -> Action:
        """A batch ParM asked for: a group's parity batch (its members' inputs, encoded), or a replica of a
        member (the same requests, first answer wins). Neither takes requests from a queue."""
        key = step.spec.key
        action = Action(ActionKind.INFER, step.spec, dev.name, now, step.latest, step.expected, step.batch_size,
                        step.requests, coded=step.coded, encoder=step.encoder, replica_of=step.replica_of)
        dev.infer_inflight += 1
        dev.busy[key] += 1
        if step.coded is not None:
            dev.memory.touch(key)
        return self.issue(action, now)

    def issue_load(self, spec: ModelSpec, dev: DeviceState, now: float, expected: float | None = None) -> Action:
        # (`spec.key` read once: compiled, each read of the interpreted spec is a generic look-up)
        entry = self.models[spec.key]
        key = entry.key
        charged = dev.memory.reserve(key, entry.weight_bytes, entry.blocks_on(dev.kind))
        share = charged / entry.weight_bytes if entry.weight_bytes else 1.0
        self.mark_placed(entry, dev.name)
        self._loads += 1
        dev.load_inflight += 1
        busy = dev.busy
        busy[key] = busy[key] + 1  # (not `+=`: compiled, that is a generic in-place add)
        if expected is None:
            expected = self.estimator.load(key, dev.kind, share) or 0.0
        action = self.issue(Action(ActionKind.LOAD, spec, dev.name, now, math.inf, expected,
                                   expected_start=now, key=key), now, dev)
        if share < 1.0:
            self._load_share[action.id] = share
        return action

    def issue_unload(self, spec: ModelSpec, dev: DeviceState, now: float) -> Action:
        key = spec.key
        dev.memory.release(key)
        self._unplace(key, dev.name)
        entry = self.models.get(key)
        if entry is not None and not entry.placed:
            self._went_cold(entry, now)  # evicted with work waiting
        dev.load_inflight += 1
        self._unloads += 1
        return self.issue(Action(ActionKind.UNLOAD, spec, dev.name, now, math.inf, expected_start=now, key=key),
                          now, dev)

    def mark_ready(self, key: str, device: str) -> None:
        """`key`'s weights are ready on `device` (a LOAD landed, or placed before a run)."""
        entry = self.models.get(key)
        devs = self.ready_on.get(key)
        if devs is None:  # (a new set, as the first device of a model always had: the order it iterates in)
            devs = self.ready_on[key] = set()
            if entry is not None:
                entry.ready = devs
        devs.add(device)
        if entry is not None:
            entry.ready_changes += 1  # what was kept from its ready devices no longer holds

    def mark_placed(self, entry: ModelEntry, device: str) -> None:
        """`entry`'s model is placed (loading or ready) on `device`."""
        key = entry.key
        devs = self.placed_on.get(key)
        if devs is None:
            devs = self.placed_on[key] = entry.placed = set()
        devs.add(device)

    def _ready_changed(self, key: str) -> None:
        """`key`'s ready devices changed: what was kept from them (best_case's answer, the policy's
        index entries) no longer holds."""
        entry = self.models.get(key)
        if entry is not None:
            entry.ready_changes += 1

    def _unplace(self, key: str, device: str) -> None:
        # (each index by name, not a loop over a tuple of the two: compiled, that iterated generic
        # objects, ~1.4k instructions an UNLOAD)
        ready_on = self.ready_on
        devs = ready_on.get(key)
        if devs is not None:
            devs.discard(device)
            self._ready_changed(key)
            if not devs:
                del ready_on[key]
        placed_on = self.placed_on
        devs = placed_on.get(key)
        if devs is not None:
            devs.discard(device)
            if not devs:
                del placed_on[key]

    # ---------------------------------------------------------------- results

    def on_result(self, result: Result, now: float) -> Decision:
        self.estimator.now = now
        action = self.inflight.pop(result.action.id, None)
        if action is None:
            log.error("result for an unknown action %r", result.action)
            return self._take()
        action.in_flight = False
        dev = self.devices[action.device]
        kind = action.kind
        if kind == ActionKind.INFER:
            dev.timeline.exec.done(action.id, result.end)
            if result.end > result.begin:
                dev.ran_s += result.end - result.begin
        elif kind == ActionKind.LOAD:
            dev.timeline.copy.done(action.id, result.end)
        self.telemetry.action(result)
        if result.failure == Failure.DEVICE:
            self._device_lost(dev, result.error, now)
        if kind == ActionKind.INFER:
            self._infer_done(action, dev, result, now)
        elif kind == ActionKind.LOAD:
            self._load_done(action, dev, result, now)
        else:
            dev.load_inflight -= 1
            if not result.ok and not dev.failed:
                log.error("unload of %s on %s failed: %s", action.model.key, dev.name, result.error)
        self.policy.on_result(self, result, now)
        return self._take()

    def _not_running(self, action: Action) -> None:
        """Its samples stop counting as running for their models (once: a lost device's INFERs
        are let go before their results come back)."""
        samples = action.running
        if samples:
            action.running = 0
            entry = self.models.get(action.key)
            if entry is not None:
                entry.running -= samples
            return
        if action.group:
            models = self.models
            for key, n in self._running_groups.pop(action.id, ()):
                entry = models.get(key)
                if entry is not None:
                    entry.running -= n

    def _infer_done(self, action: Action, dev: DeviceState, result: Result, now: float) -> None:
        self._not_running(action)
        dev.infer_inflight -= 1
        key = action.key
        if action.group:
            self._group_done(action, dev, result, now)
            return
        dev.busy[key] -= 1
        dev.ease(key)
        role = self.parm.role(action) if self.parm.coding.role or self.parm.coding.replicas else ActionRole.NONE
        ok = result.ok
        if ok:
            assert result.outputs is not None
            rows = action.samples if dev.kind in EXACT_ROW_KINDS else action.batch_size
            stages = result.stage_runs
            if stages:
                self._observe_stages(result, dev)
            # (a run whose prefix came from the prefix cache in part is no measure of the whole model)
            if not stages or stages[0][1] == action.samples:
                self.estimator.observe_infer(key, rows, dev.kind, result.end - result.begin, dev.name)
        if action.coded is not None:  # a parity batch (its group may be gone: members all answered)
            self._run(self.parm.parity_result(action, result, now), now)
            return
        if role == ActionRole.REPLICA:
            self._run(self.parm.replica_result(action, result), now)
            return
        if ok:
            assert result.outputs is not None
            entry = self.models.get(key)
            if entry is not None and entry.backlog_since:
                self._drained(entry, now)
            self._answer(action, result.outputs, now, result.duration)
            if role == ActionRole.MEMBER:
                self._run(self.parm.member_answered(action, result.outputs, now), now)
            return
        self._counts[f"infer_{result.status.name.lower()}"] += 1
        if role == ActionRole.MEMBER and self._run(self.parm.member_lost(self, action, result, now), now):
            return  # its requests wait for a reconstruction
        self._lost(action, result, now)

    def _observe_stages(self, result: Result, dev: DeviceState) -> None:
        for key, rows, seconds in result.stage_runs:
            if rows:
                self.estimator.observe_infer(key, rows, dev.kind, seconds, dev.name)

    def _group_done(self, action: Action, dev: DeviceState, result: Result, now: float) -> None:
        """A cross-model batch came back: each member's requests get their rows of its outputs, or,
        if it did not run, go back to their own queues (or fail) as any lost batch's do."""
        assert action.group
        for spec, _ in action.group:
            dev.busy[spec.key] -= 1
            dev.ease(spec.key)
        if not result.ok or result.parts is None:
            self._counts[f"infer_{result.status.name.lower()}"] += 1
            self._lost(action, result, now)
            return
        self._observe_stages(result, dev)
        at = 0
        for (spec, count), outputs in zip(action.group, result.parts, strict=True):
            reqs = action.requests[at : at + count]
            at += count
            entry = self.models.get(spec.key)
            if entry is not None and entry.backlog_since:
                self._drained(entry, now)
            self._answer_rows(reqs, outputs, now, result.duration)

    def _answer(self, action: Action, outputs: tuple[np.ndarray, ...], now: float, compute_s: float = 0.0,
                reconstructed: bool = False, counter: str = "") -> None:
        """Finish an action's requests that are still running with their rows of `outputs`."""
        answered = self._answer_rows(action.requests, outputs, now, compute_s, reconstructed)
        if counter and answered:
            self._counts[counter] += answered

    def _answer_rows(self, requests: list[InferenceRequest], outputs: tuple[np.ndarray, ...], now: float,
                     compute_s: float = 0.0, reconstructed: bool = False) -> int:
        """Finish those of `requests` still running with their rows of `outputs`; how many."""
        off = 0
        answered = 0
        whole = False
        if len(requests) == 1:
            n = requests[0].samples
            whole = True
            for o in outputs:
                if len(o) != n:
                    whole = False
                    break
        for r in requests:
            n = r.samples
            if r.status == RequestStatus.RUNNING:
                # (a batch of one request that fills it: its outputs are the batch's, no slicing)
                if whole:
                    r.outputs = outputs
                elif len(outputs) == 1:  # (most models: no generator for one slice)
                    r.outputs = (outputs[0][off : off + n],)
                else:
                    r.outputs = tuple([o[off : off + n] for o in outputs])
                r.compute_s = compute_s
                r.reconstructed = reconstructed
                self._finish(r, RequestStatus.SUCCEEDED, None, now)
                answered += 1
            off += n
        return answered

    def _lost(self, action: Action, result: Result, now: float) -> None:
        """An INFER that did not run, or failed: retry or fail its requests still running."""
        if action.group:  # a cross-model batch: each member's requests as a batch of their own
            at = 0
            for spec, count in action.group:
                part = action.requests[at : at + count]
                at += count
                self._lost_requests(spec.key, part, action, result, now)
            return
        self._lost_requests(action.key, action.requests, action, result, now)

    def _lost_requests(self, key: str, requests: list[InferenceRequest], action: Action, result: Result,
                       now: float) -> None:
        live = [r for r in requests if r.status == RequestStatus.RUNNING]
        entry = self.models.get(key)
        if result.status == ResultStatus.FAILED:
            log.error("%r failed: %s", action, result.error)
            self.devices[action.device].failing[key] = now + FAILURE_COOLDOWN
            for r in live:
                r.failures += 1
                if r.failures > MAX_FAILURES or entry is None or (
                        r.klass == RequestClass.HARD and now + self.best_case(r) > r.deadline):
                    self._finish(r, RequestStatus.FAILED, InternalError(f"inference failed: {result.error}"), now)
            live = [r for r in live if r.status == RequestStatus.RUNNING]
        # Refused for its window, cancelled, given up on, or failed (retried elsewhere, a bounded number
        # of times): back to the queue if there is still time; a request that is not hard goes to (or
        # back to) the best-effort lane instead of failing.
        retry: list[InferenceRequest] = []
        for r in live:
            if entry is not None and not r.late and now + (best := self.best_case(r)) <= r.deadline:
                r.status = RequestStatus.QUEUED
                # its expiry entry was dropped while it ran: armed again, or it is never found hopeless
                dues.push(self._expiry, request_due(r.deadline - best, r))
                retry.append(r)
            elif entry is not None and r.klass != RequestClass.HARD and now < r.give_up_at:
                self._to_lane(r, entry, now)
            else:
                self._finish(r, RequestStatus.FAILED, self.deadline_error(r, now), now)
        if retry and entry is not None:
            entry.queue.push_front(retry)
            self._active.add(key)
            self.policy.on_queued(self, entry, now)

    def _load_done(self, action: Action, dev: DeviceState, result: Result, now: float) -> None:
        dev.load_inflight -= 1
        key = action.key
        dev.busy[key] -= 1
        dev.ease(key)
        entry = self.models.get(key)
        share = self._load_share.pop(action.id, 1.0)
        if result.ok and not dev.failed:
            self.estimator.observe_load(key, dev.kind, result.end - result.begin, share, result.set_up)
            dev.memory.loaded(key)
            self.mark_ready(key, dev.name)
            dev.load_failures.pop(key, None)
            dev.load_backoff.pop(key, None)
            if entry is None:  # removed while loading
                self.issue_unload(action.model, dev, now)
            else:
                entry.load_failures = 0
            return
        if dev.memory.state(key) is not None:
            dev.memory.release(key)
        self._unplace(key, dev.name)
        if dev.failed:
            return  # the device is lost: the model's requests wait for another device
        self._counts["load_failures"] += 1
        dev.load_failures[key] += 1
        if result.failure == Failure.NO_MEMORY and dev.load_failures[key] <= NO_MEMORY_RETRIES:
            # The device's memory differs from the plan (fragmentation, the host's pinned budget):
            # make more room and let the policy load again.
            log.warning("load of %s on %s refused for memory (%s); evicting and retrying", key, dev.name,
                        result.error)
            self._counts["load_retries"] += 1
            idle = [k for k in dev.memory.ready_models() if dev.busy[k] == 0 and k in self.models]
            if idle:  # the least recently used
                self.issue_unload(self.models[idle[0]].spec, dev, now)
            return
        lo, hi = LOAD_BACKOFF
        backoff = min(hi, lo * 2 ** (dev.load_failures[key] - 1))
        dev.load_backoff[key] = now + backoff
        log.error("load of %s on %s failed: %s (no LOAD of it there for %.0f s)", key, dev.name, result.error,
                  backoff)
        if entry is not None:
            entry.load_failures += 1
            entry.load_error = result.error
            if any(d.can_load(key, now) and d.memory.budget >= entry.weight_bytes for d in self.devices.values()):
                return  # another device may load it: its requests wait for that
            self._fail_queued(entry, Unavailable(f"loading model {action.model.name} on {dev.name} failed: "
                                                 f"{result.error}"), now)

    def _device_lost(self, dev: DeviceState, why: str, now: float) -> None:
        """Nothing is placed on a lost device again; what it held is gone. Requests running there
        come back as failures (retried elsewhere while there is time) or are answered by their
        deadlines by the overdue watchdog."""
        if dev.failed:
            return
        dev.failed = why or "device lost"
        self.lost += 1
        self._counts["devices_lost"] += 1
        for action in self.inflight.values():  # what runs there now runs before nothing (it may never return)
            if action.device == dev.name:
                self._not_running(action)
        log.critical("device %s is lost: %s; %d of %d devices left", dev.name, dev.failed,
                     len(self.devices) - self.lost, len(self.devices))
        held = dev.memory.models()
        for key in held:
            self._unplace(key, dev.name)
        dev.memory.retire()
        for key in held:
            entry = self.models.get(key)
            if entry is not None:
                self._went_cold(entry, now)
        if self.lost == len(self.devices):
            err = Unavailable("every device of this daemon has failed")
            for entry in self.models.values():
                self._fail_queued(entry, err, now)

    def abort_all(self, error: EscapementError, now: float) -> Decision:
        """Finish every queued and running request with `error` (late results are then dropped)."""
        for entry in self.models.values():
            self._fail_queued(entry, error, now)
        for action in self.inflight.values():
            for r in action.requests:
                if r.status == RequestStatus.RUNNING:
                    self._finish(r, RequestStatus.FAILED, error, now)
        self.parm.reset()  # every member's requests are answered: no group is left to finish
        return self._take()

    # ---------------------------------------------------------------- views

    def statistics(self) -> dict[str, object]:
        return {
            "policy": self.policy.name,
            "counters": dict(self.counters),
            "telemetry": self.telemetry.summary(),
            "coding": self.parm.statistics(),
            "pending": self.pending,
            "inflight_actions": len(self.inflight),
            "queued": {k: e.queue.requests for k, e in self.models.items() if e.queue.requests},
            "queued_late": {k: e.late.requests for k, e in self.models.items() if e.late.requests},
            "best_effort_bytes": self.soft_bytes,
            "devices": {n: {"used": d.memory.used + d.device.workspace, "budget": d.device.weight_budget,
                            "workspace": d.device.workspace, "models": d.memory.models(),
                            **({"failed": d.failed} if d.failed else {})}
                        for n, d in self.devices.items()},
        }
