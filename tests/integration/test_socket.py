"""The unix-socket frontend against a real daemon, through our clients and through raw bytes."""

from __future__ import annotations

import asyncio
import socket
import stat
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from daemon.client import AsyncSocketClient, InferenceServerError, SocketClient
from tests.support import DaemonThread, TinyLinear


def reference(x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return TinyLinear()(torch.from_numpy(x)).numpy()


def test_socket_file_mode(test_daemon: DaemonThread) -> None:
    assert stat.S_IMODE(Path(test_daemon.socket).stat().st_mode) == 0o660


def test_sync_client(test_daemon: DaemonThread) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with SocketClient(test_daemon.socket) as c:
        assert c.live() and c.ready()
        r = c.infer("tiny_pt2", {"INPUT__0": x})
        assert r.model == "tiny_pt2" and r.version == "1" and not r.reconstructed
        np.testing.assert_allclose(r.outputs["OUTPUT__0"], reference(x), rtol=1e-5)
        r = c.infer("tiny_ts", {"INPUT__0": x}, version=1, outputs=["OUTPUT__0"])
        assert r.version == "1"
        assert c.metadata("tiny_ts")["versions"] == ["1", "2"]
        assert any(m["name"] == "garbage" and m["state"] == "UNAVAILABLE" for m in c.index())
        with pytest.raises(InferenceServerError) as e:
            c.infer("tiny_pt2", {"INPUT__0": x[:, :3].copy()})
        assert e.value.status == 400 and "does not match" in e.value.message
        with pytest.raises(InferenceServerError) as e:
            c.infer("tiny_pt2", {"INPUT__0": x}, timeout_us=0)
        assert e.value.status == 504
        # errors leave the connection usable
        assert c.infer("tiny_pt2", {"INPUT__0": x}).outputs["OUTPUT__0"].shape == (3, 3)


def test_async_client_many_in_flight_on_one_connection(test_daemon: DaemonThread) -> None:
    xs = [np.full((1, 4), i, np.float32) for i in range(300)]

    async def main() -> list[np.ndarray]:
        async with AsyncSocketClient(test_daemon.socket) as c:
            rs = await asyncio.gather(*(c.infer("tiny_pt2", {"INPUT__0": x}) for x in xs))
            return [r.outputs["OUTPUT__0"] for r in rs]

    outs = asyncio.run(main())
    for x, y in zip(xs, outs, strict=True):  # every answer matched to its own request
        np.testing.assert_allclose(y, reference(x), rtol=1e-5)


def _frame(obj: object) -> bytes:
    p = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(p)) + p


def _read_frame(s: socket.socket) -> dict:
    hdr = b""
    while len(hdr) < 4:
        chunk = s.recv(4 - len(hdr))
        if not chunk:
            raise ConnectionError("closed")
        hdr += chunk
    (n,) = struct.unpack(">I", hdr)
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body))
    return msgpack.unpackb(body, raw=False)


def _infer_msg(i: int) -> dict:
    x = np.full((1, 4), i, "<f4")
    return {"id": i, "model": "tiny_pt2", "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4],
                                                      "data": x.tobytes()}]}


def test_bad_frames_and_lying_lengths_do_not_disturb_other_clients(test_daemon: DaemonThread) -> None:
    # 1. garbage msgpack: an error, and the same connection goes on
    s = socket.socket(socket.AF_UNIX)
    s.connect(test_daemon.socket)
    s.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1" + _frame(_infer_msg(1)))
    bad, ok = _read_frame(s), _read_frame(s)
    assert bad["status"] == 400 and bad["id"] is None
    assert ok["status"] == 200 and ok["id"] == 1
    # 2. a frame that claims more bytes than it sends, then the client vanishes
    liar = socket.socket(socket.AF_UNIX)
    liar.connect(test_daemon.socket)
    liar.sendall(struct.pack(">I", 5000) + b"\x80" * 10)
    liar.close()
    # 3. a frame over the limit: an error, then the daemon closes that connection
    big = socket.socket(socket.AF_UNIX)
    big.connect(test_daemon.socket)
    big.sendall(struct.pack(">I", 10**9))
    answer = _read_frame(big)
    assert answer["status"] == 413
    assert big.recv(10) == b""
    big.close()
    # 4. a client that sends requests and disconnects before the answers
    for _ in range(5):
        gone = socket.socket(socket.AF_UNIX)
        gone.connect(test_daemon.socket)
        gone.sendall(b"".join(_frame(_infer_msg(i)) for i in range(20)))
        gone.close()
    # the first connection and new ones still work
    s.sendall(_frame(_infer_msg(2)))
    assert _read_frame(s)["id"] == 2
    s.close()
    with SocketClient(test_daemon.socket) as c:
        assert c.infer("tiny_pt2", {"INPUT__0": np.ones((1, 4), np.float32)}).outputs["OUTPUT__0"].shape == (1, 3)
    assert test_daemon.wait_idle() == 0
