"""The personalization half of `python -m bench run apps` (issue 18 part 4; docs/personalization.md).

`digits_personal` (built by `escapement demo`: the digits MLP with outputs logits and features,
its last layer as the shared head) served by a real daemon, driven over the unix socket:

- `accuracy_by_feedback`: per permuted-label user of users.npz, feedback items from the training
  split one at a time (infer naming the user, then feedback with the user's label for it);
  held-out accuracy of the `personalized` output (the whole test split, through the daemon)
  after 0 (the global model: a fresh user's weights are the shared head), 10, 50 and 200
  items; the mean over users.
- `update_p50_ms` / `update_p99_ms`: the feedback round trip over the socket (decode, RLS, the
  SQLite commit in the writer thread, the acknowledgement), one request at a time; beside it
  the update alone as the daemon measures it (`update_us`: the RLS step on the event loop;
  `durable_ms`: the step plus waiting for its commit).
- `feedback_per_s`: closed-loop clients, each its own user, sending feedback for queries made
  beforehand (group commit: one transaction takes what is queued).
- `survives_kill`: feedback acknowledged, the user's held-out predictions read, `kill -9` of the
  daemon, a new daemon on the same database: the same predictions, byte for byte.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import uvloop

from bench.servers import Escapement
from daemon import demo

MODEL = demo.PERSONAL
CHECKPOINTS = (0, 10, 50, 200)


def build_repo(root: Path) -> Path:
    demo.build(root, only=[MODEL])
    return root


class Conn:
    """One socket connection, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.n = 0

    @classmethod
    async def open(cls, path: str) -> Conn:
        return cls(*await asyncio.open_unix_connection(path))

    async def call(self, msg: dict[str, Any], ok: bool = True) -> dict[str, Any]:
        self.n += 1
        payload = msgpack.packb({"id": self.n, **msg}, use_bin_type=True)
        self.writer.write(len(payload).to_bytes(4, "big") + payload)
        size = int.from_bytes(await self.reader.readexactly(4), "big")
        answer: dict[str, Any] = msgpack.unpackb(await self.reader.readexactly(size), raw=False)
        if ok and answer.get("status") != 200:
            raise RuntimeError(f"the daemon answered {answer}")
        return answer

    async def infer(self, x: np.ndarray, user: str | None) -> tuple[np.ndarray, str]:
        """The personalized output (logits without a user) and the query id."""
        msg: dict[str, Any] = {"op": "infer", "model": MODEL, "inputs": [
            {"name": "INPUT__0", "datatype": "FP32", "shape": list(x.shape), "data": x.tobytes()}]}
        if user is not None:
            msg["user"] = user
            msg["outputs"] = ["personalized"]
        else:
            msg["outputs"] = ["logits"]
        a = await self.call(msg)
        out = a["outputs"][0]
        return np.frombuffer(out["data"], np.float32).reshape(out["shape"]), a.get("query_id", "")

    async def feedback(self, query_id: str, label: int) -> dict[str, Any]:
        return await self.call({"op": "feedback", "model": MODEL, "query_id": query_id, "label": label})

    def close(self) -> None:
        self.writer.close()


async def predict_all(c: Conn, x: np.ndarray, user: str | None) -> np.ndarray:
    return np.concatenate([(await c.infer(x[i : i + 32], user))[0] for i in range(0, len(x), 32)])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


async def _accuracy(path: str, data: Any, users: int, items: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    c = await Conn.open(path)
    rows: list[dict[str, Any]] = []
    rtt: list[float] = []
    update_us: list[float] = []
    durable: list[float] = []
    try:
        xf, yf, xt, yt = data["x_feedback"], data["y_feedback"], data["x_test"], data["y_test"]
        glob = (await predict_all(c, xt, None)).argmax(1)
        for u in range(users):
            perm = data["perms"][u]
            user = f"bench-{data['users'][u]}-{time.time_ns()}"  # a user no earlier run has taught
            order = np.random.default_rng(u).permutation(len(xf))
            acc: dict[int, float] = {}
            given = 0
            for target in [k for k in CHECKPOINTS if k <= items]:
                while given < target:
                    j = order[given]
                    _, qid = await c.infer(xf[j : j + 1], user)
                    t0 = time.perf_counter()
                    ack = await c.feedback(qid, int(perm[yf[j]]))
                    rtt.append((time.perf_counter() - t0) * 1e3)
                    update_us.append(ack["update_us"])
                    durable.append(ack["durable_ms"])
                    given += 1
                pred = (await predict_all(c, xt, user)).argmax(1)
                acc[target] = float((pred == perm[yt]).mean())
            rows.append({"label": f"accuracy, user {u}", **{f"after_{k}": v for k, v in acc.items()},
                         "global_on_own_labels": float((glob == yt).mean())})
        summary = {
            "accuracy_by_feedback": {k: round(statistics.mean(r[f"after_{k}"] for r in rows), 4)
                                     for k in CHECKPOINTS if k <= items},
            "global_accuracy_true_labels": round(float((glob == yt).mean()), 4),
            "update_p50_ms": statistics.median(rtt), "update_p99_ms": _pct(rtt, 0.99),
            "update_alone_p50_ms": statistics.median(update_us) / 1e3,
            "update_alone_p99_ms": _pct(update_us, 0.99) / 1e3,
            "update_durable_p50_ms": statistics.median(durable), "update_durable_p99_ms": _pct(durable, 0.99),
            "feedback_items": len(rtt),
        }
        rows.append({"label": "feedback round trip (socket)", "requests": len(rtt), "p50_ms": summary["update_p50_ms"],
                     "p99_ms": summary["update_p99_ms"]})
        rows.append({"label": "update alone (RLS, in the daemon)", "requests": len(update_us),
                     "p50_ms": summary["update_alone_p50_ms"], "p99_ms": summary["update_alone_p99_ms"]})
        rows.append({"label": "update + commit (in the daemon)", "requests": len(durable),
                     "p50_ms": summary["update_durable_p50_ms"], "p99_ms": summary["update_durable_p99_ms"]})
        return rows, summary
    finally:
        c.close()


async def _throughput(path: str, data: Any, clients: int, per_client: int) -> dict[str, Any]:
    xf, yf = data["x_feedback"], data["y_feedback"]
    conns = [await Conn.open(path) for _ in range(clients)]
    stamp = time.time_ns()
    try:
        queries: list[list[tuple[str, int]]] = []
        for k, c in enumerate(conns):  # the queries first: only feedback is timed
            qs = []
            for i in range(per_client):
                j = (k * per_client + i) % len(xf)
                _, qid = await c.infer(xf[j : j + 1], f"tput-{stamp}-{k}")
                qs.append((qid, int(yf[j])))
            queries.append(qs)

        async def client(c: Conn, qs: list[tuple[str, int]]) -> None:
            for qid, label in qs:
                await c.feedback(qid, label)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, qs) for c, qs in zip(conns, queries, strict=True)))
        wall = time.perf_counter() - t0
        return {"label": f"feedback throughput, {clients} clients", "requests": clients * per_client,
                "feedback_per_s": clients * per_client / wall}
    finally:
        for c in conns:
            c.close()


async def _teach(path: str, data: Any, user: str, items: int) -> np.ndarray:
    """`items` acknowledged feedback items for `user`; its held-out predictions after them."""
    c = await Conn.open(path)
    try:
        xf, yf, perm = data["x_feedback"], data["y_feedback"], data["perms"][0]
        for j in range(items):
            _, qid = await c.infer(xf[j : j + 1], user)
            await c.feedback(qid, int(perm[yf[j]]))
        return await predict_all(c, data["x_test"], user)
    finally:
        c.close()


async def _predictions(path: str, data: Any, user: str | None) -> np.ndarray:
    c = await Conn.open(path)
    try:
        return await predict_all(c, data["x_test"], user)
    finally:
        c.close()


def run_all(server: Escapement, repo: Path, quick: bool, clients: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Accuracy, latency and throughput on `server`, then kill -9 and restart it: rows and summary."""
    data = dict(np.load(repo / MODEL / "users.npz"))
    users = 2 if quick else len(data["perms"])
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        rows, summary = runner.run(_accuracy(server.socket, data, users, 200))
        tput = runner.run(_throughput(server.socket, data, clients, 50 if quick else 250))
        rows.append(tput)
        summary["feedback_per_s"] = tput["feedback_per_s"]
        user = f"durable-{time.time_ns()}"
        before = runner.run(_teach(server.socket, data, user, 50))
        glob = runner.run(_predictions(server.socket, data, None))
    server.kill()  # SIGKILL: no drain, no close, no checkpoint
    server.start()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        after = runner.run(_predictions(server.socket, data, user))
    changed = not np.array_equal(before.argmax(1), glob.argmax(1))
    summary["survives_kill"] = bool(changed and np.array_equal(before, after))
    rows.append({"label": "kill -9 and restart", "survives_kill": summary["survives_kill"],
                 "requests": 50, "identical_predictions": bool(np.array_equal(before, after)),
                 "differs_from_global": changed})
    return rows, summary
