"""Shared-memory regions without a daemon: the registry's checks and bounds, a deferred unregister,
an object shrunk under the daemon, and HTTP bytes in / bytes out over a gateway whose fake
controller echoes (or holds) requests."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest

from daemon.api.http import HttpFrontend
from daemon.api.httpserver import Request
from daemon.api.sharedmem import OutputTargets, RegionReplica, SharedMemoryRegions, ShmRef
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import SharedMemorySettings, settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NotFound,
    NotImplementedByServer,
    PayloadTooLarge,
    Unavailable,
)
from daemon.gateway import Gateway
from daemon.model import ModelSpec, TensorSpec
from daemon.request import RequestStatus
from tests.protocol.test_datatypes import EchoController

FP32 = BY_NAME["FP32"]
SPEC = ModelSpec("echo", 1, Path("/x"), "pt2", (TensorSpec("x", FP32, (-1, 4)),), (TensorSpec("y", FP32, (-1, 4)),),
                 8, 1.0)


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    """A directory standing in for /dev/shm (same rules, no leftovers)."""
    return tmp_path


def _object(directory: Path, size: int, data: bytes = b"") -> str:
    name = f"obj-{uuid.uuid4().hex[:8]}"
    (directory / name).write_bytes(data.ljust(size, b"\0"))
    return "/" + name


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_register_checks_and_bounds(objects: Path) -> None:
    regs = SharedMemoryRegions(SharedMemorySettings(max_regions=2, max_bytes=100), objects)
    key = _object(objects, 64)
    regs.register("a", key, 0, 32)
    cases = [
        (lambda: regs.register("a", key, 0, 8), Conflict, "already registered"),
        (lambda: regs.register("b", "/missing", 0, 8), NotFound, "no shared-memory object"),
        (lambda: regs.register("b", key, 60, 8), BadRequest, "runs past the end of the object"),
        (lambda: regs.register("b", "../x", 0, 8), BadRequest, "not a POSIX shared-memory name"),
        (lambda: regs.register("b", "/a/b", 0, 8), BadRequest, "not a POSIX shared-memory name"),
        (lambda: regs.register("b", "/.", 0, 8), BadRequest, "not a POSIX shared-memory name"),
        (lambda: regs.register("b", key, 0, 0), BadRequest, "at least 1"),
        (lambda: regs.register("b", key, True, 8), BadRequest, "offset must be a non-negative integer"),
        (lambda: regs.register("", key, 0, 8), BadRequest, "a region's name"),
        (lambda: regs.register("b", key, 0, 70), PayloadTooLarge, "shared_memory.max_bytes"),
    ]
    for call, exc, message in cases:
        with pytest.raises(exc, match=message):
            call()
    os.symlink(objects / key[1:], objects / "link")
    with pytest.raises(BadRequest, match="cannot open"):  # O_NOFOLLOW
        regs.register("b", "/link", 0, 8)
    regs.register("b", key, 32, 32)
    with pytest.raises(PayloadTooLarge, match=r"shared_memory\.max_regions"):
        regs.register("c", key, 0, 1)
    assert regs.status(None) == [{"name": "a", "key": key, "offset": 0, "byte_size": 32},
                                 {"name": "b", "key": key, "offset": 32, "byte_size": 32}]
    regs.unregister(None)
    assert regs.status(None) == [] and regs.bytes == 0
    with pytest.raises(NotFound):
        regs.status("a")
    off = SharedMemoryRegions(SharedMemorySettings(enabled=False), objects)
    with pytest.raises(NotImplementedByServer, match=r"shared_memory\.enabled"):
        off.register("a", key, 0, 8)


def test_another_users_object_is_refused(objects: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _object(objects, 8)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(objects / key[1:]).st_uid + 1)
    with pytest.raises(Forbidden, match="belongs to another user"):
        SharedMemoryRegions(SharedMemorySettings(), objects).register("a", key, 0, 8)
    SharedMemoryRegions(SharedMemorySettings(same_owner=False), objects).register("a", key, 0, 8)


def test_reads_copy_and_stay_in_range(objects: Path) -> None:
    regs = SharedMemoryRegions(SharedMemorySettings(), objects)
    key = _object(objects, 16, bytes(range(16)))
    regs.register("a", key, 4, 8)
    got = regs.read(ShmRef("a", 2, 4), "input x")
    assert got.tobytes() == bytes([6, 7, 8, 9])
    (objects / key[1:]).write_bytes(b"\xff" * 16)  # the client overwrites the region: the copy holds
    assert got.tobytes() == bytes([6, 7, 8, 9])
    with pytest.raises(BadRequest, match="runs past the end of region 'a'"):
        regs.read(ShmRef("a", 6, 4), "input x")
    with pytest.raises(NotFound, match="no shared-memory region named 'b'"):
        regs.read(ShmRef("b", 0, 4), "input x")
    os.truncate(objects / key[1:], 6)  # shrunk after registering: a short read, not SIGBUS
    with pytest.raises(BadRequest, match="shorter than when it was registered"):
        regs.read(ShmRef("a", 0, 8), "input x")
    targets = OutputTargets(regs)
    targets.add(0, ShmRef("a", 0, 8), "output y")
    with pytest.raises(BadRequest, match="shorter than when it was registered"):
        targets.write(0, np.zeros(2, np.float32), "output y")
    targets.release()
    regs.close()


def test_unregister_while_in_use_is_deferred(objects: Path) -> None:
    regs = SharedMemoryRegions(SharedMemorySettings(), objects)
    key = _object(objects, 16)
    regs.register("out", key, 0, 16)
    targets = OutputTargets(regs)
    targets.add(0, ShmRef("out", 0, 16), "output y")
    region = regs.regions["out"]
    regs.unregister("out")
    assert regs.status(None) == [] and regs.bytes == 0 and _fd_open(region.fd)  # the name goes, the fd stays
    regs.register("out", key, 0, 8)  # the name may be taken again at once
    written = targets.write(0, np.arange(4, dtype=np.float32), "output y")
    assert written == {"shared_memory_region": "out", "shared_memory_byte_size": 16}
    assert np.frombuffer((objects / key[1:]).read_bytes(), np.float32).tolist() == [0, 1, 2, 3]
    targets.release()
    assert not _fd_open(region.fd) and regs.retired == []
    regs.close()


# ------------------------------------------------------------------ HTTP bytes in, bytes out


def _frontend(ctl: EchoController, objects: Path) -> HttpFrontend:
    catalog = ModelCatalog()
    catalog.add(SPEC, ModelState.READY)
    gw = Gateway(settings_from_dict({}), catalog, ctl)
    gw.shared_memory = SharedMemoryRegions(SharedMemorySettings(), objects)
    return HttpFrontend(gw)


async def _call(fe: HttpFrontend, method: str, path: str, body: object = None) -> tuple[int, dict[str, object]]:
    raw = orjson.dumps(body) if body is not None else b""
    resp = await fe.answer(Request(method, path, "", {}, raw, keep_alive=True))
    return resp.status, (orjson.loads(resp.body) if resp.body else {})


async def test_http_bytes_in_and_out_and_a_deferred_unregister(objects: Path) -> None:
    ctl = EchoController(hold=True)
    fe = _frontend(ctl, objects)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    kin, kout = _object(objects, 32, x.tobytes()), _object(objects, 64)
    base = "/v2/systemsharedmemory/region"
    assert await _call(fe, "POST", f"{base}/in/register", {"key": kin, "offset": 0, "byte_size": 32}) == (200, {})
    assert await _call(fe, "POST", f"{base}/out/register", {"key": kout, "byte_size": 64}) == (200, {})
    assert (await _call(fe, "GET", "/v2/systemsharedmemory/status"))[1] == [
        {"name": "in", "key": kin, "offset": 0, "byte_size": 32}, {"name": "out", "key": kout, "offset": 0,
                                                                    "byte_size": 64}]
    p_in = {"shared_memory_region": "in", "shared_memory_byte_size": 32}
    p_out = {"shared_memory_region": "out", "shared_memory_byte_size": 32, "shared_memory_offset": 16}
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "parameters": p_in}],
            "outputs": [{"name": "y", "parameters": p_out}]}
    task = asyncio.get_running_loop().create_task(_call(fe, "POST", "/v2/models/echo/infer", body))
    await ctl.arrived.wait()  # the request is in flight, its output region pinned
    (objects / kin[1:]).write_bytes(b"\xff" * 32)  # overwritten mid-flight: the request has its copy
    assert await _call(fe, "POST", f"{base}/out/unregister") == (200, {})
    assert [r["name"] for r in (await _call(fe, "GET", "/v2/systemsharedmemory/status"))[1]] == ["in"]
    status, err = await _call(fe, "POST", "/v2/models/echo/infer", body)
    assert status == 404 and "no shared-memory region named 'out'" in str(err["error"])
    req = ctl.held.pop()
    req.outputs = req.inputs
    req.status = RequestStatus.SUCCEEDED
    assert req.on_finish is not None
    req.on_finish(req)
    status, answer = await task
    assert status == 200
    assert answer["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [2, 4], "parameters": p_out}]
    written = (objects / kout[1:]).read_bytes()
    assert np.frombuffer(written[16:48], np.float32).reshape(2, 4).tolist() == x.tolist()
    assert fe.gateway.shared_memory.retired == []  # the deferred close happened with the answer
    fe.gateway.shared_memory.close()


# ------------------------------------------------------------------ a frontend worker's replica


def test_a_replica_serves_the_objects_the_controller_registered(objects: Path) -> None:
    owner = SharedMemoryRegions(SharedMemorySettings(), objects)
    key = _object(objects, 32, bytes(range(32)))
    owner.register("r", key, 8, 16)
    replica = RegionReplica(SharedMemorySettings(), objects)
    assert not replica.serves(["r"])  # nothing pushed yet: the controller process answers
    replica.apply(owner.snapshot())
    assert replica.serves(["r"]) and replica.serves([]) and not replica.serves(["r", "other"])
    assert not replica.serves([{"not": "a name"}])  # the controller process answers its 400
    assert bytes(replica.read(ShmRef("r", 4, 4), "input x")) == bytes(range(12, 16))
    with pytest.raises(BadRequest, match="runs past the end of region 'r'"):
        replica.read(ShmRef("r", 8, 16), "input x")  # the same checks, the same words
    with pytest.raises(Unavailable):
        replica.register("s", key, 0, 8)  # the registry is the controller's


def test_a_replica_leaves_an_object_it_cannot_open_as_registered_to_the_controller(objects: Path) -> None:
    owner = SharedMemoryRegions(SharedMemorySettings(), objects)
    gone, swapped = _object(objects, 16), _object(objects, 16)
    owner.register("gone", gone, 0, 16)
    owner.register("swapped", swapped, 0, 16)
    replica = RegionReplica(SharedMemorySettings(), objects)
    replica.apply(owner.snapshot())
    (objects / gone.lstrip("/")).unlink()  # unlinked after it was registered
    (objects / swapped.lstrip("/")).unlink()
    (objects / swapped.lstrip("/")).write_bytes(b"\0" * 16)  # another object under the same key
    assert not replica.serves(["gone"]) and not replica.serves(["swapped"])
    assert replica.elsewhere == {"gone", "swapped"} and not replica.regions
    assert bytes(owner.read(ShmRef("gone", 0, 4), "input x")) == b"\0" * 4  # the owner still reads it


def test_a_replica_retires_an_unregistered_region_when_its_last_pin_goes(objects: Path) -> None:
    owner = SharedMemoryRegions(SharedMemorySettings(), objects)
    key = _object(objects, 16)
    owner.register("out", key, 0, 16)
    replica = RegionReplica(SharedMemorySettings(), objects)
    replica.apply(owner.snapshot())
    assert replica.serves(["out"])
    targets = OutputTargets(replica)
    targets.add(0, ShmRef("out", 0, 16), "output y")  # a request that will write into it
    fd = replica.regions["out"].fd
    owner.unregister("out")
    replica.apply(owner.snapshot())
    assert not replica.serves(["out"])  # gone for new requests at once
    assert _fd_open(fd)  # the one in flight still writes
    targets.write(0, np.ones(4, np.float32), "output y")
    targets.release()
    assert not _fd_open(fd) and not replica.retired
    assert (objects / key.lstrip("/")).read_bytes() == np.ones(4, np.float32).tobytes()
