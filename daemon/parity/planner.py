"""ParM's workflow in the controller: coding groups, parity batches, replicas, reconstructions.

The scheduler tells it what happened to the INFERs of models with parity (issued, answered,
lost) and asks it what is due; it decides from the read-only view and yields steps
(`decisions.py`) the scheduler applies, like a policy: parity batches and replicas (`Infer`),
a parity model's LOAD (and the UNLOADs that make room), answers rebuilt from parity outputs
(`Save`), and members whose reconstruction cannot come (`Release`). The groups themselves are
the state machine in `groups.py`.
"""

from __future__ import annotations

from collections import defaultdict

from daemon.actions import Action, Result, ResultStatus
from daemon.controller.decisions import Infer, Load, Save, Steps, Unload
from daemon.controller.memory import CallableRules
from daemon.controller.state import LATEST_GRACE, DeviceState
from daemon.controller.view import ControllerView
from daemon.model import ModelSpec
from daemon.parity.groups import DECODE_MARGIN, ActionRole, Coding, Group, MemberState
from daemon.parity.spec import parity_key
from daemon.request import InferenceRequest, RequestStatus


class ParityPlanner:
    def __init__(self, counters: defaultdict[str, int]) -> None:
        self.coding = Coding()
        self.counters = counters  # the scheduler's: one set of event counts

    # ---------------------------------------------------------------- what the scheduler asks

    def role(self, action: Action) -> ActionRole:
        return self.coding.role_of(action)

    def next_time(self) -> float | None:
        return self.coding.next_time() if self.coding.groups else None

    def reset(self) -> None:
        """Every member's requests were answered (an abort): no group is left to finish."""
        self.coding = Coding()

    def statistics(self) -> dict[str, int]:
        return self.coding.statistics()

    # ---------------------------------------------------------------- steps

    def due(self, view: ControllerView, now: float) -> Steps:
        """Timers that came due: decodes and releases, replicas for stragglers and partial groups."""
        flush, items, stragglers = self.coding.due(now)
        yield from items
        for m in stragglers:
            yield from self._replicate(view, m.action, now)
        for g in flush:
            self.counters["groups_flushed"] += 1
            for m in g.members:
                if m.state == MemberState.RUNNING and not m.replicated:
                    m.replicated = True
                    yield from self._replicate(view, m.action, now)
            self.coding.flushed(g)

    def issued(self, view: ControllerView, action: Action, now: float) -> Steps:
        """A data batch of a model with parity was issued: it joins a group; a full group gets its
        parity batch."""
        spec = action.model
        if spec.parity is None or parity_key(spec) not in view.models:
            return
        ready = view.ready_on.get(spec.key, ())
        # what the batch takes on the best device holding the model: a member on a device known
        # to be slow is a straggler all the same
        normal = min((view.estimate(spec.key, action.samples, view.devices[d]) for d in ready),
                     default=action.expected_duration)
        group = self.coding.add(action, now, len(ready), min(normal, action.expected_duration))
        if group is not None:
            self.counters["coding_groups"] += 1
            yield from self._issue_parity(view, group, now)

    def parity_result(self, action: Action, result: Result, now: float) -> Steps:
        self.counters["parities_run" if result.ok else "parities_lost"] += 1
        if self.coding.role_of(action) == ActionRole.PARITY:
            yield from self.coding.parity_done(action, result.outputs if result.ok else None, now)

    def replica_result(self, action: Action, result: Result) -> Steps:
        self.coding.replica_done(action)
        if result.ok:  # (a replica that failed changes nothing: the original is still running)
            assert result.outputs is not None
            yield Save(action, result.outputs, counter="replica_answers")

    def member_answered(self, action: Action, outputs: tuple, now: float) -> Steps:
        yield from self.coding.member_done(action, outputs, now)

    def member_lost(self, view: ControllerView, action: Action, result: Result, now: float) -> Steps:
        """A member failed or was refused. Its requests are held for a reconstruction (until the
        last moment a retry could still make it, or, past that, until their deadline is at hand):
        returns True then; False when the scheduler should retry or fail them as usual."""
        live = [r for r in action.requests if r.status == RequestStatus.RUNNING]
        if live and result.status != ResultStatus.CANCELLED:
            deadline = min(r.deadline for r in live)
            retry_by = deadline - max(view.best_case(r) for r in live)
            held, saves = self.coding.member_lost(action, now, retry_by if retry_by > now else
                                                  deadline - DECODE_MARGIN)
            yield from saves
            if held:
                return True
        # nothing to hold for: the group must not wait on this member
        yield from self.coding.member_done(action, None, now)
        return False

    # ---------------------------------------------------------------- parity batches and replicas

    def _issue_parity(self, view: ControllerView, group: Group, now: float) -> Steps:
        """The group's parity batch, on a device other than its members' whenever there is one."""
        pspec = view.models[parity_key(group.spec)].spec
        pkey = pspec.key
        member_devs = {m.action.device for m in group.members}
        ready = [d for d in view.devices.values() if d.memory.is_ready(pkey)]
        others = [d for d in ready if d.name not in member_devs]
        if not others:
            yield from self._load_parity(view, pspec, member_devs, now)  # for the groups to come
        if not ready:
            self.coding.set_parity(group, None)
            self.counters["parity_unavailable"] += 1
            return
        dev = min(others or ready, key=lambda d: (d.infer_inflight, d.name))
        live = [r for m in group.members for r in m.action.requests if r.status == RequestStatus.RUNNING]
        if not live:
            self.coding.set_parity(group, None)
            return
        rows = max(m.action.samples for m in group.members)
        est = view.estimate(pkey, rows, dev)
        latest = max(min(r.deadline for r in live) - est - DECODE_MARGIN, now + LATEST_GRACE)
        coded: list[list[InferenceRequest]] = [m.action.requests for m in group.members]
        action = yield Infer(pspec, dev.name, [], group.batch_size, latest, est, coded=coded,
                             encoder=group.spec.parity.encoder if group.spec.parity else "sum")
        self.coding.set_parity(group, action)
        self.counters["parities_issued"] += 1

    def _load_parity(self, view: ControllerView, pspec: ModelSpec, avoid: set[str], now: float) -> Steps:
        """Start loading a parity model on a device other than `avoid` where one has room, unless it
        is on (or loading onto) such a device already."""
        if set(view.placed_on.get(pspec.key, ())) - avoid:
            return
        entry = view.models[pspec.key]

        def wanted(k: str) -> bool:
            e = view.models.get(k)
            return e is not None and e.queue.requests > 0

        for dev in sorted(view.devices.values(), key=lambda d: (d.name in avoid, -d.memory.free)):
            if dev.memory.state(pspec.key) is not None or not dev.can_load(pspec.key, now):
                continue
            def idle(k: str, d: DeviceState = dev) -> bool:
                return d.busy[k] == 0
            victims = dev.memory.victims(dev.memory.missing(entry.weight_bytes, entry.blocks),
                                         CallableRules(idle, wanted), keep=dev.memory.present(entry.blocks))
            if victims is None:
                continue
            for k in victims:
                yield Unload(view.models[k].spec, dev.name)
            yield Load(pspec, dev.name)
            return

    def _replicate(self, view: ControllerView, action: Action, now: float) -> Steps:
        """The same batch with the deployed model on another device holding it; its answer counts as
        a reconstruction (first answer wins)."""
        live = [r for r in action.requests if r.status == RequestStatus.RUNNING]
        if not live:
            return
        key = action.key
        others = [d for d in view.devices.values() if d.name != action.device and d.memory.is_ready(key)]
        if not others:
            self.counters["partial_unprotected"] += 1
            return
        dev = min(others, key=lambda d: (not d.healthy_for(key, now), d.infer_inflight, d.name))
        est = view.estimate(key, action.samples, dev)
        latest = max(min(r.deadline for r in live) - est, now + LATEST_GRACE)
        replica = yield Infer(action.model, dev.name, action.requests, action.batch_size, latest, est,
                              replica_of=action.id)
        assert replica is not None
        self.coding.add_replica(replica, action)
        self.counters["replicas"] += 1
