from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from daemon.api.codec import WireTensor, assemble_inputs, select_outputs, tensor_bytes
from daemon.datatypes import BY_NAME
from daemon.errors import BadRequest
from daemon.model import ModelSpec, TensorSpec

FP32 = BY_NAME["FP32"]
SPEC = ModelSpec("m", 1, Path("/x"), "pt2",
                 (TensorSpec("a", FP32, (-1, 2, 2)), TensorSpec("b", BY_NAME["INT32"], (-1, 3))),
                 (TensorSpec("y", FP32, (-1, 1)), TensorSpec("z", FP32, (-1, 1))), 4, 0.1)


def good(n: int = 2) -> list[WireTensor]:
    a = np.arange(n * 4, dtype="<f4")
    return [WireTensor("a", "FP32", [n, 2, 2], raw=a.tobytes()),
            WireTensor("b", "INT32", [n, 3], data=[[1, 2, 3]] * n)]


def test_binary_and_json_inputs_in_model_order() -> None:
    (a, b), n = assemble_inputs(SPEC, list(reversed(good())))
    assert n == 2
    assert a.shape == (2, 2, 2) and a.dtype == np.float32 and a[1, 1, 1] == 7
    assert b.shape == (2, 3) and b.dtype == np.int32 and b.tolist() == [[1, 2, 3]] * 2


def test_flat_json_data_is_accepted() -> None:
    t = good()
    t[1] = WireTensor("b", "INT32", [2, 3], data=[1, 2, 3, 4, 5, 6])
    (_, b), _ = assemble_inputs(SPEC, t)
    assert b.tolist() == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda t: t.pop(), "missing input 'b'"),
    (lambda t: t.append(WireTensor("c", "FP32", [2, 1], data=[1, 2])), "unexpected input 'c'"),
    (lambda t: t.append(t[0]), "given twice"),
    (lambda t: setattr(t[0], "datatype", "FP64"), "datatype FP64 does not match the model's FP32"),
    (lambda t: setattr(t[0], "datatype", "FLOAT"), "FLOAT (unknown datatype)"),
    (lambda t: setattr(t[0], "shape", [2, 4]), "shape [2, 4] does not match the model's [-1, 2, 2]"),
    (lambda t: setattr(t[0], "shape", [0, 2, 2]), "batch of 0 is outside 1..4"),
    (lambda t: setattr(t[0], "shape", [5, 2, 2]), "batch of 5 is outside 1..4"),
    (lambda t: setattr(t[0], "raw", b"\0" * 15), "15 bytes of data, but shape [2, 2, 2] of FP32 needs 32"),
    (lambda t: setattr(t[1], "shape", [1, 3]), "disagree on the batch size"),
    (lambda t: setattr(t[1], "data", None), "no data"),
    (lambda t: setattr(t[1], "data", "123"), "data must be a list"),
    (lambda t: setattr(t[1], "data", [[1, 2], [3]]), "not a regular array"),
    (lambda t: setattr(t[1], "data", [1, 2, 3]), "3 values of data, but its shape needs 6"),
    (lambda t: setattr(t[1], "data", ["a"] * 6), "must be numbers"),
    (lambda t: setattr(t[1], "data", [1.5] * 6), "must be integers"),
    (lambda t: setattr(t[1], "data", [2**40] * 6), "out of range for INT32"),
])
def test_bad_inputs_get_clear_errors(mutate: Callable[[list[WireTensor]], object], needle: str) -> None:
    tensors = good()
    mutate(tensors)
    with pytest.raises(BadRequest) as exc:
        assemble_inputs(SPEC, tensors)
    assert needle in exc.value.message


def test_bool_json_needs_booleans() -> None:
    spec = ModelSpec("m", 1, Path("/x"), "pt2", (TensorSpec("a", BY_NAME["BOOL"], (-1, 2)),),
                     (TensorSpec("y", FP32, (-1, 1)),), 4, 0.1)
    (a,), _ = assemble_inputs(spec, [WireTensor("a", "BOOL", [1, 2], data=[True, False])])
    assert a.dtype == np.bool_ and a.tolist() == [[True, False]]
    with pytest.raises(BadRequest, match="true/false"):
        assemble_inputs(spec, [WireTensor("a", "BOOL", [1, 2], data=[1, 0])])


def test_output_selection() -> None:
    assert select_outputs(SPEC, None) == [0, 1]
    assert select_outputs(SPEC, ["z"]) == [1]
    with pytest.raises(BadRequest, match="unknown output 'q'"):
        select_outputs(SPEC, ["q"])
    with pytest.raises(BadRequest, match="twice"):
        select_outputs(SPEC, ["y", "y"])


def test_tensor_bytes_are_little_endian_row_major() -> None:
    a = np.arange(6, dtype=">i4").reshape(2, 3).T  # big-endian and not contiguous
    assert tensor_bytes(a) == np.ascontiguousarray(a).astype("<i4").tobytes()
