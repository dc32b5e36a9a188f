"""Personalized (split) models, Velox-style: per-user weights on a model's feature output.

A model version with `[personalization]` in its config.toml (daemon/model_config.py) has a feature
output (d values per sample) and a shared head W (d+1, C: the global model's last layer, the
bias as the last row) in its version directory. A request that names a user gets one more
output, `[features, 1] . W_user`, and a `query_id`; feedback for that query (the true label)
updates W_user at once, and the user's next prediction uses it.

- The update is recursive least squares on the query's features, with targets on the logits'
  scale: t = -s everywhere except +s at the label (s = the mean |logit| of the global model on
  its training data, stored with the head). W_user starts as the shared head and P as
  `prior * I`, so a user with little feedback stays close to the global model. Measured on the
  demo (digits, users with permuted labels): held-out accuracy 0.15 -> 0.93 after 200 items;
  SGD on cross-entropy learned far slower. One update (d = 65, C = 10) is ~25-40 us of numpy:
  it runs on the event loop; the database write does not (daemon/apps/userdb.py).
- Queries are remembered (bounded LRU: count, bytes, age) until their feedback arrives; each
  takes one feedback (a second one for the same id is 404, as an unknown id is).
- Users: a bounded LRU in memory (count and bytes); a cold user is dropped from memory, never
  from the database, and read back (through the writer thread, after its pending writes) when
  needed. A user with no stored row predicts with the shared head.
- Keys are (model, version, user): another version has another head, so its users start again.

Runs on the event loop thread only (the gateway), except the database's own thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daemon.apps.answered import AnsweredQueries
from daemon.apps.userdb import StoredUser, UserDB
from daemon.clock import Clock, MonotonicClock
from daemon.errors import BadRequest, EscapementError, InternalError, NotFound
from daemon.model import ModelSpec, PersonalSpec
from daemon.request import InferenceRequest, RequestStatus

log = logging.getLogger("escapement.personal")

USER_OVERHEAD = 256  # bytes a user in memory costs beyond its arrays
QUERY_OVERHEAD = 192  # bytes a remembered query costs beyond its features
MAX_USER_ID_BYTES = 256


def default_db_path() -> str:
    """Where users' weights go when `personalization.db_path` is empty: the state directory systemd
    gives the unit (StateDirectory=, $STATE_DIRECTORY), else state/ under the working directory."""
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return str(Path(state) / "personalization.sqlite3") if state else "state/personalization.sqlite3"


# ---------------------------------------------------------------- recursive least squares


def rls_update(w: np.ndarray, p: np.ndarray, x: np.ndarray, t: np.ndarray, forgetting: float = 1.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """One RLS step: new (W, P) after seeing features `x` (d+1,) with targets `t` (C,).

    Minimizes sum_i lambda^(n-i) |t_i - x_i W|^2 + |W - W0|^2 / prior. New arrays: the old ones may
    still be read (a prediction, a queued database write)."""
    px = p @ x
    k = px / (forgetting + x @ px)
    w_new = w + np.outer(k, t - x @ w)
    p_new = p - np.outer(k, px)
    if forgetting != 1.0:
        p_new /= forgetting
    return w_new, p_new


def targets(label: int, classes: int, scale: float) -> np.ndarray:
    """+s at the label, -s elsewhere: the logits' scale, so a fresh user's answers stay comparable."""
    t = np.full(classes, -scale)
    t[label] = scale
    return t


def with_bias(features: np.ndarray) -> np.ndarray:
    """[features, 1] as float64, (n, d+1)."""
    x = np.empty((features.shape[0], features.shape[1] + 1))
    x[:, :-1] = features
    x[:, -1] = 1.0
    return x


# ---------------------------------------------------------------- users in memory


@dataclass(slots=True)
class UserState:
    weights: np.ndarray  # (d+1, C) float64
    precision: np.ndarray  # (d+1, d+1) float64
    updates: int
    updated_at: float  # Unix time of the last update (0: never)
    head_digest: str  # of the head it grew from: a version reloaded with another head starts again

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.precision.nbytes + USER_OVERHEAD

    @classmethod
    def fresh(cls, p: PersonalSpec) -> UserState:
        return cls(p.head, np.eye(p.dim + 1) * p.config.prior, 0, 0.0, p.head_digest)


UserKey = tuple[str, str]  # (spec.key, user)


class UserCache:
    """Users' RLS states, least recently used first; bounded in count and bytes."""

    def __init__(self, max_users: int, max_bytes: int) -> None:
        self.max_users = max(1, max_users)
        self.max_bytes = max_bytes
        self._users: OrderedDict[UserKey, UserState] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._users)

    def get(self, key: UserKey, digest: str) -> UserState | None:
        st = self._users.get(key)
        if st is None:
            return None
        if st.head_digest != digest:  # its version was reloaded with another head
            self.discard(key)
            return None
        self._users.move_to_end(key)
        return st

    def put(self, key: UserKey, st: UserState) -> None:
        self.discard(key)
        self._users[key] = st
        self.bytes += st.nbytes
        while len(self._users) > 1 and (len(self._users) > self.max_users or self.bytes > self.max_bytes):
            _, old = self._users.popitem(last=False)  # only from memory: the database keeps it
            self.bytes -= old.nbytes
            self.evictions += 1

    def discard(self, key: UserKey) -> None:
        st = self._users.pop(key, None)
        if st is not None:
            self.bytes -= st.nbytes


# ---------------------------------------------------------------- queries awaiting feedback


@dataclass(slots=True)
class Query:
    spec: ModelSpec
    user: str
    x: np.ndarray  # (n, d+1) float64: the features with the bias column
    at: float  # clock time it was answered

    @property
    def nbytes(self) -> int:
        return self.x.nbytes + QUERY_OVERHEAD


class QueryMemory(AnsweredQueries[Query]):
    """Answered queries by id, oldest first; bounded in count, bytes and age."""


# ---------------------------------------------------------------- the loop's side


@dataclass(frozen=True, slots=True)
class PersonalStats:
    predictions: int
    feedback: int
    users_in_memory: int
    user_bytes: int
    user_evictions: int
    queries: int
    query_bytes: int
    query_evictions: int
    db_writes: int
    db_reads: int
    db_failures: int


def check_user(user: Any, what: str = "user") -> str:
    """A user id from the wire: a non-empty string of at most MAX_USER_ID_BYTES bytes."""
    if not isinstance(user, str) or not user:
        raise BadRequest(f"{what} must be a non-empty string, got {user!r}")
    if len(user.encode()) > MAX_USER_ID_BYTES:
        raise BadRequest(f"{what} is longer than {MAX_USER_ID_BYTES} bytes")
    return user


def check_labels(label: Any, samples: int, classes: int) -> list[int]:
    """The labels of a query's samples: an int (a query of one sample) or a list of `samples` ints,
    each in [0, classes)."""
    labels = [label] if not isinstance(label, list) else label
    if len(labels) != samples:
        raise BadRequest(f"label: the query had {samples} samples: give a list of {samples} labels"
                         if samples != 1 else f"label: the query had 1 sample, got {len(labels)} labels")
    for v in labels:
        if isinstance(v, bool) or not isinstance(v, int):
            raise BadRequest(f"label must be an integer class index (or a list of them), got {v!r}")
        if not 0 <= v < classes:
            raise BadRequest(f"label {v} is out of range: the model has {classes} classes (0..{classes - 1})")
    return labels


class Personalizer:
    """Personalized predictions and feedback for every model version with `[personalization]`."""

    def __init__(self, db: UserDB, *, max_users: int, max_user_bytes: int, max_queries: int,
                 max_query_bytes: int, query_ttl_s: float, clock: Clock | None = None,
                 wall: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock or MonotonicClock()
        self.wall = wall
        self.users = UserCache(max_users, max_user_bytes)
        self.queries = QueryMemory(max_queries, max_query_bytes, query_ttl_s, self.clock)
        self._loading: dict[UserKey, asyncio.Future[UserState]] = {}
        self.predictions = 0
        self.feedback_count = 0

    def close(self) -> None:
        """Commit what is queued and close the database (blocking: call it in a thread)."""
        self.db.close()

    def _open(self) -> None:
        # The file is opened on first use: a daemon with no personalized traffic creates none.
        if not self.db.started:
            self.db.start(wait=False)

    def stats(self) -> PersonalStats:
        d = self.db.stats()
        return PersonalStats(self.predictions, self.feedback_count, len(self.users), self.users.bytes,
                             self.users.evictions, len(self.queries), self.queries.bytes, self.queries.evictions,
                             d.writes, d.reads, d.failures)

    # ---------------------------------------------------------------- predictions

    def attach(self, req: InferenceRequest) -> None:
        """Set a request naming a user up so that its answer gets the personalized output and a query
        id. The user's weights are read from the database meanwhile if they are not in memory."""
        spec, user = req.model, req.user
        p = spec.personalization
        assert p is not None and user
        key = (spec.key, user)
        loading = None if self.users.get(key, p.head_digest) is not None else self._load(spec, user)
        answer = req.on_finish

        def finish(r: InferenceRequest) -> None:
            if not r.ok or r.outputs is None:
                if answer is not None:
                    answer(r)
                return
            st = self.users.get(key, p.head_digest)
            if st is not None or loading is None:
                self._personalize(r, st or UserState.fresh(p))
                if answer is not None:
                    answer(r)
                return

            def loaded(f: asyncio.Future[UserState]) -> None:
                if f.cancelled() or f.exception() is not None:
                    e = f.exception() if not f.cancelled() else None
                    _fail(r, e)
                else:
                    self._personalize(r, f.result())
                if answer is not None:
                    answer(r)

            loading.add_done_callback(loaded)

        req.on_finish = finish

    def _personalize(self, r: InferenceRequest, st: UserState) -> None:
        spec = r.model
        p = spec.personalization
        assert p is not None and r.outputs is not None
        x = with_bias(r.outputs[p.features_index])
        y = (x @ st.weights).astype(np.float32)
        r.outputs = (*r.outputs, y)
        r.query_id = self.queries.add(Query(spec, r.user, x, self.clock.now()))
        self.predictions += 1

    def _load(self, spec: ModelSpec, user: str) -> asyncio.Future[UserState]:
        """The user's state, from memory or the database (one read per user at a time)."""
        p = spec.personalization
        assert p is not None
        key = (spec.key, user)
        pending = self._loading.get(key)
        if pending is not None:
            return pending
        self._open()
        fut: asyncio.Future[StoredUser | None] = asyncio.wrap_future(self.db.get(spec.name, spec.version, user))
        out: asyncio.Future[UserState] = asyncio.get_running_loop().create_future()
        self._loading[key] = out

        def done(f: asyncio.Future[StoredUser | None]) -> None:
            self._loading.pop(key, None)
            if f.cancelled() or f.exception() is not None:
                out.set_exception(f.exception() or InternalError("reading the user database was cancelled"))
                return
            st = self.users.get(key, p.head_digest)  # a feedback may have put a newer one meanwhile
            if st is None:
                st = _from_row(spec, p, user, f.result())
                self.users.put(key, st)
            out.set_result(st)

        fut.add_done_callback(done)
        return out

    async def state(self, spec: ModelSpec, user: str) -> UserState:
        p = spec.personalization
        assert p is not None
        st = self.users.get((spec.key, user), p.head_digest)
        if st is not None:
            return st
        try:
            return await self._load(spec, user)
        except Exception as e:
            raise _db_error(e) from None

    # ---------------------------------------------------------------- feedback

    async def feedback(self, spec: ModelSpec, query_id: Any, label: Any) -> dict[str, Any]:
        """Update the query's user with its true label(s); returns once the update is committed.
        `spec` is the model (version) the feedback was sent to: the query must be one of its."""
        p = spec.personalization
        if p is None:
            raise BadRequest(f"model {spec.name} version {spec.version} is not personalized (no [personalization] "
                             "in its config.toml): it takes no feedback")
        if not isinstance(query_id, str) or not query_id:
            raise BadRequest(f"query_id must be the non-empty string a personalized answer gave, got {query_id!r}")
        q = self.queries.get(query_id)
        if q is None or q.spec.name != spec.name:
            raise NotFound(f"unknown or expired query_id {query_id!r:.80} for model {spec.name} (a query takes one "
                           "feedback, and is remembered for a bounded time and number of queries)")
        spec, p = q.spec, q.spec.personalization  # the version that answered it
        assert p is not None
        labels = check_labels(label, q.x.shape[0], p.classes)  # a bad label does not use the query up
        self.queries.take(query_id)
        st = await self.state(spec, q.user)
        t0 = time.perf_counter()
        w, pm = st.weights, st.precision
        for x, label_i in zip(q.x, labels, strict=True):
            w, pm = rls_update(w, pm, x, targets(label_i, p.classes, p.scale), p.config.forgetting)
        st.weights, st.precision = w, pm
        st.updates += len(labels)
        st.updated_at = self.wall()
        update_s = time.perf_counter() - t0
        self.users.put((spec.key, q.user), st)  # new predictions use it at once
        self.feedback_count += 1
        self._open()
        try:
            await asyncio.wrap_future(self.db.put(spec.name, spec.version, q.user,
                                                  StoredUser(w, pm, st.updates, st.updated_at)))
        except Exception as e:
            # memory must not run ahead of the database: the next use reads what was committed
            self.users.discard((spec.key, q.user))
            raise _db_error(e) from None
        return {"model_name": spec.name, "model_version": str(spec.version), "user": q.user,
                "query_id": query_id, "updates": st.updates, "update_us": round(update_s * 1e6, 1),
                "durable_ms": round((time.perf_counter() - t0) * 1e3, 3)}

    async def user_status(self, spec: ModelSpec, user: Any) -> dict[str, Any]:
        """What is known of a user of a personalized model version; NotFound if it never gave feedback."""
        if spec.personalization is None:
            raise BadRequest(f"model {spec.name} version {spec.version} is not personalized: it has no users")
        user = check_user(user)
        st = await self.state(spec, user)
        if st.updates == 0:
            raise NotFound(f"model {spec.name} version {spec.version} has no user {user!r:.80} (no feedback from it)")
        return {"model_name": spec.name, "model_version": str(spec.version), "user": user,
                "updates": st.updates, "last_update": st.updated_at}


def _from_row(spec: ModelSpec, p: PersonalSpec, user: str, row: StoredUser | None) -> UserState:
    if row is None:
        return UserState.fresh(p)
    if row.weights.shape != p.head.shape:
        log.warning("user %r of %s: stored weights %s do not fit the head %s (a new head under the same version): "
                    "starting again from the head", user, spec.key, row.weights.shape, p.head.shape)
        return UserState.fresh(p)
    return UserState(row.weights, row.precision, row.updates, row.updated_at, p.head_digest)


def _db_error(e: BaseException | None) -> EscapementError:
    if isinstance(e, EscapementError):
        return e
    return InternalError(f"the user database failed: {type(e).__name__}: {e}")


def _fail(r: InferenceRequest, e: BaseException | None) -> None:
    r.outputs = None
    r.status = RequestStatus.FAILED
    r.error = _db_error(e)
