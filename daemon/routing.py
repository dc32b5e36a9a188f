"""Which node serves a request: the deadline-aware rule for a cluster router. Pure code, no I/O.

A cluster of escapement nodes (Ray Serve replicas, daemon/rayserve.py) routes each request to
one node; inside it the node's controller decides the rest. Each node forecasts when it would
answer one more request of a model (`ControllerService.forecast`: its queue, its devices'
timelines, a LOAD where it does not hold the model). The rule, measured against random routing
and Ray Serve's multiplexed routing by `python -m bench run routing`:

- **affinity while it meets the deadline**: among the nodes holding the model, the one that
  finishes first, if it finishes with `SLACK` of the SLO to spare;
- **else the earliest finish anywhere**, loading the model there if need be.

Always taking the earliest finish loses to plain affinity: it spreads copies of every model over
idle nodes, each LOAD evicts another model, and the cold starts that causes cost more later than
the wait it saved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SLACK = 0.25  # a holder is good enough while it would finish with this share of the SLO to spare
REPORT_PERIOD_S = 0.5  # how often a node reports its forecast to the routers (Ray Serve's routing stats)
REPORT_MODELS = 1024  # models per report (the most queued first); the others count as cold there


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node's forecast for one request: seconds from now until it would answer it."""

    finish_s: float
    holds: bool  # the model is resident there (or loading): no cold start
    pending: int = 0  # requests queued there: breaks ties toward the less loaded node


def rank(candidates: Sequence[Candidate], slo_s: float | None, slack: float = SLACK) -> list[int]:
    """Candidate indexes, most preferred first (a router falls back down the list when the first
    cannot take the request). `slo_s` None: the model's SLO is unknown, only finish times count."""
    order = sorted(range(len(candidates)),
                   key=lambda i: (candidates[i].finish_s, candidates[i].pending, i))
    if slo_s is None:
        return order
    held = [i for i in order if candidates[i].holds]
    if held and candidates[held[0]].finish_s <= (1.0 - slack) * slo_s:
        return [held[0], *(i for i in order if i != held[0])]
    return order


@dataclass(frozen=True, slots=True)
class NodeForecast:
    """What a node reports for routing (the `forecast` op), taken at `at` (its sender's clock)."""

    at: float
    models: Mapping[str, tuple[float, float]]  # model -> (finish_s when reported, its SLO in s)
    cold_s: float  # finish_s for a model it does not hold (a LOAD, then the run)
    per_request_s: float  # recent device time per request: what each request sent since adds
    pending: int

    @staticmethod
    def parse(stats: Mapping[str, Any] | None) -> NodeForecast | None:
        """A forecast from its wire form; None when absent or malformed (the node is then ranked
        by Serve's own information only)."""
        if not stats:
            return None
        try:
            models = {str(k): (float(v[0]), float(v[1])) for k, v in stats["models"].items()}
            return NodeForecast(float(stats["at"]), models, float(stats["cold_s"]),
                                float(stats["per_request_s"]), int(stats["pending"]))
        except (KeyError, TypeError, ValueError, IndexError):
            return None

    def candidate(self, model: str, now: float, sent_since: int) -> tuple[Candidate, float | None]:
        """This node as a candidate for `model` at `now`, having been sent `sent_since` requests
        the forecast does not know of; and the model's SLO where the node knows it."""
        age = max(0.0, now - self.at)
        held = self.models.get(model)
        base = held[0] if held is not None else self.cold_s
        # the forecast's queue drains while it ages; what was sent since adds to it
        finish = max(base - age, 0.0) + max(sent_since, 0) * self.per_request_s
        return Candidate(finish, held is not None, self.pending + max(sent_since, 0)), \
            (held[1] if held is not None else None)


def route(forecasts: Sequence[NodeForecast | None], model: str, now: float, sent_since: Sequence[int],
          slack: float = SLACK) -> list[int]:
    """Nodes in order of preference for a request of `model`. A node without a forecast (just
    started, or its report failed) comes after every node with one; [] when none has one, and the
    caller then routes as it would without forecasts."""
    known: list[int] = []
    cands: list[Candidate] = []
    slo: float | None = None
    for i, f in enumerate(forecasts):
        if f is None:
            continue
        c, s = f.candidate(model, now, sent_since[i] if i < len(sent_since) else 0)
        known.append(i)
        cands.append(c)
        if s is not None:
            slo = s if slo is None else min(slo, s)
    if not known:
        return []
    ranked = [known[j] for j in rank(cands, slo, slack)]
    return ranked + [i for i, f in enumerate(forecasts) if f is None]
