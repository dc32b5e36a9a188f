from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.harness import LOOPS, ErrorRecords, loop_name
from tests.support import build_test_repo, gpu_device


@pytest.hookimpl(optionalhook=True)  # pytest-asyncio >= 1.4; older ones keep asyncio's own loop
def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, object]:
    """Async tests run on the loop the harness runs daemons on: uvloop, or asyncio's own with
    ESCAPEMENT_TEST_LOOP=asyncio (`make test-asyncio`)."""
    return {loop_name(): LOOPS[loop_name()]}


def pytest_report_header(config: pytest.Config) -> str:
    return f"event loop: {loop_name()} (ESCAPEMENT_TEST_LOOP)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `bench/gpu/check.sh --standin` runs the gpu-marked tests on the CUDA stand-in (emucuda:0)
    if torch.cuda.is_available() or gpu_device().startswith("emucuda"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def test_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_test_repo(tmp_path_factory.mktemp("repo"))


@pytest.fixture(scope="session")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo models in a directory of the session's own. `make test` builds them once, before
    the suite (`make demo`), and names them in $ESCAPEMENT_TEST_DEMO: copied here (without stored
    profiles, as built), not trained again inside the first test's time limit. What is missing
    is built."""
    from daemon import demo

    out = tmp_path_factory.mktemp("demo")
    built = os.environ.get("ESCAPEMENT_TEST_DEMO")
    if built and Path(built).is_dir():
        shutil.copytree(built, out, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*profile.json", ".demo-built"))
    demo.build(out)
    return out


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    from tests.support import short_tmpdir

    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_unexpected_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test when the daemon logs an ERROR (or a traceback) or an exception reaches an event
    loop (asyncio logs those as ERROR), unless the test names it with
    `@pytest.mark.expect_errors("regex", ...)`: a daemon that fails quietly must not pass."""
    records = ErrorRecords()
    loggers = [logging.getLogger("escapement"), logging.getLogger("asyncio")]
    for lg in loggers:
        lg.addHandler(records)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeHandler(records)
    marker = request.node.get_closest_marker("expect_errors")
    allowed = [re.compile(p) for p in (marker.args if marker else ())]
    unexpected = [r for r in records.records
                  if not any(p.search(r.getMessage()) or (r.exc_text and p.search(r.exc_text)) for p in allowed)]
    if unexpected:
        lines = "\n".join(f"{r.name} {r.levelname}: {r.getMessage()}" for r in unexpected[:10])
        pytest.fail(f"{len(unexpected)} unexpected ERROR record(s) logged:\n{lines}", pytrace=False)
