"""The application policies (daemon/apps/selection.py) and their pure helpers
(daemon/apps/application.py), the policy store (daemon/apps/appdb.py): deterministic, with a
scripted RNG and a fake clock."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from daemon.apps.appdb import AppDB
from daemon.apps.application import (
    AppDefinition,
    AppQueries,
    AppQuery,
    check_labels,
    check_members,
    check_reward,
    default_answer,
    plan,
)
from daemon.apps.selection import Exp3, Exp4, PolicyState, combine, label_reward
from daemon.clock import FakeClock
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest
from daemon.model import ModelSpec, TensorSpec


class Scripted:
    """An RNG that returns the values it was given, in order."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_exp3_probabilities_mix_weights_and_exploration() -> None:
    p = Exp3(PolicyState([0.5, 0.25, 0.25]), gamma=0.3).probabilities()
    assert p == pytest.approx([0.7 * 0.5 + 0.1, 0.7 * 0.25 + 0.1, 0.7 * 0.25 + 0.1])
    assert sum(p) == pytest.approx(1.0)


def test_exp3_choose_follows_the_rng_and_renormalizes_over_the_allowed() -> None:
    pol = Exp3(PolicyState.fresh(3), gamma=0.3)  # uniform: 1/3 each
    assert pol.choose(Scripted(0.0)) == (0, pytest.approx(1 / 3))
    assert pol.choose(Scripted(0.5))[0] == 1
    assert pol.choose(Scripted(0.99))[0] == 2
    # member 1 cannot make the deadline: 0 and 2 share the mass, each with probability 1/2
    assert pol.choose(Scripted(0.49), allowed=[0, 2]) == (0, pytest.approx(0.5))
    assert pol.choose(Scripted(0.51), allowed=[0, 2]) == (2, pytest.approx(0.5))
    with pytest.raises(ValueError, match="no member"):
        pol.choose(Scripted(0.1), allowed=[])


def test_exp3_update_is_importance_weighted_and_normalized() -> None:
    st = PolicyState.fresh(2)
    pol = Exp3(st, gamma=0.2, alpha=0.0)
    pol.update(0, 1.0, prob=0.5)
    grown = math.exp(0.2 * (1.0 / 0.5) / 2)
    assert st.weights == pytest.approx([grown / (grown + 1), 1 / (grown + 1)])
    assert st.updates == 1
    before = list(st.weights)
    pol.update(1, 0.0, prob=0.5)  # no reward: nothing moves
    assert st.weights == pytest.approx(before)


def test_exp3_learns_the_better_arm_and_recovers_when_it_degrades() -> None:
    rng = np.random.default_rng(0)

    class Rng:
        def random(self) -> float:
            return float(rng.random())

    pol = Exp3(PolicyState.fresh(2), gamma=0.1, alpha=0.01)
    for t in range(4000):
        good = 0 if t < 2000 else 1  # arm 0 is right first, then arm 1
        i, p = pol.choose(Rng())
        pol.update(i, 1.0 if i == good else 0.0, p)
        if t == 1999:
            assert pol.probabilities()[0] > 0.8  # at most 0.9 w + 0.05; the share keeps arm 1 alive
    assert pol.probabilities()[1] > 0.8  # the share let arm 1 come back


def test_exp4_weights_move_by_each_members_loss_and_mixture_renormalizes() -> None:
    st = PolicyState.fresh(3)
    pol = Exp4(st, eta=1.0, alpha=0.0)
    pol.update({0: 1.0, 1: 0.0})  # member 2 did not answer: only its relative weight is kept
    w = [1.0, math.exp(-1.0), 1.0]
    assert st.weights == pytest.approx([x / sum(w) for x in w])
    assert pol.mixture([0, 1]) == pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))])
    with pytest.raises(ValueError):
        Exp4(st, eta=0.0)
    with pytest.raises(ValueError):
        Exp3(st, gamma=0.0)


def test_fixed_share_keeps_every_member_alive() -> None:
    st = PolicyState.fresh(2)
    pol = Exp4(st, eta=5.0, alpha=0.02)
    for _ in range(200):
        pol.update({0: 1.0, 1: 0.0})
    assert st.weights[1] >= 0.01 - 1e-12 and sum(st.weights) == pytest.approx(1.0)


def test_combine_softmax_mean_and_vote() -> None:
    a = np.array([[2.0, 0.0, 0.0]], np.float32)
    b = np.array([[0.0, 0.0, 4.0]], np.float32)
    mean = combine([a, b], [0.75, 0.25], "mean")
    np.testing.assert_allclose(mean, [[1.5, 0.0, 1.0]])
    vote = combine([a, b], [0.75, 0.25], "vote")
    np.testing.assert_allclose(vote, [[0.75, 0.0, 0.25]])
    soft = combine([a, b], [0.5, 0.5], "softmax")
    assert soft.dtype == np.float32 and soft.sum() == pytest.approx(1.0)
    assert int(soft.argmax()) == 2  # b is more confident: softmax weighs confidence within a member


def test_label_reward_is_the_share_of_samples_right() -> None:
    out = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert label_reward(out, [1, 0, 0]) == pytest.approx(2 / 3)


def test_plan_runs_only_members_expected_by_the_deadline() -> None:
    p = plan([1.0, 3.0, 2.0], deadline=2.0)
    assert p.run == (0, 2) and p.skipped == (1,)
    assert plan([5.0], deadline=1.0).run == ()


def spec(name: str, inp: int = 4, out: int = 3, out_name: str = "OUTPUT__0") -> ModelSpec:
    fp = BY_NAME["FP32"]
    return ModelSpec(name, 1, Path("/nonexistent") / name / "1" / "model.pt2", "pt2",
                     (TensorSpec("INPUT__0", fp, (-1, inp)),), (TensorSpec(out_name, fp, (-1, out)),), 8, 0.1)


def test_check_members_names_what_differs() -> None:
    d = AppDefinition("app", ("a", "b"))
    assert check_members(d, [spec("a"), spec("b", out_name="logits")]) == ""  # outputs by place, not name
    assert "different inputs" in check_members(d, [spec("a"), spec("b", inp=5)])
    assert "different outputs" in check_members(d, [spec("a"), spec("b", out=4)])
    named = AppDefinition("app", ("a", "b"), output="logits")
    assert "has no output 'logits'" in check_members(named, [spec("a"), spec("b", out_name="logits")])
    with_default = AppDefinition("app", ("a",), default_output=(1.0, 2.0))
    assert "default_output has 2 values" in check_members(with_default, [spec("a")])


def test_definitions_are_checked() -> None:
    for kw, needle in (({"models": ()}, "at least one"), ({"models": ("a", "a")}, "twice"),
                       ({"exploration": 0.0}, "exploration"), ({"share": 1.0}, "share"),
                       ({"slo_ms": -1.0}, "slo_ms"), ({"default_output": (math.nan,)}, "finite")):
        args = {"name": "app", "models": ("a",), **kw}
        with pytest.raises(ValueError, match=needle):
            AppDefinition(**args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="name"):
        AppDefinition("a b", ("a",))
    assert AppDefinition("x", ("a", "b")).digest != AppDefinition("x", ("b", "a")).digest


def test_default_answer_has_one_row_per_sample() -> None:
    d = AppDefinition("app", ("a",), default_output=(0.0, 1.0, 0.0))
    out = default_answer(d, 2, spec("a").outputs[0])
    np.testing.assert_array_equal(out, [[0, 1, 0], [0, 1, 0]])
    assert out.dtype == np.float32


def test_feedback_values_are_checked() -> None:
    assert check_labels(2, 1, 3) == [2] and check_labels([0, 1], 2, 3) == [0, 1]
    for bad, needle in ((True, "integer"), ("1", "integer"), (3, "out of range"), ([1, 2], "give 1")):
        with pytest.raises(BadRequest, match=needle):
            check_labels(bad, 1, 3)
    assert check_reward(1) == 1.0
    for bad_reward in (1.5, -0.1, True, "1", None):
        with pytest.raises(BadRequest, match="reward"):
            check_reward(bad_reward)


def test_query_memory_is_bounded_in_count_bytes_and_age() -> None:
    clock = FakeClock()
    out = np.zeros((1, 10), np.float32)

    def q() -> AppQuery:
        return AppQuery("app", "d", ("a",), (0,), [out], 1.0, 1, clock.now())

    mem = AppQueries(max_queries=3, max_bytes=10_000, ttl_s=5.0, clock=clock)
    ids = [mem.add(q()) for _ in range(4)]
    assert len(mem) == 3 and mem.get(ids[0]) is None and mem.evictions == 1
    clock.advance(6.0)
    assert mem.get(ids[3]) is None and len(mem) == 0 and mem.bytes == 0
    small = AppQueries(max_queries=100, max_bytes=q().nbytes * 2, ttl_s=5.0, clock=clock)
    for _ in range(5):
        small.add(q())
    assert len(small) == 2
    qid = small.add(q())
    assert small.take(qid) is not None and small.take(qid) is None  # one feedback per query


def test_appdb_stores_reads_back_and_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "apps.sqlite3"
    db = AppDB(path)
    db.start()
    assert db.get("app", "d1").result() is None
    db.put("app", "d1", PolicyState([0.2, 0.8], 7), 123.0).result()
    db.put("app", "d2", PolicyState([1.0], 1), 124.0).result()
    got = db.get("app", "d1").result()
    assert got is not None and got.weights == [0.2, 0.8] and got.updates == 7
    db.close()
    again = AppDB(path)
    again.start()
    got = again.get("app", "d1").result()
    assert got is not None and got.weights == [0.2, 0.8]
    assert again.writes == 0 and again.reads == 1
    again.close()
    unopened = AppDB(tmp_path / "never.sqlite3")
    with pytest.raises(RuntimeError, match="not open"):
        unopened.get("app", "d").result()
