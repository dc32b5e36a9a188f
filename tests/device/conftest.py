"""Device tests: the CUDA backend's logic on the CPU stand-in in every interleaving mode, and on
real CUDA when present (the `cuda` parameter is marked `gpu` and skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.runtime.cuda import CudaBackend
from daemon.runtime.devapi import DeviceApi
from daemon.runtime.devices import Device
from daemon.runtime.emucuda import MODES, EmuCuda, EmuSettings
from daemon.runtime.hostmem import HostPins
from daemon.runtime.program import Program, load_program
from tests.device.models import build_device_repo
from tests.support import gpu_device

# cuBLAS takes a 32 MiB workspace per stream on Hopper (exec and capture both run matmuls), and
# graph pools come on top: a real GPU needs more workspace than the stand-in's sizes.
CUDA_WORKSPACE = 128 << 20

KINDS = [pytest.param(("emucuda", m), id=f"emucuda-{m}") for m in MODES]
KINDS.append(pytest.param(("cuda", ""), id="cuda", marks=pytest.mark.gpu))


def make_api(kind: str, mode: str, **kw: object) -> DeviceApi:
    if kind == "cuda" and gpu_device() == "cuda:0":
        from daemon.runtime.torchcuda import TorchCuda

        return TorchCuda.get(0)
    if kind == "cuda":  # the GPU flow on the stand-in (bench/gpu/check.sh --standin)
        mode = mode or "eager"
    return EmuCuda(0, EmuSettings(**{"capacity": 256 << 20, "mode": mode, "seed": 7, **kw}))  # type: ignore[arg-type]


@pytest.fixture(params=KINDS)
def api(request: pytest.FixtureRequest) -> Iterator[DeviceApi]:
    kind, mode = request.param
    a = make_api(kind, mode)
    yield a
    if isinstance(a, EmuCuda):
        a.release()
        assert not a.races.races


BACKEND_KINDS = [pytest.param(("emucuda", "eager", 7), id="emucuda-eager"),
                 pytest.param(("emucuda", "lazy", 7), id="emucuda-lazy"),
                 *(pytest.param(("emucuda", "random", seed), id=f"emucuda-random{seed}") for seed in (1, 2, 3)),
                 pytest.param(("cuda", "", 0), id="cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKEND_KINDS)
def kind(request: pytest.FixtureRequest) -> tuple[str, str, int]:
    """(kind, mode, seed): the stand-in eager, lazy and at three random seeds; CUDA when present."""
    return request.param  # type: ignore[no-any-return]


def backend_on(api: DeviceApi, budget: int = 64 << 20, workspace: int = 16 << 20, pinned: int = 1 << 30,
               graphs: bool = True, hang_timeout_s: float = 2.0) -> CudaBackend:
    if api.kind == "cuda" and workspace < CUDA_WORKSPACE:
        budget, workspace = budget - workspace + CUDA_WORKSPACE, CUDA_WORKSPACE
    dev = Device(api.name, api.kind, 0, budget, workspace)  # type: ignore[arg-type]
    return CudaBackend(dev, api, HostPins(pinned), graphs=graphs, hang_timeout_s=hang_timeout_s)


@pytest.fixture
def backend(kind: tuple[str, str, int]) -> Iterator[CudaBackend]:
    k, mode, seed = kind
    api = make_api(k, mode, seed=seed) if k != "cuda" else make_api(k, mode)
    be = backend_on(api)
    yield be
    be.close()
    be.host.close()
    if isinstance(api, EmuCuda):
        assert not api.races.races


@pytest.fixture(scope="session")
def device_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_device_repo(tmp_path_factory.mktemp("device-repo"))


@pytest.fixture(scope="session")
def specs(device_repo: Path, test_repo: Path) -> dict[str, ModelSpec]:
    out = {m.key: m for m in scan(test_repo).models}
    out.update({m.key: m for m in scan(device_repo).models})
    return out


@pytest.fixture(scope="session")
def programs(specs: dict[str, ModelSpec]) -> dict[str, Program]:
    keys = ["tiny_pt2:1", "tiny_ts:1", "all_types:1", "converts:1", "branchy:1", "wide:1", "two_inputs:1"]
    return {k: load_program(specs[k]) for k in keys}


def want(program: Program, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the model computes eagerly on the CPU."""
    with torch.inference_mode():
        return program.host_runner(list(xs))
