"""The Ray Serve application (daemon/rayserve.py): skipped where ray[serve] is not installed.

The request translation is tested here without a cluster; the multi-node run (scale, affinity,
conformance through Serve's proxy, a replica killed mid-load) is `python -m bench run rayserve`,
and `test_rayserve_on_a_local_cluster` (slow, only with ESCAPEMENT_RAY_CLUSTER_TEST=1) runs its
quick version.
"""

from __future__ import annotations

import asyncio
import os
import warnings

import numpy as np
import orjson
import pytest

try:  # not installed (CI), or installed beside a protobuf its grpc reflection does not take
    with warnings.catch_warnings():  # ray's own deprecation warnings are not this suite's concern
        warnings.simplefilter("ignore")
        import ray.serve  # noqa: F401
except Exception as e:  # (protobuf raises its own VersionError, not an ImportError)
    pytest.skip(f"ray[serve] is not usable here: {type(e).__name__}: {e}", allow_module_level=True)

from daemon import rayserve


def test_json_infer_body_becomes_the_socket_message_with_deadline_and_priority() -> None:
    body = orjson.dumps({"id": "a", "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 2],
                                                "data": [1, 2]}],
                         "parameters": {"timeout": 5000, "priority": 2},
                         "outputs": [{"name": "OUTPUT__0", "parameters": {"binary_data": True}}]})
    msg, (binary, binary_all), client_id = rayserve.infer_message("m", None, body, None)
    assert msg["timeout_us"] == 5000 and msg["priority"] == 2 and msg["outputs"] == ["OUTPUT__0"]
    assert np.frombuffer(msg["inputs"][0]["data"], np.float32).tolist() == [1.0, 2.0]
    assert binary == {"OUTPUT__0": True} and not binary_all and client_id == "a"


def test_bad_bodies_are_400() -> None:
    for body in (b"{nope", orjson.dumps({"inputs": []}),
                 orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1]}]})):
        with pytest.raises(rayserve.Failed) as e:
            rayserve.infer_message("m", None, body, None)
        assert e.value.status == 400


def test_answer_as_json_or_binary() -> None:
    out = np.arange(3, dtype=np.float32).reshape(1, 3)
    answer = {"model": "m", "version": "1",
              "outputs": [{"name": "OUTPUT__0", "datatype": "FP32", "shape": [1, 3], "data": out.tobytes()}]}
    body, headers = rayserve.v2_answer(answer, ({}, False), None)
    assert orjson.loads(body)["outputs"][0]["data"] == [0.0, 1.0, 2.0] and rayserve.HEADER_LEN not in headers
    body, headers = rayserve.v2_answer(answer, ({}, True), None)
    n = int(headers[rayserve.HEADER_LEN])
    assert np.frombuffer(body[n:], np.float32).tolist() == [0.0, 1.0, 2.0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("ESCAPEMENT_RAY_CLUSTER_TEST"),
                    reason="a 3-node Ray cluster for about a minute: set ESCAPEMENT_RAY_CLUSTER_TEST=1")
def test_rayserve_on_a_local_cluster(tmp_path: object) -> None:
    from bench.scenarios import rayserve as scenario

    s = scenario.run(quick=True, json_out=str(tmp_path) + "/rayserve.json")["summary"]  # type: ignore[operator]
    assert s["conformance_ok"] and s["scale_1_to_2_ok"] and s["models_spread_ok"]
    assert s["killed_replica_hung"] == 0 and s["recovered_after_kill_ok"]


def test_deploy_config_validates_against_serve_schema() -> None:
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).parents[2] / "deploy/ray/serve.yaml"
    cfg = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = cfg.applications
    assert application.import_path == "daemon.rayserve:app" and application.args["models"]
    assert rayserve.app({k: str(v) for k, v in application.args.items()}) is not None  # builds without a cluster


class FakeReplica:
    """What DeadlineRouter reads of Serve's RunningReplica."""

    def __init__(self, replica_id: str, stats: dict[str, object]) -> None:
        self.replica_id = replica_id
        self.routing_stats = stats


class FakePending:
    def __init__(self, model: str) -> None:
        self.metadata = type("Metadata", (), {"multiplexed_model_id": model})()


def forecast(at: float, models: dict[str, list[float]], cold_s: float = 1.0) -> dict[str, object]:
    return {"at": at, "models": models, "cold_s": cold_s, "load_s": cold_s, "per_request_s": 0.01, "pending": 0,
            "devices": 1}


def test_deadline_router_ranks_replicas_by_their_forecasts() -> None:
    router = rayserve.DeadlineRouter.__new__(rayserve.DeadlineRouter)  # Serve builds it; the rule needs no Serve
    router.initialize_state()
    a = FakeReplica("a", forecast(100.0, {"m": [0.050, 0.100, 0.01]}))
    b = FakeReplica("b", forecast(100.0, {}, cold_s=0.001))
    ranks = asyncio.run(router.choose_replicas([b, a], FakePending("m")))  # type: ignore[list-item]
    assert [[r.replica_id for r in rank] for rank in ranks] == [["a"], ["b"]]  # the holder, with slack to spare
    ranks = asyncio.run(router.choose_replicas([b, a], FakePending("x")))  # type: ignore[list-item]
    assert ranks[0][0].replica_id == "b"  # held nowhere: the earliest cold start
    # requests of m sent after the report queue on a: 3 more at 10 ms each push it past the slack
    for _ in range(3):
        router.on_request_routed(FakePending("m"), "a", None)  # type: ignore[arg-type]
    b.routing_stats = forecast(100.0, {"m": [0.060, 0.100, 0.01]})
    ranks = asyncio.run(router.choose_replicas([a, b], FakePending("m")))  # type: ignore[list-item]
    assert [rank[0].replica_id for rank in ranks] == ["b", "a"]
    # a new report from a (taken after those requests) starts its count again
    a.routing_stats = forecast(100.1, {"m": [0.050, 0.100, 0.01]})
    ranks = asyncio.run(router.choose_replicas([a, b], FakePending("m")))  # type: ignore[list-item]
    assert ranks[0][0].replica_id == "a"


def test_an_unknown_router_is_refused() -> None:
    with pytest.raises(ValueError, match="router must be one of"):
        rayserve.build("models", router="fastest")
