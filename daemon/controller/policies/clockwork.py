"""The `clockwork` policy: predictable, deadline-aware scheduling of LOAD / INFER / UNLOAD.

Following Clockwork (OSDI '20):

- Each device gets only a short schedule-ahead horizon of work (`controller.schedule_ahead_ms`):
  planning stops once its exec timeline reaches now + horizon and resumes as it drains, so
  every decision is made with fresh information.
- A device free within the horizon takes the model whose most urgent request has the earliest
  latest-start time (deadline minus estimated run time; higher priority first), and the
  largest batch whose requests all still meet their deadlines when it starts then.
- A request that no device can finish in time is answered at once (deadline error), not
  left to time out; one that a refused or failed action returns is retried if it still can.
- INFER actions carry a window: `earliest` is now (the lane runs them in order), `latest` is
  the last start that still meets every deadline in the batch; an executor that cannot start
  in time refuses instead of running late.
- Memory: this policy alone decides LOADs and UNLOADs. It loads the models with the most
  urgent unmet demand (the earliest deadline among cold models' requests, then the most
  queued work), evicting least-recently-used models with nothing queued first, and replicates
  a model onto another device when its arrival rate exceeds what its devices can serve. Two
  guards against thrashing: while a device's copy lane is busy more than half the time, a
  model is never evicted to load one that costs less to keep cold (its arrival rate times its
  LOAD time: the copy work its cold starts make); and one idle model that frees enough is
  evicted rather than many small ones.
- Cross-model batching (controller/sharing.py): a batch of a model whose leading stage other
  models share (plans of stages) takes in their queued requests too when every request still
  meets its deadline, on devices that keep shared weights once; the stage then runs once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from daemon.actions import ActionKind, Result
from daemon.controller import due as dues
from daemon.controller import sharing
from daemon.controller.decisions import Drop, Infer, Load, Pass, Planned, Steps, Unload
from daemon.controller.demand import DeviceDemand
from daemon.controller.due import Due, key_due
from daemon.controller.estimates import EXACT_ROW_KINDS, RATE_TAU, RateMeter, SlidingWindow
from daemon.controller.floats import bisect_left, fmax, fmin
from daemon.controller.memory import Blocks, EvictionRules
from daemon.controller.policy import Policy
from daemon.controller.state import EASED_RING, DeviceState, ModelEntry
from daemon.controller.view import ControllerView
from daemon.request import InferenceRequest

LATEST_GRACE: Final = 0.001  # the least room an action's window gets after its planned start
LOAD_BANDWIDTH_GUESS: Final = 4e9  # bytes/s, for a model's first LOAD before any is measured
COPY_PRESSURE: Final = 0.5  # copy-lane utilisation above which a load must not evict a model in more demand
REPLICA_UTILISATION: Final = 0.7  # replicate once demand exceeds this share of the devices' throughput
REPLICA_COOLDOWN: Final = 0.1  # seconds between replications of one model
REPLICA_DROPS: Final = 5.0  # requests/s dropped because its devices were too slow or busy: replicate (SMART)
SLOW_DEVICE: Final = 1.5  # a device whose recent runs of a model exceed its profile this much is running slow
BIND_LEAD: Final = 0.0003  # a batch is chosen this long before it should start (the executor's wake-up)
MAX_WAIT_OF_SLO: Final = 0.1  # a batch never waits to fill longer than this share of the model's SLO
MIN_FILL: Final = 8.0  # samples a wait must be expected to bring before a batch waits at all
COLD_CHECKS: Final = 4  # cold models a pass checks for heads no LOAD can save while every copy lane is busy
UTIL_REBUILD: Final = 2.0  # seconds a device's demand weights (its models' costs per sample) are reused
CHEAPER_LIMIT: Final = 64  # candidates from the cold-cost ranking past which a victim search walks in LRU order
BLOCKED_LIMIT: Final = 4096  # cold models whose failed victim searches are remembered (then all forgotten)
COST_SLACK: Final = 1e-9  # on a log cold cost, for the rounding between it and the search's own compare
LANE_SLICE: Final = 0.005  # a best-effort batch is cut to run at most this long (one row at least): on-time
# work that arrives meanwhile waits for it, since a device runs one batch at a time


def _placed(view: ControllerView, key: str, but: DeviceState | None = None) -> bool:
    """Whether `key` is placed (loading or ready) on a device other than `but`. (From the view's
    index, not each device's memory: a lookup, where asking eight devices was ~2.7k instructions,
    twice a LOAD.)"""
    on = view.placed_on.get(key)
    if not on:
        return False
    return but is None or len(on) > 1 or but.name not in on


_Option = tuple[int, bool, int, float, str, DeviceState, list[str]]
# a device a LOAD could go to, before its victim search: evicts at all, load (tenths), finish, name,
# the device, when its LOAD and first run would end, the bytes it lacks, the model's blocks there


def _cost_kind(view: ControllerView) -> str:
    """The device kind a model's cold cost is reckoned on (its LOAD time there): the first device's."""
    return next(iter(view.devices.values())).kind


class _LoadRules(EvictionRules):
    """Which models a LOAD planned by `_place` may evict on a device (`busy`, `pressed` set per
    device): none busy; for best-effort work alone (`lane_only`), none with work; a model with
    requests waiting only for one in more demand; and under copy pressure (`pressed`) none that
    costs more to keep cold than the model to load (`mine`): that only moves the cold starts."""

    def __init__(self, policy: ClockworkPolicy, view: ControllerView, kind: str, lane_only: bool,
                 now: float) -> None:
        self.policy = policy
        self.view = view
        models = view.models  # (a dict, as the scheduler's, read directly; a Mapping's get is a generic call)
        self.models: dict[str, ModelEntry] = models if isinstance(models, dict) else dict(models)
        self.costs = policy._demand
        self.kind = kind
        self.lane_only = lane_only
        self.now = now
        self.mine = 0.0
        # (a device's busy counts: read with get, which adds no key; typed dict, not defaultdict, so
        # that compiled code reads it as one)
        self.busy: dict[str, int] = {}
        self.pressed = False

    def wanted(self, key: str) -> bool:  # (work in its lane counts: evicting it for another lane model thrashes)
        e = self.models.get(key)
        return e is not None and (e.queue.requests > 0 or e.late.requests > 0)

    def evictable(self, key: str) -> bool:
        wanted = self.wanted(key)
        if self.busy.get(key, 0) or (self.lane_only and wanted):
            return False
        if wanted:
            return self.demand(key) < self.mine
        return not self.pressed or self.demand(key) <= self.mine

    def evictable_idle(self, key: str) -> bool:
        # (the cold cost first: under copy pressure it refuses ~27 of the ~28 models a search meets
        # at 10,000 models, where `busy` refuses almost none)
        if self.pressed and self.demand(key) > self.mine:
            return False
        return not self.busy.get(key, 0)

    def idle_victim(self, key: str) -> bool:
        # (`evictable_idle` first: under copy pressure it refuses most models a search meets at
        # 10,000 models, for their cold cost, where `wanted` refuses almost none)
        return self.evictable_idle(key) and not self.wanted(key)

    def demand(self, key: str) -> float:
        """Its cold cost, from the demand tracker's rates and LOAD times (no estimate read)."""
        c = self.costs.cold_cost(key, self.now)
        if c < 0.0:  # placed since the tracker last looked at its device
            e = self.models.get(key)
            c = self.costs.cold_cost(key, self.now, self.policy._load_est(self.view, e, self.kind)) \
                if e is not None else 0.0
        return c


def _option_before(a: _Option, b: _Option) -> bool:
    """Whether LOAD option `a` orders before `b`: by models in demand evicted, any eviction at all,
    the device's load (tenths), when it could finish, then the device's name."""
    if a[0] != b[0]:
        return a[0] < b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    if a[2] != b[2]:
        return a[2] < b[2]
    if a[3] != b[3]:
        return a[3] < b[3]
    return a[4] < b[4]


class _Candidate:
    """A device a LOAD could go to, before its victim search: whether it must evict at all, its
    load (tenths), when the LOAD's first run could finish, its name; when its copy lane frees,
    when its LOAD and first run would end, the bytes it lacks, the model's blocks there. (A record,
    not a tuple: compiled, its fields stay unboxed, where a tuple boxed every float and unboxed it
    again at each comparison.) `finish` and `done` are estimated only once the devices ordered
    before it by load are searched (`rated`): most LOADs stop at the first group."""

    __slots__ = ("blocks", "copy_free", "dev", "done", "finish", "hopeless", "lacks", "load", "name", "rated",
                 "short")

    def __init__(self, short: bool, load: int, copy_free: float, dev: DeviceState, lacks: int, blocks: Blocks,
                 hopeless: bool) -> None:
        self.short = short
        self.load = load
        self.copy_free = copy_free
        self.finish = math.inf
        self.name = dev.name
        self.dev = dev
        self.done = math.inf
        self.lacks = lacks
        self.blocks = blocks
        self.hopeless = hopeless  # its victim search would find no room, as it did last time (`_Blocked`)
        self.rated = False


class _Blocked:
    """A victim search for a cold model that found no room on a device, and what it read that can
    change its answer. The answer stands while the device has no more free bytes (a LOAD issued
    there since only takes room, and its model is no candidate until it lands), no model with
    shared blocks came or went there (what the model lacks, and what a victim frees, would move),
    no LOAD time of its models was made again or lowered, the cold model's cost (time-invariant
    form) did not rise with an arrival, its head is the same, and no model there may have become
    evictable since (`DeviceState.eased`: a batch came back, a LOAD landed, work went unserved or
    was taken elsewhere). Under copy pressure only models cheaper to keep cold than this one may
    go, so such an event counts only for a model that is, and the pressure must still hold with
    the head not yet urgent.

    Under memory thrash the same few cold models were searched for on every device at every pass,
    each search refused, until their heads turned urgent: the controller's cost per request grew
    15x (bench/results/scale-thrash-issue12.md)."""

    __slots__ = ("cost", "deadline", "eased", "free", "lowered", "pressed", "ranked", "shared")

    def __init__(self, eased: int, free: int, ranked: float, lowered: int, shared: int, cost: float,
                 deadline: float, pressed: bool) -> None:
        self.eased = eased  # the device's `eased` when last found to stand
        self.free = free
        self.ranked = ranked  # when the device's demand was last made again (its models' LOAD times)
        self.lowered = lowered  # LOAD times of the device's models lowered so far (DeviceDemand.lowered)
        self.shared = shared  # models with shared blocks placed or released there so far
        self.cost = cost
        self.deadline = deadline
        self.pressed = pressed


def _candidate_before(a: _Candidate, b: _Candidate) -> bool:
    """The order of LOAD candidates short of their estimates: no eviction first, then the device's
    load, then its name (`_finish_before` orders a group equal in the first two)."""
    if a.short != b.short:
        return b.short
    if a.load != b.load:
        return a.load < b.load
    return a.name < b.name


def _finish_before(a: _Candidate, b: _Candidate) -> bool:
    if a.finish != b.finish:
        return a.finish < b.finish
    return a.name < b.name


def _all_live(entries: list[Due]) -> bool:
    """Whether each of a model's kept index entries is still its live one (none popped, discarded
    or replaced since). A loop, not `all` over a generator: compiled, that builds a generator
    object (most arrivals under load ask this)."""
    for e in entries:  # noqa: SIM110
        if e.gone:
            return False
    return True


def _tenths(x: float) -> int:
    """`round(x * 10)`, halves to even as `round` does: compiled, a call of the builtin is a generic
    call (~1k instructions, once per device per LOAD planned)."""
    y = x * 10
    f = math.floor(y)
    d = y - f  # (exact: y and f are within a unit of each other)
    if d > 0.5 or (d == 0.5 and f % 2 == 1):
        f += 1
    return f


@dataclass(slots=True)
class WorkIndex:
    """Models with queued work, most urgent first, each at most once (one live entry per model).

    Keys are pairs: for a device's ready models, the head request's priority rank and its latest
    start there; for cold models, the head's deadline and minus the queued work. An entry whose model has since
    become less urgent (its head left, its estimate grew) is re-keyed when it reaches the top, so
    a pass looks only at the few most urgent models instead of every model with work.
    """

    heap: list[Due] = field(default_factory=list)  # key_due: (rank, t) as (at, then)
    # model -> its live entry (the last pushed; an older one in the heap with other keys is stale).
    # Entries, not (rank, t) tuples: compiled, a tuple of floats is boxed to build and compared
    # item by item through generic calls, several times per request under load.
    live: dict[str, Due] = field(default_factory=dict)
    pushed: int = 0  # entries pushed so far: ties of a key are taken first in, first out

    def push(self, key: str, rank: float, t: float) -> Due:
        """Index `key` at (rank, t) unless its live entry is at least as urgent; its live entry."""
        cur = self.live.get(key)
        if cur is not None:
            if cur.at < rank or (cur.at == rank and cur.then <= t):
                return cur  # at least as urgent: it is re-keyed when it reaches the top
            cur.gone = True
        self.pushed += 1
        e = key_due(rank, t, self.pushed, key)
        self.live[key] = e
        dues.push(self.heap, e)
        return e

    def pop(self) -> Due | None:
        """The most urgent live entry (its `at` the rank, `then` the time, `key` the model), removed."""
        heap, live = self.heap, self.live
        while heap:
            e = dues.pop(heap)
            cur = live.get(e.key)
            if cur is not None and cur.at == e.at and cur.then == e.then:
                del live[e.key]
                cur.gone = True
                return e
        return None

    def top(self) -> Due | None:
        """The most urgent live entry, left in place."""
        heap, live = self.heap, self.live
        while heap:
            e = heap[0]
            cur = live.get(e.key)
            if cur is not None and cur.at == e.at and cur.then == e.then:
                return e
            dues.pop(heap)
        return None

    def discard(self, key: str) -> None:
        cur = self.live.get(key)  # (not pop(key, None): compiled, a pop with a default is a generic call)
        if cur is not None:
            cur.gone = True
            del self.live[key]

    def __len__(self) -> int:
        return len(self.live)


class ClockworkPolicy(Policy):
    name = "clockwork"

    def __init__(self, schedule_ahead: float = 0.005, batch_wait: float = 0.0, cross_model: bool = True,
                 shortcuts: bool = True) -> None:
        self.horizon = schedule_ahead
        self.batch_wait = batch_wait
        self.cross_model = cross_model
        # Lone arrivals planned, and arrivals to a filling batch taken, without a pass (what the
        # pass would decide, found cheaper: `_settle_fresh`, `_still_filling`); off, every arrival
        # goes through the pass (to check the two decide alike), and every cold model's LOAD is
        # searched for on every device at every pass. Counted: how often each is taken.
        self.shortcuts = shortcuts
        self.planned_alone = 0
        self.filling_kept = 0
        self.index_kept = 0  # arrivals whose model's index entries stood as they were (`on_queued`)
        self.searches_spared = 0  # victim searches passed over as found no room before (`_Blocked`)
        self.prefixed: dict[str, set[str]] = {}  # shared prefix -> models having it that gained work (pruned lazily)
        self.replicated_at: dict[str, float] = {}
        self.copy_busy: dict[str, RateMeter] = {}  # device -> LOAD seconds per second
        self.drops: dict[str, RateMeter] = {}  # model -> requests/s its devices could not run in time
        # What a pass looks at, kept up to date as requests arrive and results come back: per
        # device, its ready models with work by urgency (and by latest start, for dropping what
        # cannot make it); cold models with work by deadline; models whose arrivals may ask for
        # a replica.
        self.work: dict[str, WorkIndex] = {}
        self.late: dict[str, WorkIndex] = {}
        self.cold = WorkIndex()
        self._replica_check: set[str] = set()
        self._demand = DeviceDemand(RATE_TAU, UTIL_REBUILD)  # per device, rates x costs of its models
        # Devices a pass must look at: those whose work or lanes changed since the last pass, and
        # those whose horizon reaches their next free time now (`_dev_wake`).
        self._dirty: set[str] = set()
        self._dev_wake: dict[str, float] = {}
        self._lane_cold: set[str] = set()  # models with best-effort work on no device
        self._fresh: list[tuple[ModelEntry, InferenceRequest]] = []  # lone arrivals not indexed yet
        # cold model -> device -> its last victim search there that found no room (`_Blocked`)
        self._blocked: dict[str, dict[str, _Blocked]] = {}
        self._kind_of: object = None  # the devices `_kind` is the cost kind of
        self._kind = ""

    # ---------------------------------------------------------------- hooks

    def next_wakeup(self, view: ControllerView, now: float) -> float | None:
        return self._earliest_wake() if self._dev_wake else None

    def _earliest_wake(self) -> float:
        """The earliest of the devices' wake-ups (inf: none). A loop, not `min`: compiled, it
        compares unboxed floats, where the builtin parses its arguments and compares objects
        (twice a step: ~5% of the controller's instructions)."""
        t = math.inf
        for w in self._dev_wake.values():
            if w < t:
                t = w
        return t

    def on_submit(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, now: float) -> None:
        m = entry.demand  # (its record, kept on its entry: no look-up of its name)
        if m is None:
            m = entry.demand = self._demand.record(entry.key)
        self._demand.arrival_of(entry.key, m, req.samples, now)
        if not self.shortcuts:
            pass
        elif entry.queue.requests == 1:
            if self._alone(view, entry) is not None:
                self._fresh.append((entry, req))  # the pass may not be needed for it: see _settle_fresh
                return
        elif self.batch_wait > 0 and self._still_filling(view, entry, req, now):
            self.filling_kept += 1
            return
        self.on_queued(view, entry, now, req)

    def _alone(self, view: ControllerView, entry: ModelEntry) -> DeviceState | None:
        """The one device a model is ready on, where its lone request could be planned without a
        pass (see `_settle_fresh`); None where the pass must decide: several devices to choose
        among, ParM groups, a shared prefix to batch with other models."""
        ready = entry.ready
        if len(ready) != 1 or entry.protected or (entry.prefix and self.cross_model):
            return None
        for name in ready:
            return view.devices[name]
        return None

    def _still_filling(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, now: float) -> bool:
        """An arrival behind the head of a model whose batch is filling on its one device, where
        nothing else is indexed and a wake-up is planned: what a pass would do for it, done here
        (True), or False where the pass must look.

        A pass would pop the model, find its head still able to start in time, ask `_bind_at` when
        to choose the batch, and, that being later, index the model again as it was and keep the
        earlier of the two wake-ups. Under a fast arrival rate that is most passes (measured on one
        model at 4,000 req/s with batch_wait: 25,000 of 29,000 passes decided nothing, a quarter of
        the controller's time). Here the same: the arrival changes nothing indexed (the model's
        entries in both indexes are at least as urgent as it), and the wake-up moves to the new
        bind time if that is earlier; a batch due now, or anything else changed, goes to the pass."""
        dev = self._alone(view, entry)
        if dev is None:
            return False
        key, name = entry.key, dev.name
        w = self.work.get(name)
        if name in self._dirty or name not in self._dev_wake or w is None or len(w.live) != 1:
            return False
        live = w.live.get(key)
        head = entry.queue.head()
        if live is None or head is None or head is req:
            return False
        latest_start = head.deadline - self._est_on(view, key, head.samples, dev)
        if live.at != head.rank or live.then != latest_start:
            return False  # its estimate moved: the pass re-keys it
        rank, mine = req.rank, req.deadline - self._est_on(view, key, req.samples, dev)
        late = self.late.get(name)
        held = late.live.get(key) if late is not None else None
        if rank < live.at or (rank == live.at and mine < live.then) or held is None or held.at > 0 or \
                (held.at == 0 and held.then > mine):
            return False  # the arrival would change an index entry
        if dev.failed or not dev.healthy_for(key, now):
            return False
        start = dev.timeline.exec.free_at(now)
        if start >= now + self.horizon or start > latest_start:
            return False
        bind = self._bind_at(view, entry, dev, start, now)
        if bind <= now:
            return False  # its batch is due: the pass chooses it
        wake = self._dev_wake[name]
        if bind < wake:
            self._dev_wake[name] = bind
        return True

    def _settle_fresh(self, view: ControllerView, now: float) -> Planned:
        """The batches the pass would plan for this step's new lone requests, planned without it.

        A request that arrived to an empty queue of a model ready on one device only, where no
        other model's work is indexed and no other such request arrived in this step, can only be
        that device's next batch, alone: planned here, it skips the indexing, the ordering of
        devices and the generator of a pass (most arrivals at light and moderate load, where they
        are most of the controller's work). Anything else (another request joined it, the device
        has other work or is not free within the horizon, the request cannot make its deadline
        there, a fuller batch is worth waiting for) is indexed as any arrival and left to the pass,
        which decides exactly as it would have."""
        fresh, self._fresh = self._fresh, []
        mine: dict[str, tuple[ModelEntry, InferenceRequest, DeviceState] | None] = {}
        for entry, req in fresh:
            dev = self._alone(view, entry)
            if dev is None or entry.queue.requests != 1 or entry.queue.head() is not req:
                if entry.queue.requests:
                    self.on_queued(view, entry, now)
                continue
            w = self.work.get(dev.name)
            if dev.name in mine or (w is not None and w.live):
                other = mine.get(dev.name)
                if other is not None:
                    self.on_queued(view, other[0], now)
                mine[dev.name] = None  # two of them, or indexed work: the pass chooses
                self.on_queued(view, entry, now)
                continue
            mine[dev.name] = (entry, req, dev)
        out: Planned = []
        for chosen in mine.values():
            if chosen is None:
                continue
            entry, req, dev = chosen
            step = self._plan_alone(view, entry, req, dev, now)
            if step is None:
                self.on_queued(view, entry, now)
            else:
                self.planned_alone += 1
                out.append(step)
        return out

    def _plan_alone(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, dev: DeviceState,
                    now: float) -> Infer | None:
        """`_dispatch`'s batch for a lone request on a device with no other work; None where the
        pass must decide."""
        key, spec = entry.key, entry.spec
        if dev.failed or not dev.healthy_for(key, now) or not dev.memory.is_ready(key):
            return None
        start = dev.timeline.exec.free_at(now)
        if start >= now + self.horizon:
            return None
        run = self._est_on(view, key, req.samples, dev)
        if start > req.deadline - run:
            return None  # it cannot make it here: the pass answers it
        if self.batch_wait > 0 and self._bind_at(view, entry, dev, start, now) > now:
            return None  # a fuller batch soon: the pass waits for it
        return Infer(spec, dev.name, [req], entry.batch_size_for(req.samples),
                     fmax(req.deadline - run, start + LATEST_GRACE), run)

    def on_queued(self, view: ControllerView, entry: ModelEntry, now: float,
                  req: InferenceRequest | None = None) -> None:
        """A model gained queued work (an arrival, requests returned, its weights evicted)."""
        key = entry.key
        head = req if req is not None and req.queue_seq else entry.queue.head()
        if head is None:
            return
        if entry.prefix and self.cross_model:
            self.prefixed.setdefault(entry.prefix, set()).add(key)
        placed = view.placed_on.get(key)
        if not placed:
            self.cold.push(key, head.deadline, -self._backlog(view, entry))
            return
        ready = view.ready_on.get(key)
        if ready:
            deadline, rank, samples = head.deadline, head.rank, head.samples
            est = view.estimator
            version = est.version(key)
            dirty = self._dirty
            if self.shortcuts and entry.indexed_ready == entry.ready_changes and entry.indexed_version == version and \
                    est.now <= entry.indexed_until and samples == entry.indexed_samples and \
                    rank >= entry.indexed_rank and deadline >= entry.indexed_deadline and _all_live(entry.indexed):
                # Its entries on every ready device were made for a head at least as urgent as this
                # one, from the same estimates: pushing this one would change none of them (most
                # arrivals under load). The devices still have work to look at.
                for name in ready:
                    dirty.add(name)
                self.index_kept += 1
                self._check_replica(view, key, placed)
                return
            devices = view.devices
            indexed: list[Due] = []
            until = math.inf
            for name in ready:
                dev = devices[name]
                run, good = self._est_until(view, entry, samples, dev)
                if good < until:
                    until = good
                latest = deadline - run
                w = self.work.get(name)
                indexed.append((w if w is not None else self._index(name)).push(key, rank, latest))
                w = self.late.get(name)
                indexed.append((w if w is not None else self._late(name)).push(key, 0, latest))
                dirty.add(name)
            entry.indexed, entry.indexed_rank, entry.indexed_deadline = indexed, rank, deadline
            entry.indexed_samples, entry.indexed_version, entry.indexed_ready = samples, version, entry.ready_changes
            entry.indexed_until = until
        self._check_replica(view, key, placed)

    def _check_replica(self, view: ControllerView, key: str, placed: set[str]) -> None:
        """A model on fewer than every device is looked at for a replica in the next pass."""
        if len(placed) < len(view.devices):
            self._replica_check.add(key)

    def on_late(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        key = entry.key
        ready = view.ready_on.get(key)
        if ready:
            self._dirty.update(ready)
        elif not view.placed_on.get(key):
            self._lane_cold.add(key)

    def on_result(self, view: ControllerView, result: Result, now: float) -> None:
        action = result.action
        if action.kind == ActionKind.LOAD:
            if result.ok:
                meter = self.copy_busy.get(action.device)
                if meter is None:
                    meter = self.copy_busy[action.device] = RateMeter()
                meter.add(result.end - result.begin, now)
            entry = view.models.get(action.key)
            if entry is not None:  # (a measured LOAD may change its cold cost)
                load_s = self._load_est(view, entry, self._cost_kind(view))
                self._demand.reloaded(entry.key, load_s)
                dev = view.devices[action.device]
                if result.ok and dev.memory.is_ready(entry.key) and not self._demand.tracks(entry.key, dev.name):
                    # a LOAD this policy did not place (a preload, a retry): its demand counted now,
                    # not at the device's next rebuild (and its cold cost ranked, which a search
                    # bounded by the ranking relies on)
                    self._demand.place(entry.key, dev.name, self._weight(
                        view, entry, dev, len(view.placed_on.get(entry.key, ()))), load_s)
            if entry is not None and entry.queue.requests:
                self.on_queued(view, entry, now)  # ready here now, or cold again
            if entry is not None and entry.late.requests and not view.placed_on.get(entry.key):
                self.on_late(view, entry, now)  # its LOAD failed: the lane's work needs another
        elif action.kind == ActionKind.INFER:
            # A device that finished a batch needs a pass only if it has work indexed, or lane work
            # may exist; else the pass would find nothing (most results at light load).
            w = self.work.get(action.device)
            if not ((w is not None and w.live) or view.late_keys):
                return
        else:
            # An UNLOAD's bytes were freed when it was issued, and it holds no lane: its result
            # changes nothing a pass reads (one UNLOAD per cold start at 10,000 models: a pass each).
            return
        self._dirty.add(action.device)

    def _index(self, device: str) -> WorkIndex:
        w = self.work.get(device)
        if w is None:
            w = self.work[device] = WorkIndex()
        return w

    def _late(self, device: str) -> WorkIndex:
        w = self.late.get(device)
        if w is None:
            w = self.late[device] = WorkIndex()
        return w

    # ---------------------------------------------------------------- the step

    def schedule(self, view: ControllerView, now: float) -> Pass | Planned | tuple[()]:
        planned = self._settle_fresh(view, now) if self._fresh else None
        # (lengths, not truth values: compiled, a set's or a class's truth value is a generic call)
        if not (len(self._dirty) or len(self.cold.live) or len(self._replica_check) or len(self._lane_cold)) and \
                self._earliest_wake() > now:
            # nothing changed since the last pass but lone requests, and no device's time has come:
            # their batches, as a list (no generator to resume and end)
            return planned if planned else ()
        return self._pass(view, now, planned)

    def _pass(self, view: ControllerView, now: float, planned: Planned | None = None) -> Pass:
        for step in planned or ():  # noqa: UP028 (the scheduler sends each step's action back, which a list's iterator cannot take; each on a device the pass then finds busy)
            yield step
        # Inference first: a model whose LOAD just finished gets its batch (and is then busy)
        # before any other LOAD may look for room.
        yield from self._plan_inference(view, now)
        if (len(self.cold.live) or len(self._replica_check) or len(self._lane_cold)) and \
                (yield from self._plan_memory(view, now)):
            yield from self._plan_inference(view, now)
        yield None  # the end: the scheduler drops the pass here (no StopIteration; see decisions.Pass)

    # ---------------------------------------------------------------- estimates

    @staticmethod
    def _est(view: ControllerView, key: str, samples: int, where: DeviceState | str) -> float:
        if isinstance(where, str):
            return view.estimate(key, samples, where)
        return ClockworkPolicy._est_on(view, key, samples, where)

    @staticmethod
    def _est_on(view: ControllerView, key: str, samples: int, dev: DeviceState) -> float:
        """`_est` on a device (the common case: several times per request)."""
        kind = dev.kind
        est = view.estimator.infer_until(key, samples if kind in EXACT_ROW_KINDS else
                                         view.models[key].batch_size_for(samples), kind, dev.name)[0]
        return est if est is not None else view.estimate(key, samples, dev)

    @staticmethod
    def _est_until(view: ControllerView, entry: ModelEntry, samples: int, dev: DeviceState) -> tuple[float, float]:
        """`_est_on`, and the time until which it holds if nothing new is observed (-inf where it
        is the view's fallback, which is not kept)."""
        kind = dev.kind
        est, until = view.estimator.infer_until(entry.key, samples if kind in EXACT_ROW_KINDS else
                                                entry.batch_size_for(samples), kind, dev.name)
        if est is None:
            return view.estimate(entry.key, samples, dev), -math.inf
        return est, until

    @staticmethod
    def _est_unrun(view: ControllerView, entry: ModelEntry, samples: int, dev: DeviceState) -> float:
        """`_est_on` for a device that never ran the model (`Estimator.ran_on`): its kind's profile,
        the same on every such device, read without a memo entry for the device (a LOAD's
        placement asks it of every device, for models most of which never ran there)."""
        kind = dev.kind
        seed = view.estimator.profile(entry.key, samples if kind in EXACT_ROW_KINDS else
                                      entry.batch_size_for(samples), kind)
        return seed if seed is not None else view.estimate(entry.key, samples, dev)

    def _load_est(self, view: ControllerView, entry: ModelEntry, kind: str, dev: DeviceState | None = None) -> float:
        """A LOAD of `entry` (onto `dev`: only the bytes of the blocks it lacks are copied)."""
        nbytes = entry.weight_bytes
        if dev is not None and nbytes and (blocks := entry.blocks_on(dev.kind)):
            nbytes = dev.memory.missing(nbytes, blocks)
        est = view.estimator.load(entry.key, kind, nbytes / entry.weight_bytes if entry.weight_bytes else 1.0)
        return est if est is not None else nbytes / LOAD_BANDWIDTH_GUESS

    # ---------------------------------------------------------------- inference

    def _plan_inference(self, view: ControllerView, now: float) -> Steps:
        limit = now + self.horizon
        devices, work_of, dirty = view.devices, self.work, self._dirty
        dev_wake = self._dev_wake
        if dev_wake:
            # (a walk of the dict, then the deletions: `list(d.items())` built a tuple per device
            # every pass)
            woke: list[str] = []
            for name, wake in dev_wake.items():
                if wake <= now:
                    woke.append(name)
            for name in woke:
                dirty.add(name)
                del dev_wake[name]
        # devices with work, by when they free; those with no on-time work that are idle now: time
        # for the best-effort lane
        order: list[tuple[float, str]] = []
        idle: list[str] = []
        for n in dirty:
            w = work_of.get(n)
            if w is not None and w.live:
                order.append((devices[n].timeline.exec.free_at(now), n))
            else:
                idle.append(n)
        if len(order) > 1:
            order.sort()
        dirty.clear()
        for start, name in order:
            dev = view.devices[name]
            exec_lane = dev.timeline.exec
            work = work_of[name]
            while start < limit and work.live:
                if not (yield from self._dispatch(view, dev, start, now)):
                    break
                start = exec_lane.free_at(now)
            if start >= limit and work.live:
                # (the test _drop_late begins with, first: most passes find nothing late, and a
                # generator made for nothing costs ~1k instructions, once per full device per pass)
                top = self._late(name).top()
                if top is not None and top.then < start:
                    yield from self._drop_late(view, dev, start, now)
                if work.live:
                    self._dev_wake[name] = start - self.horizon
            elif not work.live:
                idle.append(name)
        lane: list[ModelEntry] | None = None
        for name in idle:
            dev = devices[name]
            if dev.failed or dev.timeline.exec.free_at(now) > now:
                continue  # busy: its result makes it dirty again
            if lane is None:
                lane = view.late_work()
            if not lane:
                break
            yield from self._dispatch_lane(view, dev, lane, now)

    def _dispatch_lane(self, view: ControllerView, dev: DeviceState, lane: list[ModelEntry], now: float) -> Steps:
        """One best-effort batch on an idle device with no on-time work: the model ready here whose
        oldest lane request is the oldest, as many of its oldest as run within LANE_SLICE."""
        best: tuple[int, float] | None = None
        chosen: ModelEntry | None = None
        for entry in lane:
            key = entry.key
            head = entry.late.head()
            if head is None or not dev.memory.is_ready(key):
                continue
            if not dev.healthy_for(key, now):
                until = dev.failing.get(key, 0.0)
                if until > now:  # its batch failed here just now: look again when the cooldown ends
                    self._dev_wake[dev.name] = fmin(until, self._dev_wake.get(dev.name, until))
                continue
            if best is None or (head.rank, head.arrival) < best:
                best, chosen = (head.rank, head.arrival), entry
        if chosen is None:
            return False
        spec = chosen.spec
        taken: list[InferenceRequest] = []
        rows = 0
        for r in chosen.late.first(spec.max_batch_size):
            if rows + r.samples > spec.max_batch_size or (
                    taken and self._est(view, spec.key, rows + r.samples, dev) > LANE_SLICE):
                break
            taken.append(r)
            rows += r.samples
        if not taken:
            return False
        yield Infer(spec, dev.name, taken, spec.batch_size_for(rows), math.inf, self._est(view, spec.key, rows, dev),
                    best_effort=True)
        return True

    def _choose_batch(self, view: ControllerView, entry: ModelEntry, dev: DeviceState, start: float
                      ) -> list[InferenceRequest]:
        """The largest batch of this model whose requests all finish in time if it starts at `start`.

        As Clockwork's INFER5 does: for each batch size, the requests that can wait for it (their
        deadline is after it would finish); the largest size that enough of them fill wins, and
        requests too urgent for it are left out (and answered once nothing can finish them). At
        light load the largest batch includes the most urgent request anyway; under overload
        this is what keeps throughput up, where serving the most urgent first would force ever
        smaller batches while the backlog grows (measured: goodput fell to 40% of capacity).
        """
        q = entry.queue
        if q.requests == 1:  # one request queued (most models, most of the time): it is the batch
            head = q.head()
            return [head] if head is not None else []
        cap = entry.max_batch_size
        cands = q.first(4 * cap)
        if not cands:
            return []
        rank = cands[0].rank
        cands = [r for r in cands if r.rank == rank]  # one priority class per batch
        key, kind = entry.key, dev

        def fill(pool: list[InferenceRequest], rows: int) -> list[InferenceRequest]:
            out, n = [], 0
            for r in pool:
                if n + r.samples > rows:
                    break
                out.append(r)
                n += r.samples
            return out

        # When a batch of each row count would end, once: both searches below look at most of them.
        top = min(cap, sum(r.samples for r in cands))  # no batch can hold more rows than are queued
        ends = [0.0] + [start + self._est(view, key, rows, kind) for rows in range(1, top + 1)]
        # The head's batch: requests in order of urgency while everyone still meets its deadline
        # (what runs when the largest batch starts with the head).
        head_batch: list[InferenceRequest] = []
        n, deadline = 0, math.inf
        for r in cands:
            if n + r.samples > top:
                break
            d = fmin(deadline, r.deadline)
            if ends[n + r.samples] > d:
                break
            head_batch.append(r)
            n, deadline = n + r.samples, d
        best_rows, best_at = self._largest(ends, top, cands)
        if best_at == 0 or best_rows <= n:
            return head_batch  # the largest batch starts with the head anyway
        return fill(cands[best_at:], best_rows)

    @staticmethod
    def _largest(ends: list[float], cap: int, pool: list[InferenceRequest]) -> tuple[int, int]:
        """(rows, first index) of the largest batch from `pool` (ascending deadlines) that finishes
        in time (`ends[rows]`, when it would end): the requests from that index on can all wait."""
        deadlines = [r.deadline for r in pool]
        suffix = [0] * (len(pool) + 1)
        for i in range(len(pool) - 1, -1, -1):
            suffix[i] = suffix[i + 1] + pool[i].samples
        best_rows, best_at = 0, 0
        for rows in range(1, cap + 1):
            i = bisect_left(deadlines, ends[rows])
            if suffix[i] >= rows:
                best_rows, best_at = rows, i
        return best_rows, best_at

    def _drop_late(self, view: ControllerView, dev: DeviceState, start: float, now: float) -> Steps:
        """Heads that cannot start in time even when this device frees, where no device holding
        them frees sooner: answered now (the latest-start index reaches exactly those).

        A model another device can still serve in time leaves this device's index until work of
        it arrives again (on_queued): that device indexes it too and drops its head if it no
        longer can, and its dispatch runs or drops it. Kept here, it was looked at again in every
        pass while this device stayed full: under overload, every model on the device, per pass
        (most of the controller's time at 5x capacity)."""
        late = self._late(dev.name)
        keep: list[tuple[str, float]] = []
        while (top := late.top()) is not None and top.then < start:
            late.pop()
            key = top.key
            entry = view.models.get(key)
            if entry is None or not dev.memory.is_ready(key):
                continue
            while (head := entry.queue.head()) is not None:
                latest = head.deadline - self._est(view, key, head.samples, dev)
                if start <= latest:
                    keep.append((key, latest))
                    break
                if self._sooner_elsewhere(view, key, head.samples, dev, head.deadline, now):
                    break
                yield Drop(head)
                self._dropped(key, now)
        for key, latest in keep:
            late.push(key, 0, latest)

    @staticmethod
    def _slow_here(view: ControllerView, key: str, samples: int, dev: DeviceState, run: float) -> bool:
        """The device's recent runs of the model are well above its kind's profile (a cheap filter
        before looking at the other devices)."""
        profile = view.estimator.infer(key, samples, dev.kind)
        return profile is not None and run > SLOW_DEVICE * profile

    def _sooner_elsewhere(self, view: ControllerView, key: str, samples: int, dev: DeviceState, finish: float,
                          now: float) -> bool:
        """Another device holding the model, where its INFERs have not just failed, would finish
        `samples` of it before `finish`."""
        for name in view.ready_on.get(key, ()):
            other = view.devices[name]
            if other is not dev and other.healthy_for(key, now) and \
                    other.timeline.exec.free_at(now) + self._est(view, key, samples, other) < finish:
                return True
        return False

    def _dispatch(self, view: ControllerView, dev: DeviceState, start: float, now: float) -> Steps:
        """Plan one batch on `dev` starting at `start`; False when there is nothing to run there."""
        work = self.work[dev.name]
        stash: list[tuple[str, float, float]] = []  # models left to other devices in this pass
        chosen: tuple[ModelEntry, InferenceRequest, float, float] | None = None
        while (top := work.pop()) is not None:
            rank, latest_key, key = top.at, top.then, top.key
            entry = view.models.get(key)
            if entry is None or not dev.memory.is_ready(key):
                continue
            head = entry.queue.head()
            if head is None:
                continue
            run = self._est_on(view, key, head.samples, dev)
            latest_start = head.deadline - run
            if head.rank > rank or (head.rank == rank and latest_start > latest_key):
                nxt = work.top()
                if nxt is not None and (nxt.at < head.rank or (nxt.at == head.rank and nxt.then < latest_start)):
                    work.push(key, head.rank, latest_start)  # less urgent than it was: in its place
                    continue
            if start > latest_start:
                if self._sooner_elsewhere(view, key, head.samples, dev, head.deadline, now):
                    stash.append((key, head.rank, latest_start))  # too slow here: another device makes it
                    continue
                # No device holding the model can finish it in time: answer at once, look again.
                yield Drop(head)
                self._dropped(key, now)
                if (h := entry.queue.head()) is not None:
                    work.push(key, h.rank, h.deadline - self._est(view, key, h.samples, dev))
                continue
            if not dev.healthy_for(key, now) and any(
                    view.devices[n].healthy_for(key, now) for n in view.ready_on.get(key, ()) if n != dev.name):
                # its INFERs failed here just now (until then), or a warm-up runs here (until the
                # scheduler says it ended: on_queued)
                stash.append((key, head.rank, latest_start))
                until = dev.failing.get(key, 0.0)
                if until > now:
                    self._dev_wake[dev.name] = fmin(until, self._dev_wake.get(dev.name, until))
                continue
            if (start > now or self._slow_here(view, key, head.samples, dev, run)) and \
                    self._sooner_elsewhere(view, key, head.samples, dev, start + run, now):
                stash.append((key, head.rank, latest_start))  # busy or slow: a device that finishes sooner
                continue
            chosen = (entry, head, latest_start, run)
            break
        for key, rank, latest in stash:
            work.push(key, rank, latest)
        if chosen is None:
            return False
        entry, head, latest_start, head_run = chosen
        spec, q = entry.spec, entry.queue
        bind = self._bind_at(view, entry, dev, start, now) if self.batch_wait > 0 else now
        if bind > now and not work:
            work.push(spec.key, head.rank, latest_start)
            self._dev_wake[dev.name] = fmin(bind, self._dev_wake.get(dev.name, bind))  # a fuller batch soon
            return False
        taken = self._choose_batch(view, entry, dev, start)
        if not taken:
            work.push(spec.key, head.rank, latest_start)
            return False
        if len(taken) == 1 and taken[0] is head:  # (most batches at light load: estimated above)
            samples, deadline, run = head.samples, head.deadline, head_run
        else:
            samples, deadline = 0, math.inf
            for r in taken:  # (a loop: compiled compares, not the builtins' generic calls)
                samples += r.samples
                if r.deadline < deadline:
                    deadline = r.deadline
            run = self._est(view, spec.key, samples, dev)
        group = self._group(view, entry, taken, dev, start, now) if entry.prefix and self.cross_model else None
        if group is not None:
            members, run = group
            samples, deadline = sharing.joined(members, samples, deadline)
        b = spec.batch_size_for(samples)
        latest = fmax(deadline - run, start + LATEST_GRACE)
        # (the scheduler takes the requests from their queues)
        yield Infer(spec, dev.name, taken, b, latest, run, group=group[0] if group is not None else None)
        if (h := q.head()) is not None:
            work.push(spec.key, h.rank, h.deadline - self._est_on(view, spec.key, h.samples, dev))
        for mspec, _ in group[0] if group is not None else ():
            if (h := view.models[mspec.key].queue.head()) is not None:
                work.push(mspec.key, h.rank, h.deadline - self._est(view, mspec.key, h.samples, dev))
        return True

    def _group(self, view: ControllerView, entry: ModelEntry, taken: list[InferenceRequest], dev: DeviceState,
               start: float, now: float) -> tuple[sharing.Members, float] | None:
        """Other models' requests that can join this batch to share its prefix (sharing.py)."""
        if not sharing.allowed(dev, entry):
            return None  # (ParM protects one model's batches; a simulated device runs none)
        cands = self.prefixed.get(entry.prefix)
        if not cands:
            return None
        for k in [k for k in cands if (e := view.models.get(k)) is None or not e.queue.requests]:
            cands.discard(k)
        if not cands or cands == {entry.key}:
            return None
        return sharing.extend(view, dev, entry, taken, start, cands, now)

    def _bind_at(self, view: ControllerView, entry: ModelEntry, dev: DeviceState, start: float, now: float) -> float:
        """When to choose the next batch of `entry` on `dev` (which frees at `start`): now, or, for
        a model arriving fast enough, just before the batch should start, so that it holds what
        arrives meanwhile.

        Work-conserving batching at a high arrival rate on a fast device runs many tiny batches,
        and planning a horizon ahead fixes them even earlier: each pays the controller's and the
        executor's per-batch cost (on a CPU host: half the event loop's time per request at
        4,000 req/s) and the device's poor small-batch efficiency. So, as a dynamic batcher's
        queue delay does, but only where the rate says the batch will grow: wait at most
        `batch_wait` (and a tenth of the SLO) after the head arrived, never past the point where
        a full batch would still meet the head's deadline, and not at all at a rate that brings
        fewer than MIN_FILL samples in that time (light and moderate load keep their latency:
        there the per-batch costs do not limit anything).
        """
        wait = fmin(self.batch_wait, entry.spec.slo_s * MAX_WAIT_OF_SLO)
        if wait <= 0:
            return now
        key, cap = entry.key, entry.max_batch_size
        queued = entry.queue.samples
        meter = self._demand.meter(key)
        rate = meter.value(now) if meter is not None else 0.0
        head = entry.queue.head()
        if head is None or queued >= cap or rate * wait < MIN_FILL:
            return now
        full_at = now + (cap - queued) / rate
        latest = head.deadline - self._est(view, key, cap, dev) - LATEST_GRACE
        return fmax(start, fmin(fmin(full_at, head.arrival + wait), latest)) - BIND_LEAD

    # ---------------------------------------------------------------- memory

    def _plan_memory(self, view: ControllerView, now: float) -> Steps:
        """Loads for the most urgent unmet demand: cold models with work first by their head's
        deadline (a load takes a copy lane for a while, and a model whose requests expire first
        must not wait behind newer ones), then replicas of models their devices cannot keep up
        with. While every copy lane is busy, only the most urgent cold heads are checked, and
        answered now if no LOAD could serve them in time. Returns whether it issued a LOAD."""
        placed_any = False
        wanted: list[tuple[float, float, ModelEntry]] = []
        for key in self._replica_check:
            entry = view.models.get(key)
            if entry is not None and entry.queue.samples < entry.max_batch_size and key not in self.drops:
                continue  # (most models: _needs_replica says no without a look at its devices)
            placed = view.placed_on.get(key)
            head = entry.queue.head() if entry is not None else None
            if entry is None or head is None or not placed or len(placed) >= len(view.devices):
                continue
            if self._needs_replica(view, entry, [view.devices[n] for n in placed], now):
                wanted.append((head.deadline, 0.0, entry))
        self._replica_check.clear()
        if not wanted and not len(self.cold.live) and not len(self._lane_cold):
            return False  # (most passes: a model gained work and needs no replica)
        wanted.sort(key=lambda w: w[:2])
        limit = now + self.horizon
        later: list[tuple[str, float, float]] = []  # cold models looked at and still cold
        checked = 0

        def free_lanes() -> bool:
            return any(d.timeline.copy.free_at(now) < limit for d in view.devices.values())

        lanes_free = free_lanes()
        while (top := self.cold.top()) is not None or wanted:
            if wanted and (top is None or wanted[0][0] < top.at):
                _, _, entry = wanted.pop(0)
                if lanes_free and (yield from self._place(view, entry, now)):
                    lanes_free = free_lanes()
                    placed_any = True
                continue
            popped = self.cold.pop()
            assert popped is not None
            deadline, minus_backlog, key = popped.at, popped.then, popped.key
            entry = view.models.get(key)
            if entry is None or view.placed_on.get(key) or (head := entry.queue.head()) is None:
                continue
            now_deadline, now_minus = head.deadline, -self._backlog(view, entry)
            if now_deadline > deadline or (now_deadline == deadline and now_minus > minus_backlog):
                self.cold.push(key, now_deadline, now_minus)  # less urgent than it was: in its place
                continue
            samples = entry.queue.samples
            if lanes_free:
                if (yield from self._place(view, entry, now)):
                    lanes_free = free_lanes()
                    placed_any = True
            else:
                yield from self._drop_unloadable(view, entry, now)
            if not view.placed_on.get(key) and (h := entry.queue.head()) is not None:
                # (its backlog as found above unless requests were dropped: estimates do not
                # change within a pass)
                later.append((key, h.deadline, now_minus if entry.queue.samples == samples else
                              -self._backlog(view, entry)))
                checked += 1
            if checked >= COLD_CHECKS:
                break  # the rest are less urgent: looked at as lanes drain and loads land
        for key, deadline, minus_backlog in later:
            self.cold.push(key, deadline, minus_backlog)
        if len(self._lane_cold) and not len(self.cold.live) and lanes_free:
            placed_any = (yield from self._place_lane(view, now)) or placed_any
        return placed_any

    def _place_lane(self, view: ControllerView, now: float) -> Steps:
        """A LOAD for best-effort work, once no on-time model waits for one: the model whose oldest
        lane request is the oldest."""
        oldest: tuple[float, ModelEntry] | None = None
        for key in list(self._lane_cold):
            entry = view.models.get(key)
            head = entry.late.head() if entry is not None else None
            if head is None or view.placed_on.get(key):
                self._lane_cold.discard(key)
                continue
            if entry is not None and (oldest is None or head.arrival < oldest[0]):
                oldest = (head.arrival, entry)
        if oldest is None:
            return False
        placed = yield from self._place(view, oldest[1], now)
        if placed:
            self._lane_cold.discard(oldest[1].spec.key)
        return placed

    def _drop_unloadable(self, view: ControllerView, entry: ModelEntry, now: float) -> Steps:
        """Answer at once the queued requests of a cold model that no LOAD could serve in time."""
        spec = entry.spec
        best = math.inf
        for dev in view.devices.values():
            if dev.memory.budget < entry.weight_bytes:
                continue
            tl = dev.timeline
            ready = fmax(tl.copy.free_at(now) + self._load_est(view, entry, dev.kind, dev), tl.exec.free_at(now))
            best = fmin(best, ready + self._est(view, spec.key, 1, dev))
        while (h := entry.queue.head()) is not None and best > h.deadline:
            yield Drop(h)

    def _dropped(self, key: str, now: float) -> None:
        meter = self.drops.get(key)
        if meter is None:
            meter = self.drops[key] = RateMeter()
        meter.add(1, now)

    def _utilisation(self, view: ControllerView, dev: DeviceState, now: float) -> float:
        """Seconds of work per second the models on `dev` bring it (their arrival rates times their
        cost per sample at their largest batch, shared among their replicas). Kept as arrivals
        come (controller/demand.py); the costs are made again for every model on the device when
        they are UTIL_REBUILD old, which also takes in models placed other than by this policy's
        LOADs (preloads, reservations) and drops those unplaced."""
        total = self._demand.current_total(dev.name, now)  # (one call for most: asked per device per LOAD)
        return total if total >= 0.0 else self._demand_on(view, dev, now).total(dev.name, now)

    def _demand_on(self, view: ControllerView, dev: DeviceState, now: float) -> DeviceDemand:
        """The demand tracker, its weights and cold-cost ranking for `dev` made again if stale."""
        demand = self._demand
        if demand.stale(dev.name, now):
            weights: dict[str, float] = {}
            loads: dict[str, float] = {}
            models, placed_on = view.models, view.placed_on
            kind = self._cost_kind(view)
            for k in dev.memory.models():
                entry = models.get(k)
                known = demand.load_s(k)  # (kept up to date by every LOAD of it measured)
                if entry is not None:
                    weights[k] = self._weight(view, entry, dev, len(placed_on.get(k, ())))
                    loads[k] = known if known >= 0.0 else self._load_est(view, entry, kind)
                else:  # removed, still here (busy when it was): no work, but a victim search may take it
                    weights[k] = 0.0
                    loads[k] = fmax(known, 0.0)
            demand.rebuild(dev.name, weights, loads, now)
        return demand

    def _weight(self, view: ControllerView, entry: ModelEntry, dev: DeviceState, replicas: int) -> float:
        """Seconds of work one sample of `entry` brings `dev`, at its largest batch, per replica."""
        b = entry.max_batch_size
        key = entry.key
        run = self._est_on(view, key, b, dev) if view.estimator.ran_on(key, dev.name) else \
            self._est_unrun(view, entry, b, dev)
        return run / b / (replicas or 1)

    def _moved(self, view: ControllerView, dev: DeviceState, entry: ModelEntry, victims: list[str],
               load_s: float) -> None:
        """A LOAD of `entry` replacing `victims` on `dev`: its demand, updated (`load_s`: a LOAD's
        estimate on the cost kind)."""
        demand = self._demand
        for k in victims:
            demand.remove(k, dev.name)
        key = entry.key
        demand.place(key, dev.name, self._weight(view, entry, dev, len(view.placed_on.get(key, ()))), load_s)

    def _holds(self, blocked: dict[str, _Blocked], dev: DeviceState, lasting: float, head: InferenceRequest,
               now: float) -> _Blocked | None:
        """The last search for this model on `dev`, if it found no room and nothing it read has
        changed since in a way that could make room (`_Blocked`), but for the head turning urgent
        under pressure: the caller, who knows when its LOAD and first run would end, looks at that."""
        was = blocked.get(dev.name)
        if was is None or lasting > was.cost or head.deadline != was.deadline or dev.memory.free > was.free \
                or was.shared != dev.memory.shared_changes or was.lowered != self._demand.lowered(dev.name) \
                or was.ranked != self._demand.built_at(dev.name):
            return None
        if was.pressed and not self._pressed(dev.name, now):
            return None  # pressure no longer protects the device's models
        eased = dev.eased
        if eased != was.eased:
            if not was.pressed or eased - was.eased > EASED_RING:
                return None
            keys, demand, bound = dev.eased_keys, self._demand, was.cost + COST_SLACK
            for i in range(was.eased, eased):
                k = keys[i % EASED_RING]
                known = demand.load_s(k)
                if known < 0.0 or demand.lasting_cost(k, known) <= bound:
                    return None  # (as cheap as this model: it may go now)
            was.eased = eased  # (stands as of now: later checks look only at what follows)
        return was

    def _all_blocked(self, view: ControllerView, entry: ModelEntry, blocked: dict[str, _Blocked], lasting: float,
                     head: InferenceRequest, now: float) -> bool:
        """Whether every device `_place` would consider for `entry` is one its search would pass
        over (and none is due to have its demand made again, which a candidate's load does)."""
        key, nbytes = entry.key, entry.weight_bytes
        spared = 0
        whole: dict[str, float] = {}
        profiled: dict[str, float] = {}
        ran = view.estimator.ran_where(key)
        for dev in view.devices.values():
            copy_free = self._copy_free_for(dev, key, nbytes, now)
            if copy_free == math.inf:
                continue
            was = self._holds(blocked, dev, lasting, head, now)
            if was is None or self._demand.stale(dev.name, now):
                return False
            if was.pressed:  # (urgent now, pressure would not protect the device's models)
                load_s, run_s = self._load_and_run(view, entry, dev, head.samples, whole, profiled, ran)
                if head.deadline - (copy_free + load_s + run_s) <= self.horizon:
                    return False
            spared += 1
        self.searches_spared += spared
        return True

    def _copy_free_for(self, dev: DeviceState, key: str, nbytes: int, now: float) -> float:
        """When `dev`'s copy lane frees for a LOAD of `key` (`nbytes`), or inf where none goes now:
        placed there already, too small, backing off, or its copy lane busy past the horizon (the
        load is planned later)."""
        if dev.memory.state(key) is not None or dev.memory.budget < nbytes or not dev.can_load(key, now):
            return math.inf
        copy_free = dev.timeline.copy.free_at(now)
        return copy_free if copy_free < now + self.horizon else math.inf

    def _load_and_run(self, view: ControllerView, entry: ModelEntry, dev: DeviceState, samples: int,
                      whole: dict[str, float], profiled: dict[str, float],
                      ran: dict[str, dict[int, SlidingWindow]]) -> tuple[float, float]:
        """A LOAD of `entry` onto `dev` and its first run of `samples` there, estimated; `whole`
        and `profiled` keep, per kind, what is the same on every device of it; `ran`: where its
        runs were measured (`Estimator.ran_where`)."""
        kind = dev.kind
        if entry.blocks_on(kind):  # (the bytes it lacks differ by device)
            load_s = self._load_est(view, entry, kind, dev)
        else:  # the same on every device of a kind: estimated once per kind
            known = whole.get(kind)
            if known is None:
                known = whole[kind] = self._load_est(view, entry, kind, dev)
            load_s = known
        if dev.name in ran:
            run_s = self._est_on(view, entry.key, samples, dev)
        else:  # its kind's profile, as `_est_on` finds it there: looked up once per kind
            known = profiled.get(kind)
            if known is None:
                known = profiled[kind] = self._est_unrun(view, entry, samples, dev)
            run_s = known
        return load_s, run_s

    def _rate(self, view: ControllerView, entry: ModelEntry, c: _Candidate, samples: int, whole: dict[str, float],
              profiled: dict[str, float], ran: dict[str, dict[int, SlidingWindow]], now: float) -> None:
        """A candidate's LOAD and first run of `samples`, estimated: when they would end (`done`),
        and when the run could finish behind the device's work (`finish`)."""
        dev = c.dev
        load_s, run_s = self._load_and_run(view, entry, dev, samples, whole, profiled, ran)
        c.finish = fmax(c.copy_free + load_s, dev.timeline.exec.free_at(now)) + run_s
        c.done = c.copy_free + load_s + run_s
        c.rated = True

    def _rate_group(self, view: ControllerView, entry: ModelEntry, candidates: list[_Candidate], first: int,
                    samples: int, whole: dict[str, float], profiled: dict[str, float],
                    ran: dict[str, dict[int, SlidingWindow]], now: float) -> int:
        """The candidates from `first` equal to it in eviction and load, rated and ordered by when
        they could finish, then name: the order a sort of every candidate on all four would give.
        Returns where the group ends."""
        lead = candidates[first]
        end = first
        while end < len(candidates) and candidates[end].short == lead.short and candidates[end].load == lead.load:
            c = candidates[end]
            if not c.rated:
                self._rate(view, entry, c, samples, whole, profiled, ran, now)
            i = end
            while i > first and _finish_before(c, candidates[i - 1]):  # (insertion: a handful of devices)
                candidates[i] = candidates[i - 1]
                i -= 1
            candidates[i] = c
            end += 1
        return end

    def _cost_kind(self, view: ControllerView) -> str:
        """`_cost_kind`, kept for the view's devices (a generic `next(iter(...))` was ~640
        instructions, a few times a LOAD)."""
        devices = view.devices
        if devices is not self._kind_of:
            self._kind = _cost_kind(view)
            self._kind_of = devices
        return self._kind

    def _pressed(self, device: str, now: float) -> bool:
        """Whether `device`'s copy lane is busier than COPY_PRESSURE."""
        meter = self.copy_busy.get(device)
        return meter is not None and meter.value(now) > COPY_PRESSURE

    def _backlog(self, view: ControllerView, entry: ModelEntry) -> float:
        """Seconds of work queued for a model, at its largest batch size."""
        b = entry.max_batch_size
        kind = view.kinds[0]
        # (the estimator's memo read directly, as `_est_on` does: through the view's generic
        # `estimate` this was ~4k instructions, once for every cold model a pass looks at)
        est = view.estimator.infer_until(entry.key, b if kind in EXACT_ROW_KINDS else entry.batch_size_for(b),
                                         kind)[0]
        if est is None:
            est = view.estimate(entry.key, b, kind)
        return entry.queue.samples * est / b

    def _needs_replica(self, view: ControllerView, entry: ModelEntry, placed: list[DeviceState], now: float) -> bool:
        """More arrivals than its devices can serve, or requests dropped because they were too
        slow or busy (Clockwork's SMART scheduler replicates after drops the same way)."""
        key = entry.key
        if now - self.replicated_at.get(key, -math.inf) < REPLICA_COOLDOWN:
            return False
        drops = self.drops.get(key)
        if drops is not None and drops.value(now) > REPLICA_DROPS:
            return True
        meter = self._demand.meter(key)
        b = entry.max_batch_size  # (not `entry.spec`'s: a generic read, twice per arrival to a model with room)
        if meter is None or entry.queue.samples < b:
            return False
        capacity = 0.0
        for d in placed:  # (a loop, not `sum` over a generator: compiled)
            capacity += b / fmax(self._est_on(view, key, b, d), 1e-9)
        return meter.value(now) > REPLICA_UTILISATION * capacity

    def _place(self, view: ControllerView, entry: ModelEntry, now: float) -> Steps:
        """Issue a LOAD of `entry` (and the UNLOADs that make room for it); True if one was issued."""
        key, nbytes = entry.key, entry.weight_bytes
        head = entry.queue.head()

        kind = self._cost_kind(view)
        my_load = self._load_est(view, entry, kind)
        # Devices where a search found no room, and nothing it read has changed since, are passed
        # over as the search would be (none for best-effort work, which has no head); when that is
        # every device it could go to, nothing more is looked at.
        blocked = self._blocked.get(key) if head is not None and self.shortcuts else None
        lasting = self._demand.lasting_cost(key, my_load) if head is not None else 0.0
        if blocked is not None and head is not None and self._all_blocked(view, entry, blocked, lasting, head, now):
            return False
        rules = _LoadRules(self, view, kind, head is None, now)
        # Never evict a model that costs more to keep cold than this one: that only moves the
        # cold starts, and makes more copy work than it saves.
        mine = rules.mine = self._demand.cold_cost(key, now, my_load)

        # Every device that could take it, with what orders them short of a victim search: any
        # eviction at all, the device's load (tenths), when it could finish, its name.
        candidates: list[_Candidate] = []
        whole: dict[str, float] = {}  # kind -> a whole LOAD's estimate there
        profiled: dict[str, float] = {}  # kind -> its first run's estimate on a device that never ran it
        b1 = head.samples if head is not None else 1
        ran = view.estimator.ran_where(key)
        for dev in view.devices.values():
            copy_free = self._copy_free_for(dev, key, nbytes, now)
            if copy_free == math.inf:
                continue
            blocks = entry.blocks_on(dev.kind)
            # shared blocks already there are neither copied again nor freed to make room
            lacks = dev.memory.missing(nbytes, blocks)
            # Spread demand: the device with the least work per second on it (in steps of 10% of a
            # device), then the one that can serve this model soonest. (The work its victims
            # bring leaves with them; they are idle or the least wanted, so it is counted: knowing
            # it would take a victim search on every device, the most of a LOAD's cost at 10,000
            # models, where this order takes one on the first device that evicts nothing in demand.)
            c = _Candidate(lacks > dev.memory.free, _tenths(self._utilisation(view, dev, now)), copy_free, dev,
                           lacks, blocks, False)
            if blocked is not None and head is not None:
                was = self._holds(blocked, dev, lasting, head, now)
                if was is not None:
                    if was.pressed:  # hopeless unless its head turned urgent
                        self._rate(view, entry, c, b1, whole, profiled, ran, now)
                        c.hopeless = head.deadline - c.done > self.horizon
                    else:
                        c.hopeless = True
            i = len(candidates)
            candidates.append(c)
            while i > 0 and _candidate_before(c, candidates[i - 1]):  # (insertion: a handful of devices)
                candidates[i] = candidates[i - 1]
                i -= 1
            candidates[i] = c
        if not candidates:
            return False
        best: _Option | None = None
        finish = math.inf  # the soonest any LOAD could serve it: of options found, and devices not searched
        searched = len(candidates)  # (those after a search that needs no better one are not)
        n = 0
        ordered = 0  # candidates before it are in their full order
        while n < len(candidates):
            if n == ordered:  # the first of a group of equal load: estimated, ordered by when they finish
                ordered = self._rate_group(view, entry, candidates, n, b1, whole, profiled, ran, now)
            c = candidates[n]
            n += 1
            if c.hopeless:
                self.searches_spared += 1
                continue
            short, load, at, name, dev, done, lacks, blocks = c.short, c.load, c.finish, c.name, c.dev, c.done, \
                c.lacks, c.blocks
            meter = self.copy_busy.get(name)
            # Under copy pressure a load evicts no model in more demand, unless its head request
            # must load now or never: waiting for pressure to ease would starve it to its deadline.
            urgent = head is not None and head.deadline - done <= self.horizon
            pressed = meter is not None and meter.value(now) > COPY_PRESSURE and not urgent
            rules.busy, rules.pressed = dev.busy, pressed
            # under pressure only models cheaper to keep cold may go: found by their ranking
            among = self._demand_on(view, dev, now).cheaper(name, mine, now, CHEAPER_LIMIT) if pressed else None
            victims = dev.memory.victims(lacks, rules, keep=dev.memory.present(blocks), among=among)
            if victims is None:
                if head is not None and self.shortcuts:
                    if blocked is None:
                        if len(self._blocked) >= BLOCKED_LIMIT:
                            self._blocked.clear()
                        blocked = self._blocked[key] = {}
                    blocked[name] = _Blocked(dev.eased, dev.memory.free, self._demand.built_at(name),
                                             self._demand.lowered(name), dev.memory.shared_changes, lasting,
                                             head.deadline, pressed)
                continue
            if at < finish:
                finish = at
            in_demand = 0  # (loops, not sum/min/any over generators: compiled, per device per LOAD)
            for k in victims:
                if rules.wanted(k):
                    in_demand += 1
            option: _Option = (in_demand, short, load, at, name, dev, victims)
            if best is None or _option_before(option, best):
                best = option
            if in_demand == 0:  # (no device after it in this order can do better)
                searched = n
                break
        if best is None:
            return False
        if head is not None and not _placed(view, key):
            # Cold: a head that even the best LOAD cannot save is answered now; the load still
            # goes ahead if anyone behind it can make it. (The devices not searched count only
            # where the options found are too late for the head.)
            if finish > head.deadline:
                for rest in candidates[searched:]:
                    if not rest.rated:
                        self._rate(view, entry, rest, b1, whole, profiled, ran, now)
                    if rest.finish < finish:
                        finish = rest.finish
            while (h := entry.queue.head()) is not None and finish > h.deadline:
                yield Drop(h)
            if entry.queue.head() is None:
                return False
        dev, victims = best[5], best[6]  # (not `*_, dev, victims`: compiled, a starred target builds a list)
        for k in victims:
            victim = view.models.get(k)
            if victim is not None:
                yield Unload(victim.spec, dev.name)
        # (the cost kind's estimate where it is the device's and the whole model is copied: the same)
        yield Load(entry.spec, dev.name, my_load if dev.kind == kind and not entry.blocks_on(kind)
                   else self._load_est(view, entry, dev.kind, dev))
        self._blocked.pop(key, None)
        self._moved(view, dev, entry, victims, my_load)
        if _placed(view, key, dev):
            self.replicated_at[key] = now
        return True
