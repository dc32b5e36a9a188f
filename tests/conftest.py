from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support import build_test_repo, gpu_device


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
    from daemon import demo

    out = tmp_path_factory.mktemp("demo")
    demo.build(out)
    return out


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    from tests.support import short_tmpdir

    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)
