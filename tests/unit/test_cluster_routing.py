"""The deadline-aware cluster routing rule (daemon/routing.py): pure, no Ray."""

from __future__ import annotations

import pytest

from daemon.routing import SLACK, Candidate, NodeForecast, ReportedRouting, rank


def test_a_holder_that_leaves_slack_wins_over_an_earlier_cold_node() -> None:
    cands = [Candidate(0.010, holds=False), Candidate(0.050, holds=True), Candidate(0.070, holds=True)]
    assert rank(cands, slo_s=0.100) == [1, 0, 2]


def test_a_holder_too_close_to_the_slo_loses_to_the_earliest_finish() -> None:
    late = (1.0 - SLACK) * 0.100 + 0.001
    cands = [Candidate(0.020, holds=False), Candidate(late, holds=True)]
    assert rank(cands, slo_s=0.100) == [0, 1]


def test_without_an_slo_only_finish_times_count_and_ties_go_to_the_less_loaded() -> None:
    cands = [Candidate(0.03, True, pending=9), Candidate(0.01, False, pending=0), Candidate(0.03, False, pending=1)]
    assert rank(cands, slo_s=None) == [1, 2, 0]


def report(at: float, models: dict[str, tuple[float, float, float]], cold: float = 0.5, load: float = 0.4,
           per: float = 0.002, devices: int = 1) -> dict[str, object]:
    return {"at": at, "models": {k: list(v) for k, v in models.items()}, "cold_s": cold, "load_s": load,
            "per_request_s": per, "pending": 0, "devices": devices}


def forecast(at: float, models: dict[str, tuple[float, float, float]], **kw: float) -> NodeForecast:
    parsed = NodeForecast.parse(report(at, models, **kw))
    assert parsed is not None
    return parsed


def routing(*reports: dict[str, object]) -> ReportedRouting:
    r = ReportedRouting()
    for i, rep in enumerate(reports):
        r.report(i, rep)
    return r


def test_holders_and_slos_come_from_the_reports() -> None:
    r = routing(report(100.0, {"m": (0.040, 0.100, 0.002)}), report(100.0, {}, cold=0.001, load=0.001))
    assert r.order([0, 1], "m", now=100.0) == [0, 1]
    assert r.order([0, 1], "other", now=100.0) == [1, 0]  # held nowhere: the earliest cold start


def test_what_was_queued_drains_and_what_was_sent_since_queues() -> None:
    a = forecast(100.0, {"m": (0.060, 0.100, 0.002)})
    c, slo = a.candidate("m", 100.020, sent=0)
    assert c.finish_s == pytest.approx(0.040) and c.holds and slo == 0.100
    assert a.candidate("m", 100.020, sent=10)[0].finish_s == pytest.approx(0.060)
    assert a.candidate("m", 101.0, sent=0)[0].finish_s == pytest.approx(0.002)  # never below one run
    r = routing(report(100.0, {"m": (0.060, 0.100, 0.002)}), report(100.0, {"m": (0.070, 0.100, 0.010)}))
    assert r.order([0, 1], "m", now=100.020) == [0, 1]
    for _ in range(6):  # 6 more at 2 ms each: 52 ms left on node 0, 50 on node 1
        r.sent_to(0, "m")
    assert r.order([0, 1], "m", now=100.020) == [1, 0]


def test_a_load_never_drains_and_loads_sent_since_spread_over_the_nodes() -> None:
    f = forecast(100.0, {}, cold=0.5, load=0.4)
    assert f.candidate("m", 101.0, sent=0)[0].finish_s == pytest.approx(0.4)  # its LOAD is still to come
    r = routing(report(100.0, {}, cold=0.4, load=0.4), report(100.0, {}, cold=0.4, load=0.4))
    first = r.order([0, 1], "a", now=100.0)[0]
    r.sent_to(first, "a")  # a LOAD of a went there: the next cold model goes to the other node
    assert r.order([0, 1], "b", now=100.0)[0] == 1 - first
    c, _ = r.reports[first].candidate("a", 100.0, sent=1)  # type: ignore[union-attr]
    assert c.holds  # a node sent the model since holds it: its LOAD is on the way


def test_a_new_report_resets_what_was_sent_since() -> None:
    r = routing(report(100.0, {"m": (0.010, 0.100, 0.002)}))
    for _ in range(100):
        r.sent_to(0, "m")
    assert r.sent[0]["m"] == 100
    r.report(0, report(100.5, {"m": (0.010, 0.100, 0.002)}))
    assert r.sent[0]["m"] == 0


def test_nodes_without_a_report_come_last_and_none_at_all_means_no_opinion() -> None:
    r = routing({}, report(1.0, {"m": (0.9, 0.1, 0.01)}))  # holds it, but late: still before the silent node
    assert r.order([0, 1], "m", now=1.0) == [1, 0]
    assert routing({}, {}).order([0, 1], "m", now=1.0) == []
    r.forget(1)
    assert r.order([0, 1], "m", now=1.0) == []


def test_the_slo_of_a_model_no_node_holds_is_remembered_from_earlier_reports() -> None:
    r = ReportedRouting(max_slos=2)
    r.report(0, report(1.0, {"a": (0.01, 0.5, 0.001), "b": (0.01, 0.6, 0.001), "c": (0.01, 0.7, 0.001)}))
    assert list(r.slos) == ["b", "c"]  # bounded: the oldest forgotten


@pytest.mark.parametrize("stats", [None, {}, {"at": 1.0}, {"at": 1.0, "models": {"m": [1]}, "cold_s": 0.1,
                                                              "per_request_s": 0.0, "pending": 0},
                                   {"at": "x", "models": {}, "cold_s": 0.1, "per_request_s": 0.0, "pending": 0}])
def test_a_missing_or_malformed_report_is_no_forecast(stats: dict[str, object] | None) -> None:
    assert NodeForecast.parse(stats) is None
