"""Keep-warm's replay of the socket path (api/uds.py Rehearsal), bytes in, nothing out: what it
keeps, what it never keeps, and that a replay leaves no trace (no request submitted, nothing
written, nothing counted)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from daemon.api.uds import REHEARSE_MAX_BYTES, SocketConnection, SocketFrontend
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.gateway import Gateway
from daemon.model import ModelSpec, TensorSpec
from daemon.request import InferenceRequest, RequestStatus
from tests.fakes import FakeTransport

FP32 = BY_NAME["FP32"]
SPEC = ModelSpec("sum", 1, Path("/x"), "pt2", (TensorSpec("x", FP32, (-1, 3)),), (TensorSpec("y", FP32, (-1, 1)),),
                 64 * 1024, 0.1)
# the same with a BYTES output (strings: their array's nbytes counts pointers)
WORDS = ModelSpec("words", 1, Path("/x"), "pt2", (TensorSpec("x", FP32, (-1, 3)),),
                  (TensorSpec("y", BY_NAME["BYTES"], (-1, 1)),), 8, 0.1)


class Controller:
    """Answers every request at once (row sums, or for WORDS a long string a row), counting them."""

    def __init__(self) -> None:
        self.submitted = 0

    def submit(self, req: InferenceRequest) -> None:
        self.submitted += 1
        y = req.inputs[0].sum(axis=1, keepdims=True)
        if req.model is WORDS:
            y = np.array([[b"w" * (REHEARSE_MAX_BYTES + 1)] for _ in range(len(y))], dtype=object)
        req.outputs = (y,)
        req.status = RequestStatus.SUCCEEDED
        req.on_finish(req)

    def cancel(self, req: InferenceRequest) -> None:
        pass


class Setup:
    def __init__(self, enabled: bool = True) -> None:
        self.catalog = ModelCatalog()
        self.catalog.add(SPEC, ModelState.READY)
        self.catalog.add(WORDS, ModelState.READY)
        self.ctl = Controller()
        self.gw = Gateway(settings_from_dict({"server": {"max_body_bytes": 4 * 2**20}}), self.catalog, self.ctl)
        self.frontend = SocketFrontend(self.gw)
        self.rehearsal = self.frontend.rehearsal
        self.rehearsal.enabled = enabled
        self.conn = SocketConnection(self.frontend)
        self.t = FakeTransport()
        self.conn.connection_made(self.t)  # type: ignore[arg-type]

    def send(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        payload = msgpack.packb(obj, use_bin_type=True)
        self.conn.data_received(struct.pack(">I", len(payload)) + payload)
        return self.t.frames()


def infer(req_id: int, rows: int = 1, model: str = "sum", **extra: Any) -> dict[str, Any]:
    x = np.arange(rows * 3, dtype="<f4").reshape(rows, 3)
    return {"op": "infer", "id": req_id, "model": model,
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [rows, 3], "data": x.tobytes()}], **extra}


def test_a_replay_decodes_and_encodes_again_and_leaves_no_trace() -> None:
    s = Setup()
    (answer,) = s.send(infer(7, rows=2))
    assert answer["status"] == 200 and s.ctl.submitted == 1
    assert s.rehearsal.frame is not None and s.rehearsal.answer is not None
    shed, held = s.gw.overload.shed, s.gw.request_memory.held
    for _ in range(3):
        assert s.rehearsal.replay()
    assert s.ctl.submitted == 1  # nothing submitted
    assert s.t.frames() == []  # nothing sent
    assert (s.gw.overload.shed, s.gw.request_memory.held) == (shed, held)
    (answer,) = s.send(infer(8))  # the connection goes on as before
    assert answer["id"] == 8 and answer["status"] == 200


def test_nothing_is_kept_unless_enabled() -> None:
    s = Setup(enabled=False)
    s.send(infer(1))
    assert s.rehearsal.frame is None and s.rehearsal.answer is None
    assert not s.rehearsal.replay()


def test_a_frame_over_the_bound_is_not_kept() -> None:
    s = Setup()
    rows = REHEARSE_MAX_BYTES // 12 + 1  # 12 bytes a row: the inputs alone are over it
    (answer,) = s.send(infer(1, rows=rows))
    assert answer["status"] == 200
    assert s.rehearsal.frame is None
    # (its answer, 4 bytes a row, is under the bound and kept; with no frame nothing replays)
    assert not s.rehearsal.replay()
    assert s.rehearsal.answer is None  # forgotten with the frame it had none of


def test_an_answer_over_the_bound_or_of_strings_is_not_kept() -> None:
    s = Setup()
    (answer,) = s.send(infer(1, model="words"))
    assert answer["status"] == 200 and len(answer["outputs"][0]["data"]) > REHEARSE_MAX_BYTES
    assert s.rehearsal.frame is not None and s.rehearsal.answer is None
    assert not s.rehearsal.replay()
    rows = REHEARSE_MAX_BYTES // 4 + 1  # the answer over the bound, its frame (12 bytes a row) too
    s.send(infer(2, rows=rows))
    assert s.rehearsal.answer is None


def test_a_frame_naming_shared_memory_is_never_kept() -> None:
    s = Setup()
    s.send(infer(1))
    plain = s.rehearsal.frame
    (answer,) = s.send({"op": "infer", "id": 2, "model": "sum",
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3],
                                    "parameters": {"shared_memory_region": "nope", "shared_memory_byte_size": 12}}]})
    assert answer["status"] == 404  # no such region: refused, and not kept either way
    assert s.rehearsal.frame == plain
    assert s.rehearsal.replay()


def test_a_frame_whose_model_went_away_is_forgotten() -> None:
    s = Setup()
    s.send(infer(1))
    s.catalog.remove("sum", 1)
    assert not s.rehearsal.replay()
    assert s.rehearsal.frame is None and s.rehearsal.answer is None


def test_no_replay_while_the_loop_is_overloaded() -> None:
    s = Setup()
    s.send(infer(1))
    o = s.gw.overload
    o.threshold_s = 0.05  # (as the default setting: a loop 10 s behind is overloaded)
    o.last_s = o.lag_s = 10.0
    assert o.overloaded
    assert not s.rehearsal.replay()
    assert s.gw.overload.shed == 0 and s.rehearsal.frame is not None
