"""READY=1 after a reload waits until every frontend worker answers from the new catalog (SEEN).

A worker reads the new catalog from its link, but may accept a client's connection and answer it
first: a client that saw READY=1 could be told the model is still LOADING (a failure seen once in
the slow suite). `FrontendWorkers.catalog_seen` sends the catalog and returns once every live
worker acknowledged its generation, or after its bound with False.
"""

from __future__ import annotations

import asyncio
import mmap
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

from daemon.api.link import MODELS, Link
from daemon.catalog import ModelCatalog
from daemon.config import Settings
from daemon.frontends import FrontendWorkers, WorkerHandle
from daemon.gateway import Gateway


@asynccontextmanager
async def _workers(n: int, live: int | None = None
                   ) -> AsyncIterator[tuple[FrontendWorkers, list[WorkerHandle], list[asyncio.Queue[list[Any]]]]]:
    """`n` worker handles, the first `live` with a link (the others' closed: they died), and per
    live one the records its worker end reads. Real handles and links over socketpairs, no worker
    process: the controller side is compiled (daemon/native) and takes no stand-ins."""
    catalog = ModelCatalog()
    catalog.generation = 5
    gateway = Gateway(Settings(), catalog, SimpleNamespace())
    fw = FrontendWorkers(Settings(), gateway, count=n, on_fatal=lambda: None)
    loop = asyncio.get_running_loop()
    # (a handle names its process; this one has exited)
    proc = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-c", ""])
    await asyncio.to_thread(proc.wait)
    handles: list[WorkerHandle] = []
    inboxes: list[asyncio.Queue[list[Any]]] = []
    ends: list[Any] = []
    for i in range(n):
        w = WorkerHandle(i, proc, mmap.mmap(-1, 4096))
        if i < (n if live is None else live):
            mine, theirs = socket.socketpair()
            inbox: asyncio.Queue[list[Any]] = asyncio.Queue()
            t1, w.link = await loop.connect_accepted_socket(
                lambda: Link(lambda r: None, lambda: None, max_record=1 << 16), sock=mine)
            t2, _ = await loop.connect_accepted_socket(
                lambda q=inbox: Link(q.put_nowait, lambda: None, max_record=1 << 16), sock=theirs)
            inboxes.append(inbox)
            ends += [t1, t2]
        fw.workers[i] = w
        handles.append(w)
    try:
        yield fw, handles, inboxes
    finally:
        for t in ends:
            t.close()


async def test_waits_for_every_live_worker_to_take_the_catalog() -> None:
    async with _workers(2) as (fw, (a, b), (inbox_a, _)):
        waiting = asyncio.create_task(fw.catalog_seen(30.0))
        record = await asyncio.wait_for(inbox_a.get(), 10.0)
        assert record[0] == MODELS and record[2] == 5 and inbox_a.empty()  # sent, with its generation
        assert not waiting.done()
        fw.worker_seen(a, 5)
        await asyncio.sleep(0)
        assert not waiting.done()  # b has not said so yet
        fw.worker_seen(b, 4)  # an older catalog does not count
        await asyncio.sleep(0)
        assert not waiting.done()
        fw.worker_seen(b, 5)
        assert await waiting is True


async def test_only_live_workers_are_waited_for_and_only_for_the_bound() -> None:
    async with _workers(2, live=1) as (fw, (a, _), _):  # the second one's link is closed (it died)
        assert await fw.catalog_seen(0.01) is False  # a never answered: READY=1 is not held for ever
        fw.worker_seen(a, 5)
        assert await fw.catalog_seen(0.01) is True
