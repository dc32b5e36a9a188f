"""Devices: where actions run. `cuda:N` on GPUs, `cpu:N` CPU workers, `sim:N` in virtual time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from daemon.errors import ConfigError

DeviceKind = Literal["cpu", "cuda", "sim"]
CPU_DEFAULT_BUDGET = 1 << 30
CUDA_RESERVE_FRACTION = 0.1  # left for activations, IO buffers and the CUDA context


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    kind: DeviceKind
    index: int
    weight_budget: int  # bytes of model weights this device may hold

    def __str__(self) -> str:
        return self.name


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _budget(kind: DeviceKind, index: int, configured: int) -> int:
    if configured > 0:
        return configured
    if kind == "cuda":
        _free, total = torch.cuda.mem_get_info(index)
        return int(total * (1 - CUDA_RESERVE_FRACTION))
    return CPU_DEFAULT_BUDGET


def resolve_devices(names: tuple[str, ...] | list[str], weight_budget: int = 0) -> list[Device]:
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
        if kind not in ("cpu", "cuda", "sim") or not idx.isdigit():
            raise ConfigError(f"runtime.devices: {n!r} is not a device name (cpu:N, cuda:N, sim:N)")
        if kind == "cuda" and int(idx) >= cuda_count():
            raise ConfigError(f"runtime.devices: {n} does not exist here ({cuda_count()} CUDA devices)")
        k: DeviceKind = kind  # type: ignore[assignment]
        devices.append(Device(n, k, int(idx), _budget(k, int(idx), weight_budget)))
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
