"""READY=1 after a reload waits until every frontend worker answers from the new catalog (SEEN).

A worker reads the new catalog from its link, but may accept a client's connection and answer it
first: a client that saw READY=1 could be told the model is still LOADING (a failure seen once in
the slow suite). `FrontendWorkers.catalog_seen` sends the catalog and returns once every live
worker acknowledged its generation, or after its bound with False.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from daemon.api.link import MODELS
from daemon.catalog import ModelCatalog
from daemon.config import Settings
from daemon.frontends import FrontendWorkers


class _Link:
    def __init__(self) -> None:
        self.sent: list[list[Any]] = []

    def send(self, record: list[Any]) -> None:
        self.sent.append(record)


def _workers(n: int, live: int | None = None) -> tuple[FrontendWorkers, list[Any]]:
    catalog = ModelCatalog()
    catalog.generation = 5
    gateway = SimpleNamespace(catalog=catalog, shared_memory=SimpleNamespace(generation=0, snapshot=list))
    fw = FrontendWorkers(Settings(), gateway, count=n, on_fatal=lambda: None)  # type: ignore[arg-type]
    handles = [SimpleNamespace(link=_Link() if i < (n if live is None else live) else None, seen=-1)
               for i in range(n)]
    fw.workers = handles  # type: ignore[assignment]
    return fw, handles


async def test_waits_for_every_live_worker_to_take_the_catalog() -> None:
    fw, (a, b) = _workers(2)
    waiting = asyncio.create_task(fw.catalog_seen(30.0))
    await asyncio.sleep(0)
    assert [r[0] for r in a.link.sent] == [MODELS] and a.link.sent[0][2] == 5  # sent, with its generation
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
    fw, (a, _) = _workers(2, live=1)  # the second one's link is closed (it died)
    assert await fw.catalog_seen(0.01) is False  # a never answered: READY=1 is not held for ever
    fw.worker_seen(a, 5)
    assert await fw.catalog_seen(0.01) is True
