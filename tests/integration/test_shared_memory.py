"""Shared-memory tensors against a real daemon: the unmodified tritonclient shared-memory utilities
with tritonclient.http and tritonclient.grpc, and the socket client; results equal to the path
that sends the bytes. Every region check's error, with its HTTP status and gRPC code.

The HTTP and socket tests run again through frontend workers (test_frontend_workers.py imports
them), where the controller process answers what names a region."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from daemon.client import InferenceServerError, ShmInput, ShmOutput, SocketClient
from daemon.parity.datasets import digits_split
from tests.integration.test_http import raw, torch_digits_reference
from tests.support import DaemonThread, settings, short_tmpdir

_ids = itertools.count()
IN_BYTES = 5 * 64 * 4
OUT_BYTES = 5 * 10 * 4


def _key(what: str) -> str:
    return f"/escapement-test-{os.getpid()}-{what}-{next(_ids)}"


@pytest.fixture
def regions() -> Iterator[list[shm.SharedMemoryRegion]]:
    """tritonclient's regions made by a test, destroyed after it (the objects unlinked)."""
    made: list[shm.SharedMemoryRegion] = []
    yield made
    for h in made:
        shm.destroy_shared_memory_region(h)


def _region(made: list[shm.SharedMemoryRegion], name: str, size: int) -> tuple[shm.SharedMemoryRegion, str]:
    key = _key(name)
    h = shm.create_shared_memory_region(name, key, size)
    made.append(h)
    return h, key


@pytest.fixture(scope="module")
def grpc_daemon(demo_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(demo_repo, d, server={"grpc": "127.0.0.1:0"})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


def _digits() -> np.ndarray:
    _, _, x, _ = digits_split()
    return np.ascontiguousarray(x[:5])


def test_tritonclient_http_inputs_and_outputs_in_shared_memory(demo_daemon: DaemonThread, demo_repo: Path,
                                                                regions: list[shm.SharedMemoryRegion]) -> None:
    c = th.InferenceServerClient(demo_daemon.http)
    assert "system_shared_memory" in c.get_server_metadata()["extensions"]
    x = _digits()
    want = torch_digits_reference(demo_repo, x)
    hin, kin = _region(regions, "h_in", IN_BYTES + 64)
    hout, kout = _region(regions, "h_out", OUT_BYTES + 128)
    shm.set_shared_memory_region(hin, [x], offset=64)
    c.register_system_shared_memory("h_in", kin, IN_BYTES, offset=64)
    c.register_system_shared_memory("h_out", kout, OUT_BYTES + 128)
    try:
        status = c.get_system_shared_memory_status()
        assert {"name": "h_in", "key": kin, "offset": 64, "byte_size": IN_BYTES} in status
        assert c.get_system_shared_memory_status("h_out") == [
            {"name": "h_out", "key": kout, "offset": 0, "byte_size": OUT_BYTES + 128}]
        inp = th.InferInput("INPUT__0", [5, 64], "FP32")
        inp.set_shared_memory("h_in", IN_BYTES)
        out = th.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("h_out", OUT_BYTES, offset=128)
        r = c.infer("digits_mlp", [inp], outputs=[out])
        o = r.get_output("OUTPUT__0")
        assert o["parameters"] == {"shared_memory_region": "h_out", "shared_memory_byte_size": OUT_BYTES,
                                   "shared_memory_offset": 128}
        assert "data" not in o  # the bytes are in the region only
        got = shm.get_contents_as_numpy(hout, np.float32, o["shape"], offset=128)
        plain = th.InferInput("INPUT__0", [5, 64], "FP32")
        plain.set_data_from_numpy(x)
        same = c.infer("digits_mlp", [plain]).as_numpy("OUTPUT__0")
        np.testing.assert_array_equal(got, same)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # input from shared memory, output as binary bytes: mixed is fine
        r = c.infer("digits_mlp", [inp])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT__0"), same)
    finally:
        c.unregister_system_shared_memory("h_in")
        c.unregister_system_shared_memory()
    assert c.get_system_shared_memory_status() == []
    c.close()


def test_tritonclient_grpc_inputs_and_outputs_in_shared_memory(grpc_daemon: DaemonThread, demo_repo: Path,
                                                                regions: list[shm.SharedMemoryRegion]) -> None:
    c = tg.InferenceServerClient(grpc_daemon.grpc)
    assert "system_shared_memory" in c.get_server_metadata(as_json=True)["extensions"]
    x = _digits()
    hin, kin = _region(regions, "g_in", IN_BYTES)
    hout, kout = _region(regions, "g_out", OUT_BYTES)
    shm.set_shared_memory_region(hin, [x])
    c.register_system_shared_memory("g_in", kin, IN_BYTES)
    c.register_system_shared_memory("g_out", kout, OUT_BYTES)
    try:
        status = c.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["g_in"] == {"name": "g_in", "key": kin, "byte_size": str(IN_BYTES)}
        inp = tg.InferInput("INPUT__0", [5, 64], "FP32")
        inp.set_shared_memory("g_in", IN_BYTES)
        out = tg.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("g_out", OUT_BYTES)
        r = c.infer("digits_mlp", [inp], outputs=[out])
        o = r.get_output("OUTPUT__0")
        assert o.parameters["shared_memory_region"].string_param == "g_out"
        assert o.parameters["shared_memory_byte_size"].int64_param == OUT_BYTES
        got = shm.get_contents_as_numpy(hout, np.float32, list(o.shape))
        plain = tg.InferInput("INPUT__0", [5, 64], "FP32")
        plain.set_data_from_numpy(x)
        np.testing.assert_array_equal(got, c.infer("digits_mlp", [plain]).as_numpy("OUTPUT__0"))
        np.testing.assert_allclose(got, torch_digits_reference(demo_repo, x), rtol=1e-5, atol=1e-5)
        # errors map to gRPC codes
        cases = [
            (lambda: c.register_system_shared_memory("g_in", kin, IN_BYTES), "StatusCode.ALREADY_EXISTS",
             "already registered"),
            (lambda: c.register_system_shared_memory("g_x", "/escapement-no-such-key", 8), "StatusCode.NOT_FOUND",
             "no shared-memory object"),
            (lambda: c.register_system_shared_memory("g_x", kin, IN_BYTES + 1), "StatusCode.INVALID_ARGUMENT",
             "runs past the end of the object"),
            (lambda: c.unregister_system_shared_memory("g_nope"), "StatusCode.NOT_FOUND", "no shared-memory region"),
        ]
        for call, code, message in cases:
            with pytest.raises(InferenceServerException, match=message) as e:
                call()
            assert e.value.status() == code
        bad = tg.InferInput("INPUT__0", [5, 64], "FP32")
        bad.set_shared_memory("g_in", IN_BYTES, offset=4)
        with pytest.raises(InferenceServerException, match="runs past the end of region 'g_in'") as e:
            c.infer("digits_mlp", [bad])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        c.unregister_system_shared_memory()
    assert c.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
    c.close()


def _post(d: DaemonThread, path: str, body: bytes = b"") -> tuple[int, str]:
    import orjson

    status, _, data = raw(d, "POST", path, body)
    return status, (orjson.loads(data).get("error", "") if data else "")


def test_every_region_check_has_a_clear_error(demo_daemon: DaemonThread,
                                              regions: list[shm.SharedMemoryRegion]) -> None:
    import orjson

    d = demo_daemon
    h, key = _region(regions, "e_in", IN_BYTES)
    shm.set_shared_memory_region(h, [_digits()])
    reg = "/v2/systemsharedmemory/region/{}/register"

    def register(name: str, **body: object) -> tuple[int, str]:
        return _post(d, reg.format(name), orjson.dumps(body))

    assert register("e_in", key=key, offset=0, byte_size=IN_BYTES) == (200, "")
    try:
        cases = [
            (register("e_in", key=key, offset=0, byte_size=8), 409, "already registered"),
            (register("e_x", key="/escapement-no-such-key", byte_size=8), 404, "no shared-memory object"),
            (register("e_x", key=key, offset=IN_BYTES - 4, byte_size=8), 400, "runs past the end of the object"),
            (register("e_x", key=key, offset=-1, byte_size=8), 400, "offset must be a non-negative integer"),
            (register("e_x", key=key, byte_size=0), 400, "byte_size must be at least 1"),
            (register("e_x", key="/../etc/passwd", byte_size=8), 400, "not a POSIX shared-memory name"),
            (register("e_x", key="a/b", byte_size=8), 400, "not a POSIX shared-memory name"),
            (register("e_x", key="/..", byte_size=8), 400, "not a POSIX shared-memory name"),
            (_post(d, "/v2/systemsharedmemory/region/e_nope/unregister"), 404, "no shared-memory region"),
        ]
        for (status, message), want_status, want in cases:
            assert status == want_status and want in message, (status, message, want)
        status, _, body = raw(d, "GET", "/v2/systemsharedmemory/region/e_nope/status")
        assert status == 404 and b"no shared-memory region named 'e_nope'" in body

        def infer(inputs: list[dict[str, object]], outputs: list[dict[str, object]] | None = None) -> tuple[int, str]:
            req: dict[str, object] = {"inputs": inputs}
            if outputs is not None:
                req["outputs"] = outputs
            return _post(d, "/v2/models/digits_mlp/infer", orjson.dumps(req))

        def inp(shape: list[int], dt: str = "FP32", **p: object) -> dict[str, object]:
            return {"name": "INPUT__0", "datatype": dt, "shape": shape, "parameters": p}

        ok = {"shared_memory_region": "e_in", "shared_memory_byte_size": IN_BYTES}
        assert infer([inp([5, 64], **ok)])[0] == 200
        cases = [
            (infer([inp([5, 64], shared_memory_region="e_nope", shared_memory_byte_size=8)]), 404,
             "no shared-memory region named 'e_nope'"),
            (infer([inp([5, 64], **ok, shared_memory_offset=4)]), 400, "runs past the end of region 'e_in'"),
            (infer([inp([4, 64], **ok)]), 400, f"{IN_BYTES} bytes of data, but shape [4, 64] of FP32 needs"),
            (infer([inp([5, 64], "FP64", **ok)]), 400, "datatype FP64"),
            (infer([inp([5, 64], shared_memory_region="e_in")]), 400, "shared_memory_byte_size is required"),
            (infer([inp([5, 64], shared_memory_byte_size=8)]), 400, "without shared_memory_region"),
            (infer([inp([5, 64], **ok)], [{"name": "OUTPUT__0", "parameters": ok | {"shared_memory_byte_size": 8}}]),
             400, "200 bytes do not fit the 8 bytes given in region 'e_in'"),
        ]
        for (status, message), want_status, want in cases:
            assert status == want_status and want in message, (status, message, want)
    finally:
        assert _post(d, "/v2/systemsharedmemory/unregister")[0] == 200


def test_socket_client_shared_memory(demo_daemon: DaemonThread, regions: list[shm.SharedMemoryRegion]) -> None:
    x = _digits()
    hin, kin = _region(regions, "s_in", IN_BYTES)
    hout, kout = _region(regions, "s_out", OUT_BYTES)
    shm.set_shared_memory_region(hin, [x])
    with SocketClient(demo_daemon.socket) as c:
        c.register_shared_memory("s_in", kin, IN_BYTES)
        c.register_shared_memory("s_out", kout, OUT_BYTES)
        try:
            assert {"name": "s_out", "key": kout, "offset": 0, "byte_size": OUT_BYTES} in c.shared_memory_status()
            want = c.infer("digits_mlp", {"INPUT__0": x}).outputs["OUTPUT__0"]
            r = c.infer("digits_mlp", {"INPUT__0": ShmInput("s_in", IN_BYTES, "FP32", [5, 64])},
                        outputs=[ShmOutput("OUTPUT__0", "s_out", OUT_BYTES)])
            assert r.outputs == {} and r.in_regions["OUTPUT__0"]["shape"] == [5, 10]
            got = shm.get_contents_as_numpy(hout, np.float32, [5, 10])
            np.testing.assert_array_equal(got, want)
            r = c.infer("digits_mlp", {"INPUT__0": ShmInput("s_in", IN_BYTES, "FP32", [5, 64])})
            np.testing.assert_array_equal(r.outputs["OUTPUT__0"], want)
            with pytest.raises(InferenceServerError, match="already registered") as e:
                c.register_shared_memory("s_in", kin, IN_BYTES)
            assert e.value.status == 409
            with pytest.raises(InferenceServerError, match="no shared-memory region named 's_x'") as e:
                c.infer("digits_mlp", {"INPUT__0": ShmInput("s_x", IN_BYTES, "FP32", [5, 64])})
            assert e.value.status == 404
        finally:
            c.unregister_shared_memory()
        assert c.shared_memory_status() == []


@pytest.fixture(scope="module")
def typed_daemon(test_repo: Path) -> Iterator[DaemonThread]:
    d = short_tmpdir()
    dt = DaemonThread(settings(test_repo, d, server={"grpc": "127.0.0.1:0"})).start()
    yield dt
    dt.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.expect_errors("is not served")
def test_regions_mix_with_bytes_on_many_inputs(typed_daemon: DaemonThread,
                                               regions: list[shm.SharedMemoryRegion]) -> None:
    """all_types: inputs c (INT32) and e (FP16) from one region at two offsets, the others as bytes;
    out_c into a region, the others as bytes. gRPC's raw_input_contents then holds only the inputs
    not in shared memory (Triton's rule), and raw_output_contents keeps an empty entry for out_c."""
    rng = np.random.default_rng(1)
    data = {"a": rng.random((2, 3)) > 0.5, "b": rng.integers(0, 200, (2, 3), dtype=np.uint8),
            "c": rng.integers(-9, 9, (2, 3), dtype=np.int32), "d": rng.integers(-9, 9, (2, 3), dtype=np.int64),
            "e": rng.random((2, 3)).astype(np.float16), "f": rng.random((2, 3))}
    types = {"a": "BOOL", "b": "UINT8", "c": "INT32", "d": "INT64", "e": "FP16", "f": "FP64"}
    hin, kin = _region(regions, "t_in", 64)
    hout, kout = _region(regions, "t_out", 24)
    shm.set_shared_memory_region(hin, [data["c"]])
    shm.set_shared_memory_region(hin, [data["e"]], offset=32)
    for lib, address in ((th, typed_daemon.http), (tg, typed_daemon.grpc)):
        c = lib.InferenceServerClient(address)
        c.register_system_shared_memory("t_in", kin, 64)
        c.register_system_shared_memory("t_out", kout, 24)
        try:
            inputs = []
            for name, arr in data.items():
                i = lib.InferInput(name, [2, 3], types[name])
                if name == "c":
                    i.set_shared_memory("t_in", 24)
                elif name == "e":
                    i.set_shared_memory("t_in", 12, offset=32)
                else:
                    i.set_data_from_numpy(arr)
                inputs.append(i)
            outputs = [lib.InferRequestedOutput(f"out_{n}") for n in data]
            outputs[2].set_shared_memory("t_out", 24)
            r = c.infer("all_types", inputs, outputs=outputs)
            np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.int32, [2, 3]), data["c"] * 2)
            np.testing.assert_array_equal(r.as_numpy("out_e"), data["e"] * 2)
            np.testing.assert_array_equal(r.as_numpy("out_a"), ~data["a"])
            np.testing.assert_array_equal(r.as_numpy("out_f"), data["f"] / 2)
        finally:
            c.unregister_system_shared_memory()
            c.close()
