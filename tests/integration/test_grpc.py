"""The gRPC frontend against a real daemon: the unmodified tritonclient[grpc], sync and asyncio,
through the checks the HTTP frontend passes (tests/integration/test_http.py)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.grpc.aio as tga
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

from daemon.parity.datasets import digits_split
from tests.integration.test_http import reference, torch_digits_reference
from tests.support import ALL_TYPES, DaemonThread, settings, short_tmpdir


@pytest.fixture(scope="module")
def demo_grpc(demo_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(demo_repo, d, server={"grpc": "127.0.0.1:0"})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def test_grpc(test_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, server={"grpc": "127.0.0.1:0", "max_body_bytes": 256 * 1024})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def test_tritonclient_sync_health_metadata_config_and_infer(demo_grpc: DaemonThread, demo_repo: Path) -> None:
    c = tg.InferenceServerClient(demo_grpc.grpc)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("digits_mlp")
    assert c.is_model_ready("digits_mlp", "1")
    server = c.get_server_metadata(as_json=True)
    assert server["name"] == "escapement" and "model_repository" in server["extensions"]
    meta = c.get_model_metadata("digits_mlp", as_json=True)
    assert meta["inputs"] == [{"name": "INPUT__0", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert meta["versions"] == ["1"] and meta["platform"]
    cfg = c.get_model_config("digits_mlp", as_json=True)["config"]
    assert cfg["max_batch_size"] == 32 and cfg["input"][0]["data_type"] == "TYPE_FP32"
    _, _, x, _ = digits_split()
    x = x[:5]
    want = torch_digits_reference(demo_repo, x)
    inp = tg.InferInput("INPUT__0", [5, 64], "FP32")
    inp.set_data_from_numpy(x)
    r = c.infer("digits_mlp", [inp], outputs=[tg.InferRequestedOutput("OUTPUT__0")], request_id="abc")
    np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), want, rtol=1e-5, atol=1e-5)
    assert r.get_response().id == "abc" and r.get_response().model_version == "1"
    r = c.infer("digits_mlp", [inp], model_version="1")  # no outputs named: all of them
    np.testing.assert_allclose(r.as_numpy("OUTPUT__0"), want, rtol=1e-5, atol=1e-5)
    stats = c.get_inference_statistics("digits_mlp", as_json=True)["model_stats"]
    assert stats[0]["name"] == "digits_mlp" and int(stats[0]["inference_count"]) >= 10
    c.close()


def test_tritonclient_errors_map_to_grpc_codes(demo_grpc: DaemonThread) -> None:
    c = tg.InferenceServerClient(demo_grpc.grpc)
    inp = tg.InferInput("INPUT__0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), np.float32))
    cases = [
        (dict(model_name="digits_mlp", timeout=1), "StatusCode.DEADLINE_EXCEEDED", "deadline cannot be met"),
        (dict(model_name="nope"), "StatusCode.NOT_FOUND", "unknown model 'nope'"),
        (dict(model_name="digits_mlp", model_version="7"), "StatusCode.NOT_FOUND", "has no version 7"),
    ]
    for kwargs, status, message in cases:
        with pytest.raises(InferenceServerException, match=message) as e:
            c.infer(inputs=[inp], **kwargs)
        assert e.value.status() == status
    bad = tg.InferInput("INPUT__0", [1, 63], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 63), np.float32))
    with pytest.raises(InferenceServerException, match=r"shape \[1, 63\] does not match") as e:
        c.infer("digits_mlp", [bad])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        c.get_model_metadata("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    r = c.infer("digits_mlp", [inp], client_timeout=30)  # a gRPC deadline (tests/protocol: it is the request's)
    assert r.as_numpy("OUTPUT__0").shape == (1, 10)
    assert c.is_server_live()  # nothing above hurt the server
    c.close()


def test_tritonclient_aio_concurrent(demo_grpc: DaemonThread) -> None:
    _, _, x, y = digits_split()

    async def main() -> list[np.ndarray]:
        c = tga.InferenceServerClient(demo_grpc.grpc)
        try:
            assert await c.is_server_ready() and await c.is_model_ready("digits_mlp")

            async def one(i: int) -> np.ndarray:
                inp = tga.InferInput("INPUT__0", [1, 64], "FP32")
                inp.set_data_from_numpy(x[i : i + 1])
                return (await c.infer("digits_mlp", [inp])).as_numpy("OUTPUT__0")
            return await asyncio.gather(*(one(i) for i in range(200)))
        finally:
            await c.close()

    outs = asyncio.run(main())
    pred = np.concatenate(outs).argmax(1)
    assert (pred == y[:200]).mean() > 0.9  # real, trained models answer correctly under concurrency


def test_every_datatype_raw_and_typed(test_grpc: DaemonThread) -> None:
    vals = {"BOOL": [[True, False, True]], "UINT8": [[1, 0, 255]], "INT32": [[1, -2, 3]], "INT64": [[5, 6, -7]],
            "FP16": [[1.5, 0.0, -2.0]], "FP64": [[1.0, 2.0, 3.0]]}
    c = tg.InferenceServerClient(test_grpc.grpc)
    tin = []
    for n, dt, t in ALL_TYPES:
        i = tg.InferInput(n, [1, 3], dt)
        i.set_data_from_numpy(np.array(vals[dt], dtype=torch.empty(0, dtype=t).numpy().dtype))
        tin.append(i)
    r = c.infer("all_types", tin)
    assert r.as_numpy("out_a").tolist() == [[False, True, False]]
    assert r.as_numpy("out_b").tolist() == [[2, 1, 0]]  # uint8 wraps
    assert r.as_numpy("out_e").dtype == np.float16 and r.as_numpy("out_e").tolist() == [[3.0, 0.0, -4.0]]
    assert r.as_numpy("out_f").tolist() == [[0.5, 1.0, 1.5]]
    c.close()
    # typed contents (FP16 has no typed field: raw only, as in Triton)
    fields = {"BOOL": "bool_contents", "UINT8": "uint_contents", "INT32": "int_contents",
              "INT64": "int64_contents", "FP64": "fp64_contents"}
    with grpc.insecure_channel(test_grpc.grpc) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        req = pb.ModelInferRequest(model_name="all_types")
        raws = []
        for n, dt, t in ALL_TYPES:
            inp = req.inputs.add(name=n, datatype=dt, shape=[1, 3])
            if dt in fields:
                getattr(inp.contents, fields[dt]).extend(np.array(vals[dt]).ravel().tolist())
            raws.append(np.array(vals[dt], dtype=torch.empty(0, dtype=t).numpy().dtype).tobytes())
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "FP16 data must come in raw_input_contents" in e.value.details()
        req.inputs[4].datatype = "FP64"  # send e as typed FP64: refused, the model takes FP16
        req.inputs[4].contents.fp64_contents.extend([1.0, 2.0, 3.0])
        with pytest.raises(grpc.RpcError, match="does not match the model's FP16"):
            stub.ModelInfer(req)
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        typed = pb.ModelInferRequest(model_name="tiny_pt2")
        typed.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(x.ravel())
        resp = stub.ModelInfer(typed)
        out = np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(1, 3)
        np.testing.assert_allclose(out, reference(x), rtol=1e-5)
        wrong = pb.ModelInferRequest(model_name="tiny_pt2")
        wrong.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4]).contents.int_contents.extend([1, 2, 3, 4])
        with pytest.raises(grpc.RpcError, match=r"belongs in contents\.fp32_contents"):
            stub.ModelInfer(wrong)
        both = pb.ModelInferRequest(model_name="tiny_pt2", raw_input_contents=[x.tobytes(), x.tobytes()])
        both.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4])
        with pytest.raises(grpc.RpcError, match="raw_input_contents has 2 entries for 1 inputs"):
            stub.ModelInfer(both)
        big = pb.ModelInferRequest(model_name="tiny_pt2", raw_input_contents=[bytes(300 * 1024)])
        big.inputs.add(name="INPUT__0", datatype="FP32", shape=[1, 4])
        with pytest.raises(grpc.RpcError) as e:  # over server.max_body_bytes: grpcio refuses the message
            stub.ModelInfer(big)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_repository_index_load_unload(test_grpc: DaemonThread) -> None:
    c = tg.InferenceServerClient(test_grpc.grpc)
    index = {(m["name"], m.get("version")): m for m in c.get_model_repository_index(as_json=True)["models"]}
    assert index[("tiny_pt2", "1")]["state"] == "READY"
    assert "cannot load model.pt2" in index[("garbage", "1")]["reason"]
    assert "no config.toml" in index[("no_config", None)]["reason"]
    c.unload_model("tiny_ts")
    assert not c.is_model_ready("tiny_ts")
    with pytest.raises(InferenceServerException) as e:
        c.infer("tiny_ts", [])
    c.load_model("tiny_ts")
    assert c.is_model_ready("tiny_ts") and c.is_model_ready("tiny_ts", "2")
    with pytest.raises(InferenceServerException, match="not in the model repository") as e:
        c.load_model("nope")
    assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="carrying a config") as e:
        c.load_model("tiny_ts", config='{"max_batch_size": 4}')
    assert e.value.status() == "StatusCode.UNIMPLEMENTED"
    c.close()


@pytest.mark.expect_errors("is not served")
def test_management_needs_the_token_when_one_is_set(test_repo: Path) -> None:
    d = short_tmpdir()
    token = "t" * 32
    dt = DaemonThread(settings(test_repo, d, server={"grpc": "127.0.0.1:0", "http": "", "admin_token": token}))
    dt.start()
    try:
        c = tg.InferenceServerClient(dt.grpc)
        with pytest.raises(InferenceServerException, match="Bearer") as e:
            c.unload_model("tiny_pt2")
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        c.load_model("tiny_pt2", headers={"authorization": f"Bearer {token}"})
        assert c.is_model_ready("tiny_pt2")
        c.close()
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.expect_errors("is not served")
def test_a_shutdown_answers_the_grpc_requests_it_accepted(test_repo: Path) -> None:
    from daemon.runtime.faults import FaultSpec

    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, server={"grpc": "127.0.0.1:0", "http": ""}))
    dt.start()
    try:
        dt.call(dt.daemon.gateway.set_fault, "cpu:0", FaultSpec(add_ms=300))  # each INFER takes 300 ms more
        x = np.ones((1, 4), np.float32)

        async def main() -> np.ndarray:
            c = tga.InferenceServerClient(dt.grpc)
            try:
                inp = tga.InferInput("INPUT__0", [1, 4], "FP32")
                inp.set_data_from_numpy(x)
                call = asyncio.ensure_future(c.infer("tiny_pt2", [inp], timeout=5_000_000))
                accepted = asyncio.run_coroutine_threadsafe(
                    dt.daemon.controller.until(lambda s: s.pending > 0), dt.loop)
                await asyncio.wrap_future(accepted)  # the daemon holds it: now stop the daemon
                assert dt.loop is not None
                dt.loop.call_soon_threadsafe(dt.daemon.request_stop)
                return (await call).as_numpy("OUTPUT__0")
            finally:
                await c.close()

        np.testing.assert_allclose(asyncio.run(main()), reference(x), rtol=1e-5)
    finally:
        dt.stop()
        shutil.rmtree(d, ignore_errors=True)
