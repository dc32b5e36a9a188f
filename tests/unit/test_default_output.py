"""A model's own default_output (config.toml): the answer, flagged, to a request of it that cannot
be answered by its deadline; every other failure stays an error (Clipper's default answers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from daemon.datatypes import BY_NAME
from daemon.errors import DeadlineExceeded, ModelConfigError, Unavailable
from daemon.model import ModelSpec, TensorSpec
from daemon.model_config import check_model_config
from daemon.request import InferenceRequest, RequestStatus
from tests.fakes import FakeGateway

FP32 = BY_NAME["FP32"]


def spec(default: tuple[float, ...] = (0.0, 0.0, 7.0), name: str = "m") -> ModelSpec:
    return ModelSpec(name, 1, Path(f"/nowhere/{name}"), "pt2", (TensorSpec("x", FP32, (-1, 2)),),
                     (TensorSpec("y", FP32, (-1, 3)),), 8, 0.1, default_output=default)


def request(gw: FakeGateway, s: ModelSpec, samples: int = 2) -> tuple[InferenceRequest, list[InferenceRequest]]:
    req = gw.new_request(s, (np.zeros((samples, 2), np.float32),), samples, 1000, None, "")
    done: list[InferenceRequest] = []
    req.on_finish = done.append
    gw.submit(req)
    return req, done


def test_a_request_dropped_at_its_deadline_gets_the_default_flagged() -> None:
    s = spec()
    gw = FakeGateway(s)
    gw.fake.hold = True
    req, done = request(gw, s)
    req.error, req.status = DeadlineExceeded("could not make its deadline"), RequestStatus.FAILED
    assert req.on_finish is not None
    req.on_finish(req)
    assert done == [req] and req.ok and req.defaulted and req.error is None
    np.testing.assert_array_equal(req.outputs[0], [[0, 0, 7], [0, 0, 7]])
    assert req.outputs[0].dtype == np.float32


def test_a_request_refused_at_once_as_hopeless_gets_the_default_at_once() -> None:
    s = spec()
    gw = FakeGateway(s)

    def hopeless(r: InferenceRequest) -> None:
        raise DeadlineExceeded("it cannot make its deadline")

    gw.fake.submit = hopeless  # type: ignore[method-assign]
    req, done = request(gw, s, samples=1)
    assert done == [req] and req.defaulted and req.outputs is not None and req.outputs[0].shape == (1, 3)


def test_other_failures_and_models_without_a_default_stay_errors() -> None:
    with_default, without = spec(), spec((), "plain")
    gw = FakeGateway(with_default, without)
    gw.fake.hold = True
    req, done = request(gw, with_default)
    req.error, req.status = Unavailable("the device failed"), RequestStatus.FAILED
    assert req.on_finish is not None
    req.on_finish(req)
    assert done == [req] and not req.ok and not req.defaulted
    req2, done2 = request(gw, without)
    req2.error, req2.status = DeadlineExceeded("late"), RequestStatus.FAILED
    assert req2.on_finish is not None
    req2.on_finish(req2)
    assert done2 == [req2] and isinstance(req2.error, DeadlineExceeded) and not req2.defaulted


def config(**extra: object) -> dict[str, object]:
    return {"max_batch_size": 4, "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}], **extra}


def test_the_config_checks_the_default() -> None:
    assert check_model_config(config(default_output=[0, 1, 2.5]), "m", 100)["default_output"] == (0.0, 1.0, 2.5)
    assert check_model_config(config(), "m", 100)["default_output"] == ()
    bad = [([1.0], "has 1 values"), ([0, 1, True], "list of numbers"), ("zeros", "list of numbers"),
           ([0, 0, 1e308], "does not fit FP32"), ([0, 0, float("nan")], "does not fit")]
    for value, needle in bad:
        with pytest.raises(ModelConfigError, match=needle):
            check_model_config(config(default_output=value), "m", 100)
    two = config(default_output=[0, 0, 0])
    two["outputs"] = [*two["outputs"], {"name": "z", "datatype": "FP32", "shape": [-1, 1]}]  # type: ignore[misc]
    with pytest.raises(ModelConfigError, match="one output"):
        check_model_config(two, "m", 100)
