"""The deadline-aware cluster routing rule (daemon/routing.py): pure, no Ray."""

from __future__ import annotations

import pytest

from daemon.routing import SLACK, Candidate, NodeForecast, rank, route


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


def forecast(at: float, models: dict[str, tuple[float, float]], cold: float = 0.5, per: float = 0.002,
             pending: int = 0) -> NodeForecast:
    parsed = NodeForecast.parse({"at": at, "models": {k: list(v) for k, v in models.items()}, "cold_s": cold,
                                 "per_request_s": per, "pending": pending})
    assert parsed is not None
    return parsed


def test_route_reads_holders_and_slo_from_the_forecasts() -> None:
    a = forecast(100.0, {"m": (0.040, 0.100)})
    b = forecast(100.0, {}, cold=0.001)
    assert route([a, b], "m", now=100.0, sent_since=[0, 0]) == [0, 1]
    assert route([a, b], "other", now=100.0, sent_since=[0, 0]) == [1, 0]  # held nowhere: earliest (a cold 0.5 s)


def test_a_forecast_ages_and_requests_sent_since_add_to_it() -> None:
    a = forecast(100.0, {"m": (0.060, 0.100)})
    b = forecast(100.0, {"m": (0.070, 0.100)}, per=0.010)
    # 20 ms later a's queue has drained to 40 ms; b's to 50 ms plus 3 requests sent since (30 ms)
    c, slo = a.candidate("m", 100.020, 0)
    assert c.finish_s == pytest.approx(0.040) and c.holds and slo == 0.100
    assert route([a, b], "m", now=100.020, sent_since=[0, 3]) == [0, 1]
    assert route([a, b], "m", now=100.020, sent_since=[6, 0]) == [1, 0]  # a got 6 more at 2 ms each: 52 ms
    assert a.candidate("m", 101.0, 0)[0].finish_s == 0.0  # never negative


def test_nodes_without_a_forecast_come_last_and_none_at_all_means_no_opinion() -> None:
    a = forecast(1.0, {"m": (0.9, 0.1)})  # holds it, but late: still ranked before the unknown node
    assert route([None, a], "m", now=1.0, sent_since=[0, 0]) == [1, 0]
    assert route([None, None], "m", now=1.0, sent_since=[0, 0]) == []


@pytest.mark.parametrize("stats", [None, {}, {"at": 1.0}, {"at": 1.0, "models": {"m": [1]}, "cold_s": 0.1,
                                                              "per_request_s": 0.0, "pending": 0},
                                   {"at": "x", "models": {}, "cold_s": 0.1, "per_request_s": 0.0, "pending": 0}])
def test_a_missing_or_malformed_report_is_no_forecast(stats: dict[str, object] | None) -> None:
    assert NodeForecast.parse(stats) is None
