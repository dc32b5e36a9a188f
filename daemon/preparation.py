"""Preparing a model version: from a scanned ModelSpec to a program ready to hand to the scheduler.

A version is read into host memory (in a worker thread), checked against the devices' budgets and
the memory its KServe TrainedModel declares, and profiled per device kind: from the profile stored
beside it, or by a warm-up on a serving device that the controller reserves for it (measured, then
stored). Its parity model is prepared the same way; a problem with that disables parity, not the
model. Nothing here changes what is served: daemon/models.py installs what this returns.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from daemon.clock import Clock
from daemon.config import Settings
from daemon.controller.service import ControllerService
from daemon.errors import ModelError, ProgramError
from daemon.lifecycle import State
from daemon.model import ModelSpec
from daemon.notify import Notifier
from daemon.parity.spec import parity_model, parity_problem
from daemon.repository import Stamp
from daemon.runtime.devices import Device
from daemon.runtime.executor import Executor
from daemon.runtime.profiler import measure, read_profile, seeds, write_profile
from daemon.runtime.program import Program, load_program

log = logging.getLogger("escapement.server")

# device kind -> INFER and LOAD estimates, and the share of the model's bytes that LOAD copied
Seeds = dict[str, tuple[dict[int, float], float | None, float]]


@dataclass(slots=True)
class Prepared:
    """A model version read into host memory and profiled, not yet known to the scheduler."""

    spec: ModelSpec
    stamp: Stamp
    program: Program
    seeds: Seeds
    parity: Prepared | None = None  # its parity model, when it has one that loads
    notes: str = ""  # what a device cannot do for it (e.g. why it runs without CUDA graphs)


class Preparer:
    """Reads, checks and profiles model versions (the warm-ups run on devices the controller reserves)."""

    def __init__(self, settings: Settings, controller: ControllerService, executors: Mapping[str, Executor],
                 devices: Sequence[Device], notifier: Notifier, clock: Clock, phase: Callable[[], State]) -> None:
        self.settings = settings
        self.controller = controller
        self.executors = executors
        self.devices = devices
        self.notifier = notifier
        self.clock = clock
        self._phase = phase
        self.warming: set[threading.Event] = set()  # warm-ups running in a worker thread (shutdown waits)
        self.native_runner = any(d.kind == "cpu" for d in devices)

    async def prepare(self, spec: ModelSpec, stamp: Stamp) -> Prepared:
        """Read a version into host memory and profile it (both in threads); raises ModelError."""
        # ProgramError is a ModelError; the CPU's native runner only where a CPU device serves
        program = await asyncio.to_thread(load_program, spec, native_runner=self.native_runner)
        need = self.footprint(program)
        largest = max(d.model_budget for d in self.devices)
        if need > largest:
            raise ModelError(f"it needs {need} bytes on a device (weights and IO buffers), more than any device's "
                             f"budget leaves for models ({largest} bytes; runtime.weight_budget)")
        if spec.memory_bytes is not None and need > spec.memory_bytes:
            # KServe admits TrainedModels by the memory they declare: one that needs more than it
            # declares would let KServe place more models on this server than fit.
            raise ModelError(f"it needs {need} bytes (weights and IO buffers), more than the {spec.memory_bytes} "
                             "its KServe TrainedModel declares (spec.model.memory); declare at least that much")
        notes: list[str] = []
        try:
            model_seeds = await self._profile(spec, program, notes)
        except Exception as e:  # a model that cannot even be warmed up is not served
            raise ModelError(f"warm-up failed: {e}") from e
        parity = await self._parity(spec, stamp) if spec.parity is not None else None
        return Prepared(spec, stamp, program, model_seeds, parity, "; ".join(notes))

    def footprint(self, program: Program) -> int:
        """Device bytes a LOAD of `program` charges: the most any device's backend charges."""
        return max(ex.footprint(program) for ex in self.executors.values())

    async def _parity(self, spec: ModelSpec, stamp: Stamp) -> Prepared | None:
        """A model's parity model; a problem with it disables parity, not the model."""
        assert spec.parity is not None
        pspec = parity_model(spec)
        try:
            if problem := parity_problem(spec):
                raise ValueError(problem)
            program = await asyncio.to_thread(load_program, pspec, native_runner=self.native_runner)
            parity_seeds = await self._profile(pspec, program)
        except (ValueError, ProgramError, RuntimeError) as e:
            log.warning("model %s is served without parity: %s", spec.key, e)
            return None
        log.info("model %s: parity k=%d (%s) with %s", spec.key, spec.parity.k, spec.parity.encoder, pspec.path.name)
        return Prepared(pspec, stamp, program, parity_seeds)

    async def _profile(self, spec: ModelSpec, program: Program, notes: list[str] | None = None) -> Seeds:
        """Estimates per device kind from the stored profile, measuring (and storing) what is missing;
        what a device kind cannot do for the model goes to `notes`."""
        stored = await asyncio.to_thread(read_profile, spec)
        out: Seeds = {}
        for kind in sorted({d.kind for d in self.devices}):
            entry = stored.get(kind)
            if entry is None:
                entry = await self._warm_up(spec, program, kind)
                stored_ok = await asyncio.to_thread(write_profile, spec, kind, entry)
                log.info("model %s: profiled on %s in its warm-up%s", spec.key, entry["device"],
                         "" if stored_ok else " (repository read-only: not stored)")
            out[kind] = seeds(entry)
            if entry.get("notes") and notes is not None:
                notes.append(f"on {kind}: {entry['notes']}")
        return out

    async def _warm_up(self, spec: ModelSpec, program: Program, kind: str) -> dict[str, Any]:
        """Measure a version on a serving device of `kind`: the controller makes room for it (as for
        any LOAD: evicting idle models) and keeps the bytes reserved until it is done."""
        holder = f"warmup:{spec.key}"
        need = self.footprint(program)
        timeout = self.settings.server.drain_timeout_s
        device = await self.controller.reserve(holder, need, kind, timeout)
        if device is None:
            raise RuntimeError(f"no {kind} device had room for it within {timeout:.0f} s")
        self.notifier.status(f"warming {spec.key} on {device}")
        done = threading.Event()  # set when the thread is out of the device (shutdown waits for it)

        def run() -> dict[str, Any]:
            try:
                return measure(self.executors[device], program, self.clock, self.settings.runtime.warmup_reps, 2,
                               holder)
            finally:
                done.set()

        self.warming.add(done)
        job = asyncio.get_running_loop().run_in_executor(None, run)
        limit = self.settings.runtime.warmup_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(job), limit)
        except TimeoutError:
            why = f"the warm-up of {spec.key} has not returned for {limit:.0f} s (runtime.warmup_timeout_s)"
            self.controller.declare_hung(device, why)
            raise RuntimeError(why) from None
        finally:
            if done.is_set():
                self.warming.discard(done)
                self.controller.unreserve(holder, device)
            else:  # still on the device (stuck, or a stop cancelled the wait): keep its bytes until it returns
                def release(f: asyncio.Future[dict[str, Any]]) -> None:
                    if not f.cancelled():
                        f.exception()  # nobody waits for it any more: its failure (a stop) is not news
                    self.warming.discard(done)
                    if self._phase() < State.STOPPING:
                        self.controller.unreserve(holder, device)
                job.add_done_callback(release)
