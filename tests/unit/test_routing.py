"""The cross-node routing simulation: several nodes on one virtual clock, each request answered
once, and each router choosing as it says (bench/scenarios/routing.py)."""

from __future__ import annotations

import numpy as np

from bench import loadgen
from bench.scenarios import routing
from bench.scenarios.scale import models
from daemon.controller import forecast

GIB = 2**30


def _cluster(n_models: int = 40) -> tuple[routing.Cluster, list]:
    ms = models(n_models, 5.0)
    cluster = routing.Cluster(3, 1, ms, 2 * GIB, seed=0)
    cluster.warm(ms)
    return cluster, ms


def test_every_request_is_answered_once_whatever_the_router() -> None:
    for name, make in routing.ROUTERS.items():
        cluster, ms = _cluster()
        sched = loadgen.poisson(300.0, 0.3, len(ms), loadgen.zipf_weights(len(ms)), seed=1)
        rec = cluster.run(sched.times, [ms[t][0] for t in sched.targets], make(cluster, np.random.default_rng(0)),
                          drain_s=2.0)
        assert not np.isnan(rec.finish).any(), name  # every request finished, on some node
        assert (rec.status == 200).mean() > 0.9, name
        assert sum(n.scheduler.pending for n in cluster.nodes) == 0, name


def test_ray_and_deadline_routers_send_a_model_to_the_node_holding_it() -> None:
    cluster, ms = _cluster()
    spec = ms[0][0]  # the most popular model: warmed onto node 0 only
    holder = [i for i, n in enumerate(cluster.nodes) if n.scheduler.ready_on.get(spec.key)]
    assert holder == [0]
    ray = routing.ray_router(cluster, np.random.default_rng(0))
    deadline = routing.deadline_router(cluster, np.random.default_rng(0))
    assert {ray(spec, 0.0) for _ in range(20)} == {0}
    assert deadline(spec, 0.0) == 0
    # a node that must first load the model predicts a later finish than the idle node holding it
    assert forecast.predicted_finish(cluster.nodes[1].scheduler, spec, 0.0) > \
        forecast.predicted_finish(cluster.nodes[0].scheduler, spec, 0.0)


def test_the_reported_router_reads_each_nodes_forecast() -> None:
    cluster, ms = _cluster()
    spec = ms[0][0]
    reports = [forecast.node_forecast(n.scheduler, 0.0, 1024) for n in cluster.nodes]
    assert spec.name in reports[0]["models"] and spec.name not in reports[1]["models"]
    finish, slo, row = reports[0]["models"][spec.name]
    assert 0.0 < finish < slo == spec.slo_s and row > 0.0  # idle and holding it: one run away
    assert reports[1]["cold_s"] > finish  # elsewhere a LOAD first
    assert len(forecast.node_forecast(cluster.nodes[0].scheduler, 0.0, 1)["models"]) == 1
    reported = routing.reported_router(cluster, np.random.default_rng(0))
    assert reported(spec, 0.0) == 0
