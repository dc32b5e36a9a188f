"""Devices: where actions run. `cuda:N` on GPUs, `emucuda:N` the CUDA backend on a CPU stand-in
of a GPU, `cpu:N` CPU workers, `sim:N` in virtual time.

A device's budget is every byte escapement may hold on it for models: weights and IO buffers
(charged per model) and, on CUDA devices, a workspace reserve for CUDA graphs, activations
and library workspaces (charged once). By default a CUDA device's budget is 90% of the memory
free at start-up; a configured budget larger than what is free stops the start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from daemon.errors import ConfigError

DeviceKind = Literal["cpu", "cuda", "emucuda", "sim"]
CUDA_KINDS = frozenset({"cuda", "emucuda"})  # devices run by the CUDA backend
CPU_DEFAULT_BUDGET = 1 << 30
CUDA_FREE_FRACTION = 0.9  # of the memory free at start-up; the rest stays for the CUDA context
WORKSPACE_FRACTION = 0.1
WORKSPACE_MIN = 256 << 20


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    kind: DeviceKind
    index: int
    weight_budget: int  # every byte models may hold here (weights, IO, the workspace reserve)
    workspace: int = 0  # the part of the budget kept for graphs, activations, library workspaces

    def __str__(self) -> str:
        return self.name

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
        devices.append(Device(n, k, int(idx), budget, reserve))
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
