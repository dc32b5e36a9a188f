"""READY=1 after a reload waits until every frontend worker answers from the new catalog (SEEN).

A worker reads the new catalog from its link, but may accept a client's connection and answer it
first: a client that saw READY=1 could be told the model is still LOADING (a failure seen once in
the slow suite). `FrontendWorkers.catalog_seen` returns once every live worker acknowledged the
generation sent, or after its bound with False.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from daemon.api.link import SEEN
from daemon.config import Settings
from daemon.frontends import FrontendWorkers


def _workers(n: int) -> tuple[FrontendWorkers, list[Any]]:
    fw = FrontendWorkers(Settings(), gateway=None, count=n, on_fatal=lambda: None)  # type: ignore[arg-type]
    fw._push_registry = lambda: None  # type: ignore[method-assign]  # (no gateway: the generation is set here)
    fw._generation = 5
    handles = [SimpleNamespace(link=object(), seen=-1) for _ in range(n)]
    fw.workers = handles  # type: ignore[assignment]
    return fw, handles


async def test_waits_for_every_live_worker_to_take_the_catalog() -> None:
    fw, (a, b) = _workers(2)
    waiting = asyncio.create_task(fw.catalog_seen(30.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    fw._on_record(a, [SEEN, 5])  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert not waiting.done()  # b has not said so yet
    fw._on_record(b, [SEEN, 4])  # type: ignore[arg-type]  # an older catalog does not count
    await asyncio.sleep(0)
    assert not waiting.done()
    b.link = None  # b's link closed (it died): nobody waits for it
    fw._seen.set()
    assert await waiting is True


async def test_a_worker_that_never_answers_holds_it_only_for_the_bound() -> None:
    fw, (a,) = _workers(1)
    assert await fw.catalog_seen(0.01) is False
    fw._on_record(a, [SEEN, 5])  # type: ignore[arg-type]
    assert await fw.catalog_seen(0.01) is True
