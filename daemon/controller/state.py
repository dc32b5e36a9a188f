"""The controller's state records: what it knows of each device and each model, and a decision.

Shared by the scheduler (scheduler.py) and the policies (policies/): plain data, no logic
beyond small predicates, so that policies need not import the scheduler.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Final

from daemon.actions import Action
from daemon.controller.demand import ModelDemand
from daemon.controller.due import Due
from daemon.controller.estimates import ModelEstimates
from daemon.controller.memory import Blocks, DeviceMemory
from daemon.controller.queues import ModelQueue
from daemon.controller.timeline import DeviceTimeline
from daemon.model import ModelSpec
from daemon.request import InferenceRequest
from daemon.runtime.devices import Device

LATEST_GRACE: Final = 0.002  # an action may start this much after the plan before it is refused
FAILURE_COOLDOWN: Final = 1.0  # seconds a model's INFERs keep off a device where one failed (if another holds it)
LOAD_BACKOFF = (1.0, 30.0)  # a model whose LOAD failed keeps off that device 1, 2, 4 ... at most 30 s
NO_MEMORY_RETRIES: Final = 3  # LOADs refused for memory in a row before the device is backed off like a failure
MAX_FAILURES: Final = 2  # a request whose INFER failed this often is answered with the error
OVERDUE_GRACE: Final = 0.005  # an INFER not back this long after its requests' deadline: answer them 504
# Device kinds whose backend holds weights by extent (runtime/cuda.py): a plan's shared leading
# stage is one block there, held once, and the rest of a model is its own
EXTENT_KINDS: Final = frozenset({"cuda", "emucuda"})
EASED_RING: Final = 32  # the last models that may have become evictable on a device, kept by name


@dataclass(slots=True, eq=False)
class DeviceState:
    device: Device
    memory: DeviceMemory
    infer_inflight: int = 0
    load_inflight: int = 0
    # model key -> its actions in flight here (defaultdicts, as Scheduler.counters: read per action)
    busy: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # model key -> until when to keep its INFERs off this device (they failed here), while another holds it
    failing: dict[str, float] = field(default_factory=dict)
    # model key -> until when no LOAD of it goes here (its LOAD failed here), and failures in a row
    load_backoff: dict[str, float] = field(default_factory=dict)
    load_failures: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    failed: str = ""  # why the device is lost (a sticky error, a hang); "" while it is healthy
    warming: str = ""  # the warm-up running here outside the scheduler ("" when none)
    # Models here that may have become evictable (a batch of theirs came back, their LOAD landed,
    # their last waiting request went unserved), counted, the last EASED_RING by name: what may
    # have made room here since a policy looked (`ease`)
    eased: int = 0
    eased_keys: list[str] = field(default_factory=lambda: [""] * EASED_RING)
    ran_s: float = 0.0  # seconds its INFERs ran here (begin to end), all models: how busy it kept
    # When each lane is next free: every INFER (parity batches and replicas too) and LOAD issued
    # here is on it until its result comes back.
    timeline: DeviceTimeline = field(default_factory=DeviceTimeline)
    # the device's name and kind, copied (plain attributes: read several times per request)
    name: str = field(init=False)
    kind: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.device.name
        self.kind = self.device.kind

    def ease(self, key: str) -> None:
        """`key`, here, may have become evictable: the `eased`-th such event (from 0), kept at
        `eased_keys[eased % EASED_RING]`."""
        self.eased_keys[self.eased % EASED_RING] = key
        self.eased += 1

    def healthy_for(self, key: str, now: float) -> bool:
        """Whether `key`'s INFERs should run here rather than on another device holding it: not
        while they failed here just now, nor beside a warm-up (it would delay them, and they
        would inflate the profile it measures)."""
        return not self.warming and self.failing.get(key, 0.0) <= now

    def can_load(self, key: str, now: float) -> bool:
        """No LOAD of `key` here while backing off from a failed one, or once the device is lost."""
        backoff = self.load_backoff  # (empty but after a failed LOAD: no look-up then)
        return not self.failed and (not backoff or backoff.get(key, 0.0) <= now)


@dataclass(slots=True)
class Decision:
    actions: list[Action] = field(default_factory=list)
    finished: list[InferenceRequest] = field(default_factory=list)

    # (written out: mypyc compiles it, not a generated one; one per step)
    def __init__(self, actions: list[Action] | None = None, finished: list[InferenceRequest] | None = None) -> None:
        self.actions = [] if actions is None else actions
        self.finished = [] if finished is None else finished


@dataclass(slots=True)
class ModelEntry:
    spec: ModelSpec
    weight_bytes: int  # device bytes of a LOAD onto a device holding none of its blocks
    blocks: Blocks = ()  # its weights by content (shared with other models on devices that share)
    stage_blocks: Blocks = ()  # on EXTENT_KINDS devices: its shared leading stage's extent and input block, if any
    queue: ModelQueue = field(default_factory=ModelQueue)
    # Requests answered late rather than lost: they could not make their target, or never had one;
    # served in device time no on-time work needs, oldest first.
    late: ModelQueue = field(default_factory=lambda: ModelQueue(by_arrival=True))
    load_failures: int = 0  # LOADs that failed in a row (any device)
    load_error: str = ""  # the last one's error
    # While requests keep waiting, per window: the share of the time its devices ran batches
    # (any model's), which scales what admission expects of them. Devices that idle while work
    # waits (a loop busy elsewhere) deliver less than their estimates; devices busy with other
    # models' work do not, since the deadline order gives a model more of them as its head ages.
    backlog_since: float = 0.0  # start of the current window; 0 while the queue has run dry
    backlog_ran: float = 0.0  # the devices' `ran_s`, summed, at the window's start
    backlog_devices: int = 0  # how many devices held it ready then (the sum is over those)
    drain_busy: float = 0.0  # the last full window's share (0..1); 0 when none
    running: int = 0  # samples of its INFERs in flight (they run before anything queued)
    # The devices holding it ready, and holding or loading it: the very sets `Scheduler.ready_on`
    # and `placed_on` map its name to while they are not empty (those maps serve readers that
    # have a name; a request's path reads them here, without a look-up of the name).
    ready: set[str] = field(default_factory=set)
    placed: set[str] = field(default_factory=set)
    # Its estimator record (Estimator.of), reached from here: `best_case` and the drain rate read
    # its estimates on every arrival. (A record of its own in tests that make an entry alone.)
    estimates: ModelEstimates = field(default_factory=ModelEstimates)
    # Scheduler._drain_rate's memo: the rate, and what it was made from (the estimates' version,
    # how many devices held it ready, until when the estimates hold)
    rate: float = 0.0
    rate_version: int = -1
    rate_holders: int = -1
    rate_until: float = 0.0
    demand: ModelDemand | None = None  # the clockwork policy's demand record of it, once it has one
    # Devices added to or taken from its `ready_on` so far: a value derived from them (the two
    # memos below) holds while this stands. Its own count, not one for every model: at 10,000
    # models LOADs and UNLOADs come thousands of times a second, and a shared count voided every
    # model's memos at each one (a few requests a second each, most arrivals found them void).
    ready_changes: int = 0
    # Scheduler.best_case for `best_samples` rows, and what it was made from (its memo)
    best_samples: int = 0
    best_version: int = -1
    best_ready: int = -1
    best_until: float = 0.0
    best_s: float = 0.0
    # The clockwork policy's index entries for it, as its last full indexing left them: an arrival
    # no more urgent than (`indexed_rank`, `indexed_deadline`) with as many samples finds them at
    # least as urgent as it while they are live and what they were made from stands
    # (policies/clockwork.py `on_queued`)
    indexed: list[Due] = field(default_factory=list)
    indexed_rank: int = 0
    indexed_deadline: float = 0.0
    indexed_samples: int = 0
    indexed_version: int = -1
    indexed_ready: int = -1
    indexed_until: float = 0.0
    prefix: str = ""  # a plan of stages: its leading stage's identity (shared with other models), else ""
    max_queued: int = 0  # the most requests it may hold queued, on time and in its lane (classes.max_queue)
    # Of `spec`, read on every request's path: copied here, where compiled code reads a field
    # directly, from a ModelSpec (interpreted) where each read is a generic attribute lookup
    # (~200 instructions) and `batch_size_for` an interpreted call (~900).
    key: str = field(init=False, default="")
    protected: bool = field(init=False, default=False)  # it has a parity model (ParM)
    max_batch_size: int = field(init=False, default=0)
    _size_for: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        spec = self.spec
        self.key = spec.key
        self.protected = spec.parity is not None
        self.max_batch_size = spec.max_batch_size
        self._size_for = tuple(spec.batch_size_for(n) for n in range(1, spec.max_batch_size + 1))

    def batch_size_for(self, samples: int) -> int:
        """`spec.batch_size_for`, compiled."""
        if 0 < samples <= self.max_batch_size:
            return self._size_for[samples - 1]
        return self.spec.batch_size_for(samples)  # (its answer for 0, its error above the maximum)

    def blocks_on(self, kind: str) -> Blocks:
        """Its blocks as a device of `kind` holds them (by content, or by shared stage)."""
        return self.stage_blocks if kind in EXTENT_KINDS else self.blocks

    def backlog_ended(self) -> None:
        """Its queue ran dry: what was measured while it kept its devices saturated no longer holds."""
        self.backlog_since, self.backlog_ran, self.backlog_devices, self.drain_busy = 0.0, 0.0, 0, 0.0
