"""Coding groups: ParM's parity batches, as controller state. Pure code, driven by `now` (the
decode itself is codes.py's).

For a model with parity, k INFER batches of one batch size, issued one after another on
different devices where the model has several, form a group.
When the k-th is issued the scheduler issues the group's parity batch (the members' inputs,
encoded by the executor off the event loop) on the parity model, on another device when there
is one. A member is **reconstructed** - its requests answered with
`parity output - the other k-1 outputs`, flagged - when the other k outputs are in and it

- failed or was refused (its requests are held for the reconstruction instead of being retried
  or failed, until the last moment a retry could still make it), or
- is a straggler: it has run, from its predicted start, longer than the batch takes on the
  fastest device holding the model by more than a slack (so a member on a device known to be
  slow counts too), or its predicted end is past its deadline, or its deadline is at hand
  (`DECODE_MARGIN` before it). With Clockwork's predictions a straggler is known as soon as it
  overruns; ParM, which has none, reconstructs whenever the other k outputs are in.

Whatever arrives first wins: a reconstruction is ignored once the original answered, and the
original once the reconstruction did.

A group that has not filled within the model's `flush_ms` is flushed: a parity model trained on
sums of k inputs would be out of its depth on fewer, so each of its members still running is
protected by a **replica** instead: the same batch with the deployed model on another device,
whose answer counts as a reconstruction. A straggler that cannot be rebuilt when it becomes
one (its group not full yet, its parity lost or not back, another member missing) gets its
replica at once, without waiting for the flush. (At low load, when groups fill slowly, devices
have room for replicas.) Groups leave no state behind: one is dropped as soon as all its
members' requests are answered, and timers of dropped groups are ignored.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final

import numpy as np

from daemon.actions import Action
from daemon.controller.decisions import Release, Save
from daemon.model import ModelSpec
from daemon.parity.codes import decode_member
from daemon.request import RequestStatus

DECODE_MARGIN: Final = 0.0005  # reconstruct this long before a deadline if the original is not back
MAX_OPEN_GROUPS: Final = 16  # per model and batch size: bounds the state one busy device can leave
STRAGGLER_SLACK: Final = 0.001  # a member this much (and 50% of a normal run) past a normal run is a straggler


class ActionRole(IntEnum):
    """What an INFER is to ParM."""

    NONE = 0  # an ordinary batch (of a model without parity, or not in a group)
    MEMBER = 1  # a data batch in a coding group
    PARITY = 2  # a group's parity batch
    REPLICA = 3  # a copy of a member on another device (first answer wins)


class MemberState(IntEnum):
    RUNNING = 0  # in flight
    DONE = 1  # its result came back and answered it
    LOST = 2  # failed or refused: its requests wait for a reconstruction
    SAVED = 3  # answered with a reconstruction


@dataclass(slots=True, eq=False)
class Member:
    action: Action
    normal: float  # seconds the batch takes on the fastest device holding the model
    state: MemberState = MemberState.RUNNING
    outputs: tuple[np.ndarray, ...] | None = None
    replicated: bool = False  # a replica was issued for it

    # (written out: mypyc compiles it, not a generated one; one per coded batch)
    def __init__(self, action: Action, normal: float, state: MemberState = MemberState.RUNNING,
                 outputs: tuple[np.ndarray, ...] | None = None, replicated: bool = False) -> None:
        self.action = action
        self.normal = normal
        self.state = state
        self.outputs = outputs
        self.replicated = replicated

    def straggling_at(self) -> float:
        """When it becomes a straggler: a normal run, and a slack, past its planned start."""
        return self.action.expected_start + self.normal + max(STRAGGLER_SLACK, 0.5 * self.normal)

    def live(self) -> bool:
        return any(r.status == RequestStatus.RUNNING for r in self.action.requests)

    @property
    def deadline(self) -> float:
        return min((r.deadline for r in self.action.requests if r.status == RequestStatus.RUNNING), default=0.0)


@dataclass(slots=True, eq=False)
class Group:
    id: int
    spec: ModelSpec  # the deployed model
    batch_size: int
    k: int
    opened_at: float
    members: list[Member] = field(default_factory=list)
    parity: Action | None = None
    parity_out: tuple[np.ndarray, ...] | None = None
    parity_dead: bool = False  # failed, refused, or never issued
    flushed: bool = False

    @property
    def full(self) -> bool:
        return len(self.members) >= self.k

    def others_in(self, m: Member) -> bool:
        return all(o.outputs is not None for o in self.members if o is not m)


class Timer(IntEnum):
    FLUSH = 1
    DECODE = 2  # decode a running member if its original is not back (deadline at hand)
    GIVE_UP = 3  # release a lost member if no reconstruction came
    STRAGGLE = 4  # a member straggles and cannot be rebuilt now: replicate it


class Coding:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.open: dict[tuple[str, int], list[Group]] = {}  # groups still taking members, oldest first
        self.groups: dict[int, Group] = {}
        self.role: dict[int, tuple[Group, Member | None]] = {}  # action id -> (group, member | None: parity)
        self.replicas: dict[int, Action] = {}  # replica action id -> the member action it protects
        self._timers: list[tuple[float, int, Timer, int, int]] = []  # (t, seq, kind, group id, action id)
        self._seq = itertools.count()

    # ---------------------------------------------------------------- forming groups

    def add(self, action: Action, now: float, spread: int = 1, normal: float | None = None) -> Group | None:
        """Add a data batch of a model with parity, which is ready on `spread` devices and would
        take `normal` seconds on the fastest of them (default: its expected duration); returns its
        group when the group is full.

        A batch joins the oldest open group with no member on its device: one device that hangs
        or slows must cost a group one member, which its parity can rebuild, not two, which it
        cannot. A batch that finds none opens a new group (which a replica protects if it does not
        fill in time); on a single device, or past `MAX_OPEN_GROUPS`, it joins the oldest."""
        spec = action.model
        assert spec.parity is not None
        key = (spec.key, action.batch_size)
        waiting = self.open.setdefault(key, [])
        g = next((o for o in waiting if all(m.action.device != action.device for m in o.members)), None)
        if g is None and len(waiting) >= (1 if spread < 2 else MAX_OPEN_GROUPS):
            g = waiting[0]
        if g is None:
            g = Group(next(self._ids), spec, action.batch_size, spec.parity.k, now)
            waiting.append(g)
            self.groups[g.id] = g
            self._timer(now + spec.parity.flush_ms / 1000.0, Timer.FLUSH, g.id, 0)
        m = Member(action, action.expected_duration if normal is None else normal)
        g.members.append(m)
        self.role[action.id] = (g, m)
        # its planned start is not known yet (the policy sets it next): checked again when due
        self._timer(now + m.normal + max(STRAGGLER_SLACK, 0.5 * m.normal), Timer.STRAGGLE, g.id, action.id)
        if g.full:
            self._close(g)
            return g
        return None

    def _close(self, g: Group) -> None:
        """No more members for `g`."""
        key = (g.spec.key, g.batch_size)
        waiting = self.open.get(key)
        if waiting is not None and g in waiting:
            waiting.remove(g)
            if not waiting:
                del self.open[key]

    def set_parity(self, g: Group, parity: Action | None) -> None:
        g.parity = parity
        if parity is None:
            g.parity_dead = True
            self._maybe_drop(g)
        else:
            self.role[parity.id] = (g, None)

    def add_replica(self, replica: Action, member: Action) -> None:
        self.replicas[replica.id] = member

    # ---------------------------------------------------------------- results

    def role_of(self, action: Action) -> ActionRole:
        if action.id in self.replicas:
            return ActionRole.REPLICA
        entry = self.role.get(action.id)
        if entry is None:
            return ActionRole.NONE
        return ActionRole.MEMBER if entry[1] is not None else ActionRole.PARITY

    def member_done(self, action: Action, outputs: tuple[np.ndarray, ...] | None, now: float) -> list[Save]:
        """A member's own result: OK (outputs) answered its requests; None: it failed or was refused
        with nothing left to hold for it. Others may now be saved."""
        entry = self.role.get(action.id)
        if entry is None:
            return []
        g, m = entry
        assert m is not None
        if m.state == MemberState.RUNNING:
            m.state = MemberState.DONE
        m.outputs = outputs
        saves = self._try(g, now)
        self._maybe_drop(g)
        return saves

    def member_lost(self, action: Action, now: float, latest_retry: float) -> tuple[bool, list[Save]]:
        """A member failed or was refused. (held, saves): held means its requests wait for a
        reconstruction (until `latest_retry`, when they are released to be retried or failed)."""
        entry = self.role.get(action.id)
        if entry is None:
            return False, []
        g, m = entry
        assert m is not None
        if m.state != MemberState.RUNNING:
            return False, []
        if not g.full or g.parity_dead or any(o.state == MemberState.LOST for o in g.members if o is not m):
            # no parity coming (a partial group may never fill), or one parity can rebuild one member at
            # most: the scheduler retries its requests instead
            return False, []
        m.state = MemberState.LOST
        saves = self._try(g, now)
        if m.state == MemberState.LOST:
            self._timer(latest_retry, Timer.GIVE_UP, g.id, action.id)
        self._maybe_drop(g)
        return True, saves

    def parity_done(self, action: Action, outputs: tuple[np.ndarray, ...] | None, now: float) -> list[Save | Release]:
        entry = self.role.pop(action.id, None)
        if entry is None:
            return []
        g = entry[0]
        out: list[Save | Release] = []
        if outputs is None:
            g.parity_dead = True
            out += [Release(m.action) for m in g.members if m.state == MemberState.LOST]
            for m in g.members:
                if m.state == MemberState.LOST:
                    m.state = MemberState.DONE
        else:
            g.parity_out = outputs
            out += self._try(g, now)
        self._maybe_drop(g)
        return out

    # ---------------------------------------------------------------- decoding

    def _try(self, g: Group, now: float) -> list[Save]:
        """Save what can be saved now; arm a decode timer for running members that may be late."""
        if g.parity_out is None or not g.full:
            return []
        saves = []
        for m in g.members:
            if m.state not in (MemberState.LOST, MemberState.RUNNING) or not g.others_in(m) or not m.live():
                continue
            a = m.action
            predicted_end = a.expected_start + a.expected_duration
            decide_at = min(m.straggling_at(), m.deadline - DECODE_MARGIN)
            if m.state == MemberState.LOST or predicted_end > m.deadline - DECODE_MARGIN or now >= decide_at:
                saves.append(self._save(g, m))
            else:
                self._timer(decide_at, Timer.DECODE, g.id, a.id)
        return saves

    def _save(self, g: Group, m: Member) -> Save:
        assert g.parity_out is not None
        others = [o.outputs for o in g.members if o is not m and o.outputs is not None]
        outs, seconds = decode_member(g.parity_out, others, m.action.samples)
        m.state = MemberState.SAVED
        m.outputs = outs
        return Save(m.action, outs, seconds)

    # ---------------------------------------------------------------- timers

    def _timer(self, t: float, kind: Timer, gid: int, aid: int) -> None:
        heapq.heappush(self._timers, (t, next(self._seq), kind, gid, aid))

    def next_time(self) -> float | None:
        while self._timers and self._stale(self._timers[0]):
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def _stale(self, timer: tuple[float, int, Timer, int, int]) -> bool:
        g = self.groups.get(timer[3])
        return g is None or (timer[2] == Timer.FLUSH and (g.full or g.flushed))

    def due(self, now: float) -> tuple[list[Group], list[Save | Release], list[Member]]:
        """Timers that came due: groups to flush, members to save or release, and stragglers that
        cannot be rebuilt now (group not full, parity lost or not back, another member missing),
        to protect with a replica."""
        flush: list[Group] = []
        out: list[Save | Release] = []
        hedge: list[Member] = []
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, gid, aid = heapq.heappop(self._timers)
            g = self.groups.get(gid)
            if g is None:
                continue
            if kind == Timer.FLUSH:
                if not g.full and not g.flushed:
                    g.flushed = True
                    self._close(g)
                    flush.append(g)
                continue
            m = next((x for x in g.members if x.action.id == aid), None)
            if m is None:
                continue
            if kind == Timer.DECODE and m.state == MemberState.RUNNING and m.live() and g.parity_out is not None \
                    and g.others_in(m):
                out.append(self._save(g, m))
            elif kind == Timer.GIVE_UP and m.state == MemberState.LOST:
                m.state = MemberState.DONE
                out.append(Release(m.action))
            elif kind == Timer.STRAGGLE and m.state == MemberState.RUNNING and m.live() and not m.replicated \
                    and (not g.full or g.parity_dead or g.parity_out is None or not g.others_in(m)):
                at = m.straggling_at()
                if at > now:
                    self._timer(at, Timer.STRAGGLE, gid, aid)  # it started later than planned then
                else:
                    m.replicated = True
                    hedge.append(m)
            self._maybe_drop(g)
        return flush, out, hedge

    # ---------------------------------------------------------------- cleanup

    def _maybe_drop(self, g: Group) -> None:
        """Forget a group once none of its members waits on it (running, or lost and held).
        A saved or released member's requests are answered or handed back by the scheduler."""
        if (g.full or g.flushed) and not any(
                m.state in (MemberState.RUNNING, MemberState.LOST) and m.live() for m in g.members):
            self.drop(g)

    def drop(self, g: Group) -> None:
        self.groups.pop(g.id, None)
        self._close(g)
        for m in g.members:
            self.role.pop(m.action.id, None)
        if g.parity is not None:
            self.role.pop(g.parity.id, None)

    def replica_done(self, action: Action) -> None:
        self.replicas.pop(action.id, None)

    def flushed(self, g: Group) -> None:
        """A flushed group gets no parity; forget it once its members are answered."""
        g.parity_dead = True
        self._maybe_drop(g)

    def statistics(self) -> dict[str, int]:
        return {"open_groups": sum(len(w) for w in self.open.values()), "live_groups": len(self.groups),
                "tracked_actions": len(self.role),
                "replicas_in_flight": len(self.replicas), "timers": len(self._timers)}

