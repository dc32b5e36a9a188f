"""`routing`: which node should serve a request, across several escapement nodes, in virtual time.

The cluster-level version of the question each controller answers per device. N nodes, each the
real scheduler and clockwork policy over D simulated devices (Clockwork's V100 profiles made 5x
faster), 10,000 models with Zipf popularity, each device's weight budget holding a small share of
them; the most popular models start spread over the nodes (as a while of the same load would
leave them). Every request is routed by one of:

- `random`: a node chosen uniformly (what a plain load balancer in front of identical replicas does);
- `ray`: Ray Serve's model multiplexing: the replicas that hold the model (loaded or loading), the
  less loaded of two chosen at random (power of two choices, by pending requests); when none holds
  it, the one with fewer models of two chosen at random;
- `deadline`: each node's controller is asked when it would finish the request (read-only, from
  its view: the earliest a device holding the model frees, or could load it, plus the run, plus
  the work queued for that model there): the node holding the model that finishes first, while it
  finishes with a quarter of the SLO to spare; else the earliest finish anywhere (loading it);
- `reported`: the same rule as the Ray application runs it (daemon/rayserve.py DeadlineRouter):
  on the forecast each node reports every half second, aged since, plus what was sent after it.

Per router and offered load (a share of the cluster's batched capacity): SLO attainment, goodput,
cold-start rate. `summary.slo_attainment_by_router` = {router: {load: attainment}}.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from bench import loadgen, results
from bench.scenarios.common import command
from bench.scenarios.scale import batched_capacity, models
from daemon import routing
from daemon.clock import VirtualClock
from daemon.config import ControllerSettings
from daemon.controller import forecast
from daemon.controller.driver import Driver
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.model import ModelSpec
from daemon.request import InferenceRequest
from daemon.sim import SimRecords, Simulation

GIB = 2**30
Router = Callable[[ModelSpec, float], int]


class Cluster:
    """N simulations (nodes) on one virtual clock and one event queue."""

    def __init__(self, n_nodes: int, devices: int, ms: list[tuple[ModelSpec, Any]], budget: int, seed: int) -> None:
        self.clock = VirtualClock(0.0)
        self.events: list[tuple[float, int, Callable[[], None], bool]] = []
        self.seq = itertools.count()
        settings = ControllerSettings(max_pending=10**9, max_pending_per_model=10**9)
        self.nodes = [Simulation(ms, devices, ClockworkPolicy(), settings, weight_budget=budget, seed=seed + i)
                      for i in range(n_nodes)]
        for node in self.nodes:  # one clock, one event queue: the nodes' executors post into it
            node.clock, node.events, node._seq = self.clock, self.events, self.seq
        self.drivers = [Driver(n.scheduler) for n in self.nodes]

    def warm(self, ms: list[tuple[ModelSpec, Any]], share: float = 0.9) -> None:
        """The most popular models spread over every node's devices, round robin, up to `share` of a budget."""
        slots = [(n, d) for d in range(len(self.nodes[0].devices)) for n in range(len(self.nodes))]
        used = {s: 0 for s in slots}
        for i, (spec, prof) in enumerate(ms):
            slot = slots[i % len(slots)]
            node = self.nodes[slot[0]]
            if used[slot] + prof.weight_bytes > node.devices[0].weight_budget * share:
                break
            node.place(spec.key, [f"sim:{slot[1]}"])
            used[slot] += prof.weight_bytes

    def run(self, times: np.ndarray, specs: list[ModelSpec], router: Router, drain_s: float) -> SimRecords:
        n = len(times)
        deadlines = np.array([times[i] + specs[i].slo_s for i in range(n)])
        records = SimRecords(np.asarray(times, dtype=float), deadlines)
        index: dict[int, int] = {}
        x = np.zeros((1, 1), np.float32)

        def arrive(i: int) -> None:
            now = self.clock.now()
            spec = specs[i]
            req = InferenceRequest(spec, (x,), 1, now, now + spec.slo_s)
            index[req.id] = i
            try:
                self.drivers[router(spec, now)].submit(req, now)
            except Exception as e:  # refused at admission
                index.pop(req.id, None)
                records.finish[i] = now
                records.status[i] = getattr(e, "status", 500)

        for i in range(n):
            heapq.heappush(self.events, (float(times[i]), next(self.seq), lambda i=i: arrive(i), True))
        end = (float(times[-1]) if n else 0.0) + drain_s
        while self.events:
            t, _, fn, _ = heapq.heappop(self.events)
            if t > end:
                break
            self.clock.set(max(t, self.clock.now()))
            fn()
            if self.events and self.events[0][0] <= t:
                continue  # everything at this instant first
            now = self.clock.now()
            for node, driver in zip(self.nodes, self.drivers, strict=True):
                pending, node._pending_results = node._pending_results, []
                node._apply(driver.step(now, pending), records, index)
                wake = driver.next_wakeup(now)
                if wake is not None and wake != node._wake_at:
                    node._wake_at = wake
                    heapq.heappush(self.events, (max(wake, now), next(self.seq), lambda: None, True))
        return records


def random_router(cluster: Cluster, rng: np.random.Generator) -> Router:
    n = len(cluster.nodes)
    return lambda spec, now: int(rng.integers(n))


def ray_router(cluster: Cluster, rng: np.random.Generator) -> Router:
    scheds = [node.scheduler for node in cluster.nodes]

    def two(choices: list[int], key: Callable[[int], float]) -> int:
        if len(choices) == 1:
            return choices[0]
        a, b = rng.choice(choices, 2, replace=False)
        return int(a) if key(int(a)) <= key(int(b)) else int(b)

    def route(spec: ModelSpec, now: float) -> int:
        holding = [i for i, s in enumerate(scheds) if s.placed_on.get(spec.key)]
        if holding:
            return two(holding, lambda i: scheds[i].pending)
        return two(list(range(len(scheds))), lambda i: sum(len(d.memory.models()) for d in scheds[i].devices.values()))

    return route


def deadline_router(cluster: Cluster, rng: np.random.Generator) -> Router:
    """The rule the Ray application routes by (daemon/routing.py: affinity while the holder that
    finishes first leaves a quarter of the SLO to spare, else the earliest finish anywhere), fed
    each node's forecast read from its controller's state at the request's arrival."""
    scheds = [node.scheduler for node in cluster.nodes]

    def route(spec: ModelSpec, now: float) -> int:
        cands = [routing.Candidate(forecast.predicted_finish(s, spec, now) - now, bool(s.placed_on.get(spec.key)),
                                   s.pending) for s in scheds]
        return routing.rank(cands, spec.slo_s)[0]

    return route


def reported_router(cluster: Cluster, rng: np.random.Generator) -> Router:
    """The Ray application's DeadlineRouter as it runs (daemon/routing.py ReportedRouting): the
    same rule, fed the forecast each node's daemon reports (controller/forecast.py node_forecast,
    its REPORT_MODELS most queued models) every REPORT_PERIOD_S, aged since, plus the requests of
    the model sent to the node after it."""
    scheds = [node.scheduler for node in cluster.nodes]
    table = routing.ReportedRouting()
    nodes = list(range(len(scheds)))
    taken_at = -math.inf

    def route(spec: ModelSpec, now: float) -> int:
        nonlocal taken_at
        if now - taken_at >= routing.REPORT_PERIOD_S:
            taken_at = now
            for i, s in enumerate(scheds):
                table.report(i, {**forecast.node_forecast(s, now, routing.REPORT_MODELS), "at": now})
        order = table.order(nodes, spec.name, now)
        i = order[0] if order else int(rng.integers(len(scheds)))
        table.sent_to(i, spec.name)
        return i

    return route


ROUTERS = {"random": random_router, "ray": ray_router, "deadline": deadline_router, "reported": reported_router}


def point(router: str, load: float, n_models: int, nodes: int, devices: int, budget_gib: float, seconds: float,
          seed: int) -> dict[str, Any]:
    ms = models(n_models, 5.0)
    popularity = loadgen.zipf_weights(n_models, 1.0)
    capacity = batched_capacity(ms, popularity, nodes * devices)
    sched = loadgen.poisson(load * capacity, seconds, n_models, popularity, seed=seed)
    cluster = Cluster(nodes, devices, ms, int(budget_gib * GIB), seed)
    cluster.warm(ms)
    specs = [ms[t][0] for t in sched.targets]
    rec = cluster.run(sched.times, specs, ROUTERS[router](cluster, np.random.default_rng(seed + 1)), drain_s=1.0)
    n = len(rec.arrival)
    counters = [node.scheduler.counters for node in cluster.nodes]
    admitted = sum(c["admitted"] for c in counters)
    return {"label": f"{router}, {load:.0%} of capacity", "router": router, "load": load,
            "offered_rps": n / seconds, "goodput_rps": float(rec.met.sum()) / seconds,
            "slo_attainment": float(rec.met.mean()) if n else float("nan"),
            "cold_start_rate": sum(c["cold_starts"] for c in counters) / max(admitted, 1),
            "loads": sum(c["loads"] for c in counters), "batched_capacity_rps": capacity, "requests": n}


def run(quick: bool = False, json_out: str | None = None, n_models: int = 10_000, nodes: int = 4, devices: int = 2,
        budget_gib: float = 16.0, seconds: float | None = None, seed: int = 0) -> dict[str, Any]:
    seconds = seconds or (0.5 if quick else 2.0)
    loads = [0.5, 0.7] if quick else [0.3, 0.5, 0.7, 0.9]
    rows = [point(r, load, n_models, nodes, devices, budget_gib, seconds, seed + i)
            for i, load in enumerate(loads) for r in ROUTERS]
    by_router = {r: {f"{row['load']:g}": row["slo_attainment"] for row in rows if row["router"] == r} for r in ROUTERS}
    at70 = {r: v.get("0.7") for r, v in by_router.items()}
    summary = {"slo_attainment_by_router": by_router,
               "deadline_minus_random_at_70pct_points": (at70["deadline"] - at70["random"]) * 100,
               "deadline_minus_ray_at_70pct_points": (at70["deadline"] - at70["ray"]) * 100,
               "reported_minus_random_at_70pct_points": (at70["reported"] - at70["random"]) * 100,
               "reported_minus_ray_at_70pct_points": (at70["reported"] - at70["ray"]) * 100,
               "cold_start_rate_by_router": {r: {f"{row['load']:g}": row["cold_start_rate"] for row in rows
                                                 if row["router"] == r} for r in ROUTERS}}
    config = {"command": command("routing", quick), "nodes": nodes, "devices_per_node": devices,
              "models": n_models, "weight_budget_gib_per_device": budget_gib, "seconds_virtual_per_point": seconds,
              "profiles": "Clockwork V100 (resnet18/50/152, se_resnext101) made 5x faster",
              "arrivals": "poisson, zipf(1.0) popularity; the same arrivals for every router at a load",
              "warm": "the most popular models spread round robin over every node's devices (90% of a budget)"}
    notes = ["Virtual time: every node runs the real scheduler and clockwork policy; only devices are simulated.",
             "deadline: the rule of daemon/routing.py on each node's controller state read at every arrival "
             "(rank). reported: the rule as the Ray application runs it (DeadlineRouter, daemon/routing.py "
             f"ReportedRouting), on each node's forecast reported every {routing.REPORT_PERIOD_S:g} s (the "
             "`forecast` op's node_forecast), aged since, plus the requests and the LOADs sent to the node after "
             "it; spreading those LOADs over the nodes is what puts it ahead of deadline, which sees fresher "
             "state but sends cold models wherever a LOAD would start first, often to the same node."]
    return results.write("routing", config, rows, summary, json_out, notes,
                         columns=["label", "offered_rps", "goodput_rps", "slo_attainment", "cold_start_rate", "loads",
                                  "requests"])
