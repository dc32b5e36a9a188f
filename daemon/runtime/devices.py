"""Devices: where actions run. `cuda:N` on GPUs, `emucuda:N` the CUDA backend on a CPU stand-in
of a GPU, `cpu:N` CPU workers, `sim:N` in virtual time.

A device's budget is every byte escapement may hold on it for models: weights and IO buffers
(charged per model) and, on CUDA devices, a workspace reserve for CUDA graphs, activations
and library workspaces (charged once). By default a CUDA device's budget is 90% of the memory
free at start-up; a configured budget larger than what is free stops the start-up.

A device also names its hardware `model` ("NVIDIA H100 80GB HBM3", the CPU's model name):
latency profiles are stored per kind and model, since an A100's timings say little about an
H100's.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from daemon.errors import ConfigError

DeviceKind = Literal["cpu", "cuda", "emucuda", "sim"]
CUDA_KINDS = frozenset({"cuda", "emucuda"})  # devices run by the CUDA backend
CPU_DEFAULT_BUDGET = 1 << 30
CUDA_FREE_FRACTION = 0.9  # of the memory free at start-up; the rest stays for the CUDA context
WORKSPACE_FRACTION = 0.1
WORKSPACE_MIN = 256 << 20
EMUCUDA_MODEL = "escapement CUDA stand-in"
SIM_MODEL = "simulated"
_FIXED_MODELS = {"emucuda": EMUCUDA_MODEL, "sim": SIM_MODEL}  # no hardware to ask
MAX_MODEL_CHARS = 128
_CPUINFO_HEAD = 1 << 16  # the first processor's block, where "model name" is, fits in this

log = logging.getLogger("escapement.devices")


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    kind: DeviceKind
    index: int
    weight_budget: int  # every byte models may hold here (weights, IO, the workspace reserve)
    workspace: int = 0  # the part of the budget kept for graphs, activations, library workspaces
    model: str = ""  # the hardware model (see device_model); "" when unknown

    def __post_init__(self) -> None:
        # The stand-in and the simulator have one fixed model, whoever builds the device (the
        # simulator does, not resolve_devices); real hardware is named by resolve_devices.
        if not self.model and self.kind in _FIXED_MODELS:
            object.__setattr__(self, "model", _FIXED_MODELS[self.kind])

    def __str__(self) -> str:
        return self.name

    @property
    def shares_weights(self) -> bool:
        """Whether weights several models hold are kept here once: the CPU backend keeps each
        block (runtime/objstore.py) once, the CUDA arena a plan's shared leading stage (runtime/cuda.py;
        docs/models.md). Simulated devices hold no weights."""
        return self.kind in ("cpu", "cuda", "emucuda")

    @property
    def model_budget(self) -> int:
        """What resident models may hold: the budget less the workspace reserve."""
        return self.weight_budget - self.workspace


def cuda_count() -> int:
    from daemon.runtime import torchcuda

    return torchcuda.device_count()


def device_memory(kind: str, index: int, emucuda: object | None = None) -> tuple[int, int]:
    """(free, total) bytes of a CUDA or stand-in device."""
    if kind == "cuda":
        from daemon.runtime import torchcuda

        return torchcuda.memory(index)
    from daemon.runtime import emucuda as emu

    return emu.device(index, emu.settings_from(emucuda)).memory()


def _clean_model(text: str) -> str:
    """One line of printable characters, spaces collapsed, bounded: a model name fit for a key."""
    return " ".join("".join(c for c in text if c.isprintable()).split())[:MAX_MODEL_CHARS]


@functools.cache
def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: /proc/cpuinfo's "model name" (x86); else, on ARM, the architecture
    with the implementer and part numbers ("aarch64 0x41:0xd0c"), so that two ARM designs do not
    share profiles; else what `platform` knows, else "" (unknown)."""
    try:
        with cpuinfo.open("rb") as f:
            head = f.read(_CPUINFO_HEAD).decode("utf-8", "replace")
    except OSError:
        head = ""
    fields: dict[str, str] = {}
    for line in head.splitlines():
        key, sep, value = line.partition(":")
        if sep and _clean_model(value):
            fields.setdefault(key.strip(), _clean_model(value))  # the first processor's
    if "model name" in fields:
        return fields["model name"]
    arch = platform.machine() or platform.processor()
    if "CPU implementer" in fields and "CPU part" in fields:
        return _clean_model(f"{arch} {fields['CPU implementer']}:{fields['CPU part']}")
    return _clean_model(platform.processor() or arch)


# cuda index -> its model ("" unknown), as resolve_devices found it: what host_model answers
# from, so that code that only reads profiles never asks the driver.
_cuda_models: dict[int, str] = {}


def _cuda_model(index: int) -> str:
    from daemon.runtime import torchcuda  # the one module that touches torch.cuda

    try:
        name = _clean_model(torchcuda.device_name(index))
    except (RuntimeError, AssertionError, ValueError) as e:  # what torch raises for a device it cannot query
        log.warning("cuda:%d: its model is unknown (%s): its latency profiles are measured at every start",
                    index, e)
        name = ""
    _cuda_models[index] = name
    return name


def device_model(kind: str, index: int) -> str:
    """The hardware model of a device ("" when unknown): what its latency profiles are keyed by."""
    if kind == "cuda":
        return _cuda_model(index)
    return _FIXED_MODELS.get(kind) or cpu_model()


def host_model(kind: str) -> str:
    """The model of this process's devices of `kind`, "" when unknown or when they differ (two
    GPU models in one host). CUDA devices count once resolve_devices has built them: this never
    asks the driver (a CPU-only daemon must not create a CUDA context to read a profile)."""
    if kind != "cuda":
        return device_model(kind, 0)
    models = set(_cuda_models.values())
    return models.pop() if len(models) == 1 else ""


def default_workspace(budget: int) -> int:
    return min(budget // 2, max(WORKSPACE_MIN, int(budget * WORKSPACE_FRACTION)))


def _budget(name: str, kind: DeviceKind, index: int, configured: int, emucuda: object | None) -> int:
    if kind not in CUDA_KINDS:
        return configured or CPU_DEFAULT_BUDGET
    free, total = device_memory(kind, index, emucuda)
    if configured > free:
        raise ConfigError(f"runtime.weight_budget = {configured} bytes, but {name} has only {free} of its {total} "
                          "bytes free; lower the budget or free the device")
    return configured or int(free * CUDA_FREE_FRACTION)


def resolve_devices(names: tuple[str, ...] | list[str], weight_budget: int = 0, workspace: int = 0,
                    emucuda: object | None = None) -> list[Device]:
    """Turn configured names into devices; 'auto' is every CUDA device, else cpu:0."""
    expanded: list[str] = []
    for n in names:
        if n == "auto":
            expanded.extend([f"cuda:{i}" for i in range(cuda_count())] or ["cpu:0"])
        else:
            expanded.append(n)
    devices: list[Device] = []
    seen: set[str] = set()
    for n in expanded:
        if n in seen:
            continue
        seen.add(n)
        kind, _, idx = n.partition(":")
        if kind not in ("cpu", "cuda", "emucuda", "sim") or not idx.isdigit():
            raise ConfigError(f"runtime.devices: {n!r} is not a device name (cpu:N, cuda:N, emucuda:N, sim:N)")
        if kind == "cuda" and int(idx) >= cuda_count():
            raise ConfigError(f"runtime.devices: {n} does not exist here ({cuda_count()} CUDA devices)")
        k: DeviceKind = kind  # type: ignore[assignment]
        budget = _budget(n, k, int(idx), weight_budget, emucuda)
        reserve = 0
        if k in CUDA_KINDS:
            reserve = workspace or default_workspace(budget)
            if reserve >= budget:
                raise ConfigError(f"runtime.device_workspace = {reserve} bytes leaves nothing of {n}'s budget "
                                  f"({budget} bytes) for models")
        devices.append(Device(n, k, int(idx), budget, reserve, device_model(k, int(idx))))
    return devices


def plan_cores(devices: list[Device], allowed: set[int], pin: bool) -> tuple[dict[str, int], set[int] | None]:
    """Cores for CPU devices' INFER threads (the highest ones) and the rest for everything else.

    No pinning (empty plan, None) when disabled or when every core would go to a device.
    """
    cpu = [d for d in devices if d.kind == "cpu"]
    cores = sorted(allowed)
    if not pin or not cpu or len(cores) <= len(cpu):
        return {}, None
    plan = {d.name: cores[-(i + 1)] for i, d in enumerate(cpu)}
    return plan, set(cores) - set(plan.values())
