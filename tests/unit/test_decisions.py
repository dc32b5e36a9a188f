"""Policies decide through steps: each is applied before the next is asked for, and nothing else
changes the state a policy reads."""

from __future__ import annotations

from daemon.actions import ActionKind, Result
from daemon.controller.decisions import Drop, Infer, Load, Planned, Steps
from daemon.controller.policy import Policy
from daemon.controller.state import ModelEntry
from daemon.controller.view import ControllerView
from daemon.errors import DeadlineExceeded, Unavailable
from daemon.request import InferenceRequest, RequestStatus
from tests.unit.harness import MS, Harness, make_spec


class Scripted(Policy):
    """A policy that loads its one model, then runs every queued request alone, and records what
    the view showed it after each step."""

    name = "scripted"

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def next_wakeup(self, view: ControllerView, now: float) -> float | None:
        return None

    def on_submit(self, view: ControllerView, entry: ModelEntry, req: InferenceRequest, now: float) -> None:
        pass

    def on_queued(self, view: ControllerView, entry: ModelEntry, now: float) -> None:
        pass

    def on_result(self, view: ControllerView, result: Result, now: float) -> None:
        pass

    def schedule(self, view: ControllerView, now: float) -> Steps:
        for entry in view.active():
            key = entry.spec.key
            if not view.placed_on.get(key):
                action = yield Load(entry.spec, "cpu:0", expected=2 * MS)
                self.seen.append(("placed", set(view.placed_on.get(key, ()))))
                self.seen.append(("load", action))
                continue
            if not view.ready_on.get(key):
                continue
            while (head := entry.queue.head()) is not None:
                if head.deadline - now < 2 * MS:  # (too close for this policy)
                    yield Drop(head)
                    continue
                action = yield Infer(entry.spec, "cpu:0", [head], 1, head.deadline, 1 * MS)
                self.seen.append(("queued after infer", entry.queue.requests))
                self.seen.append(("infer", action))


def test_each_step_is_applied_before_the_next_and_the_issued_action_comes_back() -> None:
    policy = Scripted()
    h = Harness(policy=policy)
    spec = h.add(make_spec())
    a = h.request(spec, timeout=0.5)
    b = h.request(spec, timeout=0.5)
    (load,) = h.step()
    assert policy.seen[0] == ("placed", {"cpu:0"})  # the LOAD was applied when the policy resumed
    assert policy.seen[1] == ("load", load) and load.kind == ActionKind.LOAD
    assert load.expected_duration == 2 * MS  # the policy's estimate of the copy, not the default
    assert h.sched.devices["cpu:0"].timeline.copy.free_at(h.now) > h.now  # on the copy lane
    infers = h.result(load)
    assert [x.requests for x in infers] == [[a], [b]]
    assert ("queued after infer", 1) in policy.seen and ("queued after infer", 0) in policy.seen
    assert a.status == b.status == RequestStatus.RUNNING
    lane = h.sched.devices["cpu:0"].timeline.exec
    assert set(lane.outstanding) == {x.id for x in infers}  # every INFER is on the device's lane
    h.result(infers[0])
    assert a.ok and infers[0].id not in lane.outstanding


def test_a_drop_answers_the_request_with_a_deadline_error_and_takes_it_out_of_its_queue() -> None:
    policy = Scripted()
    h = Harness(policy=policy)
    spec = h.add(make_spec())
    h.preload(spec, 1)
    late = h.request(spec, timeout=1.5 * MS)  # admitted (it takes 1 ms), too close for the policy
    h.step()
    assert late.status == RequestStatus.FAILED and isinstance(late.error, DeadlineExceeded)
    assert h.sched.models[spec.key].queue.requests == 0 and h.sched.pending == 0
    assert late in h.finished


def test_a_drop_may_carry_its_own_error() -> None:
    class Refuse(Scripted):
        def schedule(self, view: ControllerView, now: float) -> Steps:
            for entry in view.active():
                for r in list(entry.queue):
                    yield Drop(r, Unavailable("no device can hold it"))

    h = Harness(policy=Refuse())
    spec = h.add(make_spec())
    r = h.request(spec, timeout=0.5)
    h.step()
    assert isinstance(r.error, Unavailable) and str(r.error) == "no device can hold it"


def test_a_planned_list_is_applied_in_order_each_before_the_next() -> None:
    class Listed(Scripted):
        """Runs every queued request alone, decided all at once and returned as a list."""

        def schedule(self, view: ControllerView, now: float) -> Planned:  # type: ignore[override]
            out: Planned = []
            for entry in view.active():
                if view.ready_on.get(entry.key):
                    out.extend(Infer(entry.spec, "cpu:0", [r], 1, r.deadline, 1 * MS) for r in entry.queue)
            return out

    h = Harness(policy=Listed())
    spec = h.add(make_spec())
    h.preload(spec, 1)
    a = h.request(spec, timeout=0.5)
    b = h.request(spec, timeout=0.5)
    infers = h.step()
    assert [x.requests for x in infers] == [[a], [b]]  # in the list's order
    assert a.status == b.status == RequestStatus.RUNNING
    assert h.sched.models[spec.key].queue.requests == 0
    lane = h.sched.devices["cpu:0"].timeline.exec
    assert set(lane.outstanding) == {x.id for x in infers}
    h.result(infers[0])
    h.result(infers[1])
    assert a.ok and b.ok
