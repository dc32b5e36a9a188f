"""Personalized models: RLS, the bounded memories, the SQLite store and the loop's side (fake clock)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from daemon.apps.personal import (
    Personalizer,
    Query,
    QueryMemory,
    UserCache,
    UserState,
    check_labels,
    rls_update,
    targets,
    with_bias,
)
from daemon.apps.userdb import StoredUser, UserDB
from daemon.clock import FakeClock
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest, NotFound
from daemon.model import ModelSpec, PersonalConfig, TensorSpec
from daemon.model_config import load_head
from daemon.repository import scan
from daemon.request import InferenceRequest, RequestStatus
from tests.support import tiny_config

FP32 = BY_NAME["FP32"]
D, C = 4, 3


def head_spec(tmp_path: Path, version: int = 1, scale: float = 2.0, seed: int = 0) -> ModelSpec:
    """A personalized spec over a (D+1, C) head written under tmp_path."""
    vdir = tmp_path / "m" / str(version)
    vdir.mkdir(parents=True, exist_ok=True)
    w = np.random.default_rng(seed).standard_normal((D + 1, C))
    np.savez(vdir / "head.npz", W=w, scale=np.float64(scale))
    outputs = (TensorSpec("logits", FP32, (-1, C)), TensorSpec("features", FP32, (-1, D)))
    p = load_head(PersonalConfig("features", "head.npz"), vdir, outputs)
    return ModelSpec("m", version, vdir / "model.pt2", "pt2", (TensorSpec("x", FP32, (-1, D)),), outputs, 8, 1.0,
                     personalization=p)


# ------------------------------------------------------------------ RLS


def test_rls_is_ridge_regression_towards_the_head() -> None:
    # RLS from (W0, prior * I) after n samples = argmin sum |t - xW|^2 + |W - W0|^2 / prior
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal((D + 1, C))
    xs = with_bias(rng.standard_normal((30, D)))
    ts = rng.standard_normal((30, C))
    prior = 0.5
    w, p = w0, np.eye(D + 1) * prior
    for x, t in zip(xs, ts, strict=True):
        w, p = rls_update(w, p, x, t)
    a = xs.T @ xs + np.eye(D + 1) / prior
    closed = np.linalg.solve(a, xs.T @ ts + w0 / prior)
    np.testing.assert_allclose(w, closed, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(p, np.linalg.inv(a), rtol=1e-9, atol=1e-9)


def test_rls_returns_new_arrays() -> None:
    w, p = np.zeros((D + 1, C)), np.eye(D + 1)
    w.flags.writeable = False  # the head is read-only: an update must never write into it
    w2, p2 = rls_update(w, p, with_bias(np.ones((1, D)))[0], targets(1, C, 1.0))
    assert w2 is not w and p2 is not p and not np.shares_memory(w2, w)
    assert list(targets(1, 3, 2.0)) == [-2.0, 2.0, -2.0]


def test_rls_learns_a_permuted_labelling() -> None:
    # features that separate 3 classes; the head says class c, the user calls it perm[c]
    rng = np.random.default_rng(2)
    centres = np.eye(C, D) * 4
    head = np.vstack([centres.T, np.zeros((1, C))])  # logits = features . centre
    perm = np.array([2, 0, 1])
    ys = rng.integers(0, C, 300)
    feats = centres[ys] + rng.standard_normal((300, D)) * 0.5
    x = with_bias(feats)
    w, p = head, np.eye(D + 1)
    for i in range(60):
        w, p = rls_update(w, p, x[i], targets(int(perm[ys[i]]), C, 4.0))
    test = slice(100, 300)
    assert ((x[test] @ head).argmax(1) == perm[ys[test]]).mean() < 0.5
    assert ((x[test] @ w).argmax(1) == perm[ys[test]]).mean() > 0.95


# ------------------------------------------------------------------ bounded memories


def test_user_cache_is_bounded_in_count_and_bytes(tmp_path: Path) -> None:
    p = head_spec(tmp_path).personalization
    assert p is not None
    one = UserState.fresh(p).nbytes
    cache = UserCache(max_users=3, max_bytes=10 * one)
    for u in "abcd":
        cache.put(("m:1", u), UserState.fresh(p))
    assert len(cache) == 3 and cache.get(("m:1", "a"), p.head_digest) is None and cache.evictions == 1
    assert cache.get(("m:1", "b"), p.head_digest) is not None  # b is now the most recent
    cache.put(("m:1", "e"), UserState.fresh(p))
    assert cache.get(("m:1", "c"), p.head_digest) is None and cache.get(("m:1", "b"), p.head_digest) is not None
    small = UserCache(max_users=100, max_bytes=2 * one)
    for u in "abc":
        small.put(("m:1", u), UserState.fresh(p))
    assert len(small) == 2 and small.bytes == 2 * one
    # a version reloaded with another head: its users start again
    assert cache.get(("m:1", "b"), "another digest") is None and cache.get(("m:1", "b"), p.head_digest) is None


def test_query_memory_expires_and_bounds(tmp_path: Path) -> None:
    spec = head_spec(tmp_path)
    clock = FakeClock()
    mem = QueryMemory(max_queries=3, max_bytes=1 << 20, ttl_s=10.0, clock=clock)

    def q() -> Query:
        return Query(spec, "u", with_bias(np.ones((1, D))), clock.now())

    a = mem.add(q())
    clock.advance(6)
    b = mem.add(q())
    assert mem.get(a) is not None
    clock.advance(5)  # a is 11 s old, b 5 s
    assert mem.get(a) is None and mem.get(b) is not None
    ids = [mem.add(q()) for _ in range(3)]
    assert len(mem) == 3 and mem.get(b) is None and all(mem.get(i) for i in ids)
    assert mem.take(ids[0]) is not None and mem.take(ids[0]) is None  # one feedback per query
    size = q().nbytes
    tight = QueryMemory(max_queries=100, max_bytes=2 * size, ttl_s=10.0, clock=clock)
    for _ in range(5):
        tight.add(q())
    assert len(tight) == 2 and tight.bytes == 2 * size


def test_labels_are_checked() -> None:
    assert check_labels(2, 1, 3) == [2]
    assert check_labels([0, 2], 2, 3) == [0, 2]
    for bad, needle in [(3, "out of range"), (-1, "out of range"), (True, "integer"), ("1", "integer"),
                        (1.0, "integer"), ([1], "list of 2")]:
        with pytest.raises(BadRequest, match=needle):
            check_labels(bad, 2 if isinstance(bad, list) else 1, 3)


# ------------------------------------------------------------------ the SQLite store


def test_userdb_round_trip_order_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state" / "users.sqlite3"
    db = UserDB(path)
    db.start()
    try:
        assert db.get("m", 1, "u").result() is None
        w, p = np.arange(15.0).reshape(5, 3), np.eye(5) * 2
        writes = [db.put("m", 1, "u", StoredUser(w + i, p, i + 1, 100.0 + i)) for i in range(20)]
        read = db.get("m", 1, "u")  # queued after the writes: it sees the last one
        for f in writes:
            assert f.result(timeout=10) is None
        got = read.result(timeout=10)
        assert got is not None and got.updates == 20 and got.updated_at == 119.0
        np.testing.assert_array_equal(got.weights, w + 19)
        np.testing.assert_array_equal(got.precision, p)
        assert db.get("m", 2, "u").result() is None and db.get("m", 1, "v").result() is None
        assert db.stats().commits <= 22 and db.stats().writes == 20
    finally:
        db.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again = UserDB(path)
    again.start()
    try:
        got = again.get("m", 1, "u").result(timeout=10)
        assert got is not None and got.updates == 20
    finally:
        again.close()
    assert UserDB(path).get("m", 1, "u").exception() is not None  # not started: refused, not hung


@pytest.mark.expect_errors("cannot be opened")
def test_userdb_that_cannot_open_says_so(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        UserDB(tmp_path / "file" / "users.sqlite3").start()
    late = UserDB(tmp_path / "file" / "users.sqlite3")
    late.start(wait=False)  # the loop's way: the error comes with every operation
    with pytest.raises(OSError):
        late.get("m", 1, "u").result(timeout=10)
    late.close()


# ------------------------------------------------------------------ the loop's side


def _request(spec: ModelSpec, feats: np.ndarray, user: str) -> InferenceRequest:
    req = InferenceRequest(spec, (feats,), feats.shape[0], 0.0, 1.0, user=user)
    return req


def _answer(req: InferenceRequest) -> None:
    """What the controller would do: the model's outputs (logits from the head, the features)."""
    p = req.model.personalization
    assert p is not None
    f = req.inputs[0]
    req.outputs = ((with_bias(f) @ p.head).astype(np.float32), f)
    req.status = RequestStatus.SUCCEEDED
    assert req.on_finish is not None
    req.on_finish(req)


def _personalizer(tmp_path: Path, clock: FakeClock, **kw: int) -> Personalizer:
    db = UserDB(tmp_path / "users.sqlite3")
    db.start()
    args = {"max_users": 100, "max_user_bytes": 1 << 30, "max_queries": 1000, "max_query_bytes": 1 << 30}
    args.update(kw)
    return Personalizer(db, **args, query_ttl_s=60.0, clock=clock, wall=lambda: 1.7e9)


async def _predict(pz: Personalizer, spec: ModelSpec, feats: np.ndarray, user: str) -> InferenceRequest:
    req = _request(spec, feats, user)
    done: asyncio.Future[InferenceRequest] = asyncio.get_running_loop().create_future()
    req.on_finish = done.set_result
    pz.attach(req)
    _answer(req)
    return await asyncio.wait_for(done, 10)


def test_feedback_changes_the_users_predictions_and_survives_a_restart(tmp_path: Path) -> None:
    spec = head_spec(tmp_path)
    clock = FakeClock()
    feats = np.array([[1.0, 0.5, -0.5, 2.0]], np.float32)

    async def first() -> tuple[np.ndarray, np.ndarray]:
        pz = _personalizer(tmp_path, clock, max_users=1)  # one user in memory: the other is read back
        try:
            r = await _predict(pz, spec, feats, "alice")
            assert r.ok and len(r.outputs or ()) == 3 and r.query_id
            before = r.outputs[2].copy()  # type: ignore[index]
            np.testing.assert_allclose(before, r.outputs[0], rtol=1e-6)  # a fresh user = the global model
            with pytest.raises(NotFound, match="no user"):
                await pz.user_status(spec, "alice")
            with pytest.raises(BadRequest, match="out of range"):
                await pz.feedback(spec, r.query_id, 7)
            label = int(np.argmin(before))  # the global model's least likely class
            for _ in range(5):
                r = await _predict(pz, spec, feats, "alice")
                ack = await pz.feedback(spec, r.query_id, label)
            assert ack["updates"] == 5 and ack["user"] == "alice"
            with pytest.raises(NotFound, match="unknown or expired"):
                await pz.feedback(spec, r.query_id, label)  # used up
            await _predict(pz, spec, feats, "bob")  # evicts alice from memory (max_users=1)
            assert len(pz.users) == 1
            after = (await _predict(pz, spec, feats, "alice")).outputs[2]  # type: ignore[index]
            assert int(np.argmax(after)) == label
            bob = (await _predict(pz, spec, feats, "bob")).outputs[2]  # type: ignore[index]
            np.testing.assert_allclose(bob, before, rtol=1e-6)  # bob's weights are his own
            status = await pz.user_status(spec, "alice")
            assert status["updates"] == 5 and status["last_update"] == 1.7e9
            return after, before
        finally:
            pz.db.close()

    after, _ = asyncio.run(first())

    async def second() -> None:
        pz = _personalizer(tmp_path, clock)  # a new daemon on the same file
        try:
            again = (await _predict(pz, spec, feats, "alice")).outputs[2]  # type: ignore[index]
            np.testing.assert_array_equal(again, after)
        finally:
            pz.db.close()

    asyncio.run(second())


def test_feedback_errors(tmp_path: Path) -> None:
    spec = head_spec(tmp_path)
    plain = ModelSpec("plain", 1, Path("/nowhere"), "pt2", (TensorSpec("x", FP32, (-1, D)),),
                      (TensorSpec("y", FP32, (-1, C)),), 8, 1.0)
    clock = FakeClock()

    async def go() -> None:
        pz = _personalizer(tmp_path, clock)
        try:
            r = await _predict(pz, spec, np.ones((2, D), np.float32), "u")
            with pytest.raises(BadRequest, match="not personalized"):
                await pz.feedback(plain, r.query_id, 0)
            with pytest.raises(BadRequest, match="query_id"):
                await pz.feedback(spec, 12, 0)
            with pytest.raises(NotFound):
                await pz.feedback(spec, "nope", 0)
            with pytest.raises(BadRequest, match="list of 2"):
                await pz.feedback(spec, r.query_id, 0)  # two samples: two labels
            assert (await pz.feedback(spec, r.query_id, [0, 1]))["updates"] == 2
            r = await _predict(pz, spec, np.ones((1, D), np.float32), "u")
            clock.advance(61)
            with pytest.raises(NotFound, match="expired"):
                await pz.feedback(spec, r.query_id, 0)
            with pytest.raises(BadRequest, match="user"):
                await pz.user_status(spec, "")
        finally:
            pz.db.close()

    asyncio.run(go())


# ------------------------------------------------------------------ config.toml


def _model(tmp_path: Path, section: str, head: np.ndarray | None) -> Path:
    d = tmp_path / "pm"
    (d / "1").mkdir(parents=True)
    (d / "1" / "model.pt2").write_bytes(b"x")
    cfg = tiny_config(4, 3) + '[[outputs]]\nname = "features"\ndatatype = "FP32"\nshape = [-1, 5]\n' + section
    (d / "config.toml").write_text(cfg)
    if head is not None:
        np.savez(d / "1" / "head.npz", W=head)
    return d


@pytest.mark.parametrize(("section", "head", "needle"), [
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\n', np.zeros((6, 3)), None),
    ('[personalization]\nfeatures = "nope"\nhead = "head.npz"\n', np.zeros((6, 3)), "expected the name of one"),
    ('[personalization]\nfeatures = "features"\nhead = "../head.npz"\n', np.zeros((6, 3)), ".npz file name"),
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\noutput = "OUTPUT__0"\n', np.zeros((6, 3)),
     "new output name"),
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\nprior = 0\n', np.zeros((6, 3)), "prior"),
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\nextra = 1\n', np.zeros((6, 3)), "unknown keys"),
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\n', np.zeros((5, 3)), "shape"),
    ('[personalization]\nfeatures = "features"\nhead = "head.npz"\n', None, "missing"),
])
def test_personalization_config(tmp_path: Path, section: str, head: np.ndarray | None, needle: str | None) -> None:
    _model(tmp_path, section, head)
    result = scan(tmp_path)
    if needle is None:
        (spec,) = result.models
        p = spec.personalization
        assert p is not None and (p.dim, p.classes, p.scale, p.features_index) == (5, 3, 1.0, 1)
        assert [o.name for o in spec.served_outputs] == ["OUTPUT__0", "features", "personalized"]
        assert [o.name for o in spec.outputs] == ["OUTPUT__0", "features"]  # what the model itself answers
    else:
        assert "pm" in result.broken and needle in result.broken["pm"], result.broken


def test_query_ids_are_letters_and_digits_so_a_cli_takes_them_as_arguments() -> None:
    """token_urlsafe ids started with "-" one time in 64: `escapement feedback --app APP ID` then
    read the id as an option (docs/applications.md's shell example failed that way in CI)."""
    import contextlib
    import io

    from daemon.apps.queryid import LENGTH, new_query_id
    from daemon.cli import parser

    ids = {new_query_id() for _ in range(5000)}
    assert len(ids) == 5000 and all(len(q) == LENGTH and q.isalnum() for q in ids)
    cli = parser()
    for q in list(ids)[:50]:
        assert cli.parse_args(["feedback", "--app", "digits", q, "--reward", "1"]).query_id == q
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):  # what an id starting with "-" did
        cli.parse_args(["feedback", "--app", "digits", "-x7Gq", "--reward", "1"])
