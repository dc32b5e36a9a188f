"""Applications on the event loop: a query goes to the members its policy picks, the answer comes
back with a query id, and feedback for that id teaches the policy (docs/applications.md).

One query:

1. The members are resolved (each name's newest ready version) and checked to fit together.
2. The deadline: the client's timeout, else the application's `slo_ms` (else its members'
   smallest SLO). The controller is asked, read-only, when each member would finish if submitted
   now (ControllerService.expected_finish); members that cannot make the deadline are left out
   at once: neither run nor waited for (beyond Clipper, which waits for them and drops late
   answers).
3. exp3 picks one of the others; exp4 runs them all. Each member's request carries the remaining
   time as a hard deadline, so the controller drops rather than runs what is hopeless.
4. At the deadline, what is back is the answer: exp4 combines the members that answered
   (flagged `partial` when some did not); the requests still out are cancelled. If no member
   answered, the application's `default_output` is the answer (flagged `default`), or, without
   one, the member's error (504 for a missed deadline).

Policy state lives in memory and in the application database (daemon/apps/appdb.py); feedback is
acknowledged once its update is committed, and a restarted daemon reads it back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from daemon.apps.appdb import AppDB
from daemon.apps.application import (
    AppDefinition,
    AppQueries,
    AppQuery,
    check_labels,
    check_members,
    check_reward,
    default_answer,
    output_index,
    plan,
    unavailable,
)
from daemon.apps.selection import Exp3, Exp4, PolicyState, combine, label_reward
from daemon.clock import Clock, MonotonicClock
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest, DeadlineExceeded, EscapementError, InternalError, NotFound
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest

log = logging.getLogger("escapement.apps")
FP32 = BY_NAME["FP32"]

def default_app_db_path() -> str:
    """Where policy state goes when `apps.db_path` is empty: systemd's state directory
    ($STATE_DIRECTORY), else state/ under the working directory."""
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return str(Path(state) / "applications.sqlite3") if state else "state/applications.sqlite3"


Forecast = Callable[[ModelSpec, int], float]  # (member, samples) -> expected finish (clock time)


class Members(Protocol):
    """What the router needs of the gateway (daemon/gateway.py)."""

    def resolve_member(self, name: str) -> ModelSpec: ...

    def new_request(self, spec: ModelSpec, arrays: tuple[np.ndarray, ...], samples: int, timeout_us: int | None,
                    priority: int | None, client_id: str) -> InferenceRequest: ...

    def submit(self, req: InferenceRequest) -> None: ...

    def cancel(self, req: InferenceRequest) -> None: ...


@dataclass(slots=True)
class AppCounters:
    queries: int = 0
    answered_by: dict[str, int] = field(default_factory=dict)  # member -> queries it answered (or helped)
    defaults: int = 0  # answered with the default output
    partial: int = 0  # exp4: answered with some members missing
    skipped: int = 0  # members left out for a deadline they could not make
    late: int = 0  # members run that were not back by the deadline (or refused, or failed)
    failed: int = 0  # queries answered with an error
    feedback: int = 0


@dataclass(slots=True)
class Deployed:
    """A served application: its definition, policy and counters."""

    definition: AppDefinition
    state: PolicyState
    rng: random.Random
    source: str  # "config", "repository" or "api"
    counters: AppCounters = field(default_factory=AppCounters)

    def exp3(self) -> Exp3:
        d = self.definition
        return Exp3(self.state, d.exploration, d.share)

    def exp4(self) -> Exp4:
        d = self.definition
        return Exp4(self.state, d.learning_rate, d.share)


@dataclass(slots=True)
class AppAnswer:
    """What a frontend renders: the output and how it was made."""

    app: str
    output: np.ndarray
    output_spec: TensorSpec
    models: list[str]  # the members that answered (model names)
    versions: list[int]
    skipped: list[str]  # left out: expected past the deadline
    late: list[str]  # run, but not back in time (or refused, or failed)
    default: bool
    partial: bool
    query_id: str  # "" for a default answer (there is nothing to learn from it)

    def parameters(self) -> dict[str, Any]:
        p: dict[str, Any] = {"models": self.models}
        if self.query_id:
            p["query_id"] = self.query_id
        if self.skipped:
            p["skipped"] = self.skipped
        if self.late:
            p["late"] = self.late
        if self.default:
            p["default"] = True
        if self.partial:
            p["partial"] = True
        return p


class Applications:
    def __init__(self, db: AppDB, *, max_queries: int, max_query_bytes: int, query_ttl_s: float,
                 clock: Clock | None = None, wall: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock or MonotonicClock()
        self.wall = wall
        self.queries = AppQueries(max_queries, max_query_bytes, query_ttl_s, self.clock)
        self.apps: dict[str, Deployed] = {}
        self.members: Members | None = None  # the gateway, set when it is built
        self.forecast: Forecast | None = None  # the controller's, when there is one

    def close(self) -> None:
        """Commit what is queued and close the database (blocking: call it in a thread)."""
        self.db.close()

    def _gateway(self) -> Members:
        assert self.members is not None, "Applications used before the gateway attached itself"
        return self.members

    # ---------------------------------------------------------------- definitions

    async def define(self, d: AppDefinition, source: str, *, strict: bool) -> dict[str, Any]:
        """Serve an application (replacing one of the same name); its learned state is read back from
        the database. `strict`: its members must be served and fit now (BadRequest, NotFound);
        otherwise (start-up) a misfit is logged and the application answers 503 saying why."""
        why = self._misfit(d)
        if why and strict:
            raise BadRequest(f"application {d.name}: {why}")
        if why:
            log.warning("application %s: %s; it answers 503 until that is fixed", d.name, why)
        stored = None
        # The file is created by the first feedback: a daemon that learns nothing creates none.
        if self.db.started or await asyncio.to_thread(self.db.path.exists):
            if not self.db.started:
                self.db.start(wait=False)
            try:
                stored = await asyncio.wrap_future(self.db.get(d.name, d.digest))
            except Exception as e:
                raise InternalError(f"application {d.name}: reading its policy state failed: {e}") from None
        state = stored if stored is not None and len(stored.weights) == len(d.models) else PolicyState.fresh(
            len(d.models))
        self.apps[d.name] = Deployed(d, state, random.Random(d.seed), source)
        log.info("application %s: %s over %s (%s, %d feedback items learned)", d.name, d.policy,
                 ", ".join(d.models), source, state.updates)
        return self.status(d.name)

    def remove(self, name: str) -> dict[str, Any]:
        if self.apps.pop(name, None) is None:
            raise NotFound(f"unknown application {name!r:.80}; applications: {sorted(self.apps)}")
        return {"name": name, "state": "UNLOADED"}

    def _misfit(self, d: AppDefinition) -> str:
        gw = self._gateway()
        specs: list[ModelSpec] = []
        for m in d.models:
            try:
                specs.append(gw.resolve_member(m))
            except EscapementError as e:
                return f"model {m}: {e.message}"
        return check_members(d, specs)

    def deployed(self, name: str) -> Deployed:
        dep = self.apps.get(name)
        if dep is None:
            raise NotFound(f"unknown application {name!r:.80}; applications: {sorted(self.apps)}")
        return dep

    def resolve(self, name: str) -> list[ModelSpec]:
        """The application's members now (each name's newest ready version), checked to fit together;
        frontends decode a query's inputs against the first. NotFound, Unavailable."""
        dep = self.deployed(name)
        gw = self._gateway()
        specs: list[ModelSpec] = []
        for m in dep.definition.models:
            try:
                specs.append(gw.resolve_member(m))
            except EscapementError as e:
                raise unavailable(name, f"its model {m}: {e.message}") from None
        why = check_members(dep.definition, specs)
        if why:
            raise unavailable(name, why)
        return specs

    # ---------------------------------------------------------------- queries

    async def infer(self, name: str, specs: Sequence[ModelSpec], arrays: tuple[np.ndarray, ...], samples: int,
                    timeout_us: int | None, priority: int | None, client_id: str) -> AppAnswer:
        dep = self.deployed(name)
        d = dep.definition
        # the inputs were checked against the first model; every member must also take this many rows
        for s in specs:
            if samples > s.max_batch_size:
                raise BadRequest(f"application {name}: {samples} samples exceed model {s.name}'s max_batch_size "
                                 f"{s.max_batch_size}: send at most {min(m.max_batch_size for m in specs)} per query")
        c = dep.counters
        c.queries += 1
        now = self.clock.now()
        slo = d.slo_ms / 1000.0 if d.slo_ms else min(s.slo_s for s in specs)
        deadline = now + (timeout_us * 1e-6 if timeout_us is not None else slo)
        forecast = self.forecast if d.skip_late else None
        expected = [forecast(s, samples) for s in specs] if forecast is not None else [now] * len(specs)
        p = plan(expected, deadline)
        prob = 1.0
        if d.policy == "exp3":
            run: tuple[int, ...] = ()
            if p.run:
                chosen, prob = dep.exp3().choose(dep.rng, p.run)
                run = (chosen,)
        else:
            run = p.run
        c.skipped += len(p.skipped)
        oi = [output_index(d, s) for s in specs]
        outs, errors = await self._run_members(specs, oi, run, arrays, samples, deadline, priority, client_id,
                                               hard=d.skip_late)
        out_spec = specs[0].outputs[oi[0]]
        answered = [i for i in run if i in outs]
        late = [specs[i].name for i in run if i not in outs]
        c.late += len(late)
        skipped = [specs[i].name for i in p.skipped]
        if not answered:
            if not d.default_output:
                c.failed += 1
                if errors:
                    raise errors[0]
                why = [f"{', '.join(skipped)} expected later"] if skipped else []
                why += [f"{', '.join(late)} not back in time"] if late else []
                raise DeadlineExceeded(f"application {name}: no model made the deadline "
                                       f"({(deadline - now) * 1e3:.3f} ms): {'; '.join(why)}")
            c.defaults += 1
            return AppAnswer(name, default_answer(d, samples, out_spec), out_spec, [], [], skipped, late, True,
                             False, "")
        member_outs = [outs[i] for i in answered]
        output = member_outs[0] if d.policy == "exp3" else combine(member_outs, dep.exp4().mixture(answered),
                                                                    d.combine)
        if output.dtype != out_spec.datatype.numpy:  # a combination is FP32 whatever its members answer
            out_spec = dataclasses.replace(out_spec, datatype=FP32)
        partial = d.policy == "exp4" and len(answered) < len(specs)
        c.partial += partial
        for i in answered:
            c.answered_by[specs[i].name] = c.answered_by.get(specs[i].name, 0) + 1
        qid = self.queries.add(AppQuery(name, d.digest, tuple(specs[i].name for i in answered), tuple(answered),
                                        member_outs, prob, samples, self.clock.now()))
        return AppAnswer(name, output, out_spec, [specs[i].name for i in answered],
                         [specs[i].version for i in answered], skipped, late, False, partial, qid)

    async def _run_members(self, specs: Sequence[ModelSpec], out_index: Sequence[int], run: Sequence[int],
                           arrays: tuple[np.ndarray, ...], samples: int, deadline: float, priority: int | None,
                           client_id: str, hard: bool = True) -> tuple[dict[int, np.ndarray], list[EscapementError]]:
        """Submit the members' requests and wait for them until the deadline; (the application's output
        of each member back in time, the errors of the others). `hard`: each carries the time left as
        a hard deadline (the controller refuses or drops it when hopeless); else each runs to its
        model's SLO, as Clipper's do, and an answer after the deadline is dropped here."""
        gw = self._gateway()
        loop = asyncio.get_running_loop()
        futs: dict[int, asyncio.Future[InferenceRequest]] = {}
        reqs: dict[int, InferenceRequest] = {}
        errors: list[EscapementError] = []
        for i in run:
            left_us = max(1, int((deadline - self.clock.now()) * 1e6)) if hard else None
            req = gw.new_request(specs[i], arrays, samples, left_us, priority, client_id)
            fut: asyncio.Future[InferenceRequest] = loop.create_future()
            req.on_finish = _resolver(fut)
            try:
                gw.submit(req)  # raises the refusal (deadline, overload) at once
            except EscapementError as e:
                errors.append(e)
                continue
            futs[i], reqs[i] = fut, req
        if futs:
            try:
                await asyncio.wait(futs.values(), timeout=max(0.0, deadline - self.clock.now()))
            except asyncio.CancelledError:  # the client went away: so do its members' requests
                for req in reqs.values():
                    gw.cancel(req)
                raise
        outs: dict[int, np.ndarray] = {}
        for i, fut in futs.items():
            if not fut.done():
                gw.cancel(reqs[i])  # the answer will not be used: free the device time
                continue
            r = fut.result()
            if r.ok and r.outputs is not None:
                # a copy: outputs may view the executor's buffers, reused by later batches, and this
                # one waits for the other members and then for its feedback
                outs[i] = np.array(r.outputs[out_index[i]], copy=True)
            elif r.error is not None:
                errors.append(r.error)
        return outs, errors

    # ---------------------------------------------------------------- feedback

    async def feedback(self, name: str, query_id: Any, label: Any = None, reward: Any = None) -> dict[str, Any]:
        """Learn from a query's true label(s) or reward; answered once the update is committed."""
        dep = self.deployed(name)
        d = dep.definition
        if not isinstance(query_id, str) or not query_id:
            raise BadRequest(f"query_id must be the non-empty string an application's answer gave, got {query_id!r}")
        if (label is None) == (reward is None):
            raise BadRequest('feedback gives exactly one of "label" (the true class) and "reward" (in [0, 1])')
        q = self.queries.get(query_id)
        if q is None or q.app != name:
            raise NotFound(f"unknown or expired query_id {query_id!r:.80} for application {name} (a query takes one "
                           "feedback, and is remembered for a bounded time and number of queries)")
        if q.digest != d.digest:
            raise NotFound(f"query {query_id!r:.80} was answered before application {name} was redefined")
        before = PolicyState(list(dep.state.weights), dep.state.updates)
        if d.policy == "exp3":
            if reward is not None:
                r = check_reward(reward)
            else:
                out = q.outputs[0]
                r = label_reward(out, check_labels(label, q.samples, int(out.shape[-1])))
            rewards = {q.indices[0]: r}
            self.queries.take(query_id)
            dep.exp3().update(q.indices[0], r, q.prob)
        else:
            rewards = self._ensemble_rewards(q, label, reward)
            self.queries.take(query_id)
            dep.exp4().update(rewards)
        dep.counters.feedback += 1
        state = dep.state
        if not self.db.started:
            self.db.start(wait=False)
        try:
            await asyncio.wrap_future(self.db.put(name, d.digest, state, self.wall()))
        except Exception as e:
            dep.state = before  # memory must not run ahead of the database
            raise InternalError(f"application {name}: storing its policy state failed: {e}") from None
        return {"application": name, "query_id": query_id,
                "rewards": {d.models[i]: r for i, r in rewards.items()},
                "weights": dict(zip(d.models, state.weights, strict=True)), "updates": state.updates}

    @staticmethod
    def _ensemble_rewards(q: AppQuery, label: Any, reward: Any) -> dict[int, float]:
        if label is not None:
            out = q.outputs[0]
            labels = check_labels(label, q.samples, int(out.shape[-1]))
            return {i: label_reward(o, labels) for i, o in zip(q.indices, q.outputs, strict=True)}
        if not isinstance(reward, dict):
            raise BadRequest("an ensemble (exp4) learns each model's own reward: give the label, or reward as "
                             f"an object {{model: reward}} over the models that answered ({list(q.members)})")
        unknown = set(reward) - set(q.members)
        if unknown or not reward:
            raise BadRequest(f"reward names {sorted(unknown) or 'no model'}: give rewards for the models that "
                             f"answered this query ({list(q.members)})")
        by_name = dict(zip(q.members, q.indices, strict=True))
        return {by_name[m]: check_reward(r, f"reward[{m!r}]") for m, r in reward.items()}

    # ---------------------------------------------------------------- status

    def status(self, name: str) -> dict[str, Any]:
        dep = self.deployed(name)
        d = dep.definition
        c = dep.counters
        body: dict[str, Any] = {**d.as_json(), "source": dep.source,
                                "weights": dict(zip(d.models, dep.state.weights, strict=True)),
                                "updates": dep.state.updates,
                                "counters": {"queries": c.queries, "answered_by": dict(c.answered_by),
                                             "defaults": c.defaults, "partial": c.partial, "skipped": c.skipped,
                                             "late": c.late, "failed": c.failed, "feedback": c.feedback}}
        if d.policy == "exp3":
            body["probabilities"] = dict(zip(d.models, dep.exp3().probabilities(), strict=True))
        try:
            self.resolve(name)
            body["ready"] = True
        except EscapementError as e:
            body["ready"], body["error"] = False, e.message
        return body

    def index(self) -> list[dict[str, Any]]:
        return [{"name": n, "policy": dep.definition.policy, "models": list(dep.definition.models),
                 "source": dep.source} for n, dep in sorted(self.apps.items())]


def _resolver(fut: asyncio.Future[InferenceRequest]) -> Callable[[InferenceRequest], None]:
    def done(r: InferenceRequest) -> None:
        if not fut.done():
            fut.set_result(r)
    return done
