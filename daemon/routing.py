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

from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping, Sequence
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
    # model -> (seconds to an answer when reported, its SLO, seconds each more request of it adds)
    models: Mapping[str, tuple[float, float, float]]
    cold_s: float  # seconds to an answer for a model it does not hold (a device free, a LOAD, the run)
    per_request_s: float  # what a request of a model it does not hold adds
    pending: int
    load_s: float = 0.0  # the part of cold_s no wait shortens (the LOAD and the run)
    devices: int = 1  # live devices: LOADs sent since the report spread over them

    @staticmethod
    def parse(stats: Mapping[str, Any] | None) -> NodeForecast | None:
        """A forecast from its wire form; None when absent or malformed (the node is then ranked
        after those that reported)."""
        if not stats:
            return None
        try:
            per = float(stats["per_request_s"])
            models = {str(k): (float(v[0]), float(v[1]), float(v[2]) if len(v) > 2 else per)
                      for k, v in stats["models"].items()}
            cold = float(stats["cold_s"])
            return NodeForecast(float(stats["at"]), models, cold, per, int(stats["pending"]),
                                min(float(stats.get("load_s", 0.0)), cold), max(int(stats.get("devices", 1)), 1))
        except (KeyError, TypeError, ValueError, IndexError):
            return None

    def candidate(self, model: str, now: float, sent: int, sent_all: int = 0,
                  loads: int = 0) -> tuple[Candidate, float | None]:
        """This node as a candidate for `model` at `now`, having been sent `sent` requests of it
        (`sent_all` of any model, `loads` of models it did not hold) that the forecast does not
        know of; and the model's SLO where the node knows it. What was queued when it reported and
        the requests of this model sent since drain as time passes, down to one run (a LOAD does
        not drain for a model it does not hold, and the LOADs sent since queue on its devices'
        copy lanes). A node sent the model since counts as holding it: its LOAD is on the way."""
        age = max(0.0, now - self.at)
        sent = max(sent, 0)
        held = self.models.get(model)
        if held is not None:
            finish = max(held[0] + sent * held[2] - age, held[2])
            return Candidate(finish, True, self.pending + sent_all), held[1]
        if sent:
            finish = max(self.cold_s + sent * self.per_request_s - age, self.per_request_s)
        else:
            finish = max(self.cold_s - age, self.load_s) + max(loads, 0) * self.load_s / self.devices
        return Candidate(finish, sent > 0, self.pending + sent_all), None


class ReportedRouting:
    """The router's side of reported forecasts (daemon/rayserve.py DeadlineRouter, and the routing
    simulation's `reported` router): each node's latest report, the requests sent to it since
    (per model), and the SLOs the reports named (so a model no node holds is still routed against
    its SLO). Bounded: SLOs of at most `max_slos` models, forgotten oldest first."""

    def __init__(self, max_slos: int = 65536, slack: float = SLACK) -> None:
        self.reports: dict[Hashable, NodeForecast | None] = {}
        self.raw: dict[Hashable, object] = {}  # the report as given: parsed once per report
        self.sent: dict[Hashable, Counter[str]] = {}
        self.sent_all: Counter[Hashable] = Counter()  # requests sent since the report, any model
        self.loads: Counter[Hashable] = Counter()  # models sent since that the report did not hold
        self.slos: OrderedDict[str, float] = OrderedDict()
        self.max_slos = max_slos
        self.slack = slack

    def report(self, node: Hashable, stats: Mapping[str, Any] | None) -> None:
        """The node's latest report (None or {} while it has none). A new report resets what was
        sent to the node since the previous one."""
        if node in self.raw and self.raw[node] is stats:
            return
        self.raw[node] = stats
        parsed = NodeForecast.parse(stats)
        old = self.reports.get(node)
        if parsed is None or old is None or parsed.at != old.at:
            self.sent[node] = Counter()
            self.sent_all[node] = 0
            self.loads[node] = 0
        self.reports[node] = parsed
        if parsed is not None:
            for model, (_, slo, _) in parsed.models.items():
                self.slos[model] = slo
                self.slos.move_to_end(model)
            while len(self.slos) > self.max_slos:
                self.slos.popitem(last=False)

    def forget(self, node: Hashable) -> None:
        for table in (self.reports, self.raw, self.sent, self.sent_all, self.loads):
            table.pop(node, None)

    def sent_to(self, node: Hashable, model: str) -> None:
        sent = self.sent.setdefault(node, Counter())
        f = self.reports.get(node)
        if not sent[model] and f is not None and model not in f.models:
            self.loads[node] += 1
        sent[model] += 1
        self.sent_all[node] += 1

    def order(self, nodes: Sequence[Hashable], model: str, now: float) -> list[int]:
        """Indexes into `nodes`, most preferred first; [] when none has reported."""
        known: list[int] = []
        cands: list[Candidate] = []
        slo = self.slos.get(model)
        for i, node in enumerate(nodes):
            f = self.reports.get(node)
            if f is None:
                continue
            sent = self.sent.get(node) or Counter()
            c, s = f.candidate(model, now, sent[model], self.sent_all[node], self.loads[node])
            known.append(i)
            cands.append(c)
            if s is not None:
                slo = s if slo is None else min(slo, s)
        if not known:
            return []
        ranked = [known[j] for j in rank(cands, slo, self.slack)]
        return ranked + [i for i, node in enumerate(nodes) if self.reports.get(node) is None]
