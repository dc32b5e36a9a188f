"""`standin-races`: the CUDA backend's threads on the stand-in at many random seeds.

Per seed: a stand-in device in `random` mode (work runs at seeded random moments and in random
orders that streams and events allow), its executor's two lanes running INFERs of resident
models while LOADs and UNLOADs of larger models churn the arena (compactions move the resident
models under the INFERs' feet). Every access goes through the race checker (collecting, not
raising); every INFER's outputs are compared with the model run eagerly on the CPU. The figure
that matters is zero: races found, wrong outputs, failed actions.
"""

from __future__ import annotations

import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import results
from bench.scenarios.common import command
from daemon.actions import Action, ActionKind, Result
from daemon.clock import MonotonicClock
from daemon.demo import save_model
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.cuda import CudaBackend, extent_layout
from daemon.runtime.devices import Device
from daemon.runtime.emucuda import EmuCuda, EmuSettings
from daemon.runtime.executor import Executor
from daemon.runtime.hostmem import HostPins
from daemon.runtime.program import Program, load_program
from tests.device.models import Wide, build_device_repo, config

SMALL = ("converts", "branchy")
BIG = ("wide", "wide_half")  # two sizes: their churn fragments the arena


def _programs(root: Path) -> dict[str, Program]:
    build_device_repo(root)
    save_model(Wide(width=700).eval(), "pt2", torch.zeros(2, 16), 8, root / "wide_half" / "1" / "model.pt2")
    (root / "wide_half" / "config.toml").write_text(config(16, 4))
    return {m.name: load_program(m) for m in scan(root).models}


def _one_seed(seed: int, programs: dict[str, Program], steps: int) -> dict[str, Any]:
    api = EmuCuda(0, EmuSettings(capacity=96 << 20, mode="random", seed=seed, strict=False))
    big = extent_layout(programs["wide"])[3]
    dev = Device("emucuda:0", "emucuda", 0, (1 << 20) + int(2.2 * big), 1 << 20)
    be = CudaBackend(dev, api, HostPins(1 << 30))
    done: queue.Queue[Result] = queue.Queue()
    clock = MonotonicClock()
    ex = Executor(dev, be, clock, done.put, {p.spec.key: p for p in programs.values()})
    ex.start()
    rng = np.random.default_rng(seed)
    sent: dict[int, tuple[Action, list[np.ndarray] | None]] = {}

    def submit(kind: ActionKind, program: Program, holder: str = "", **kw: Any) -> None:
        now = clock.now()
        a = Action(kind, program.spec, dev.name, now, now + 30, program=program, resident=holder, **kw)
        want = None
        if kind == ActionKind.INFER:
            with torch.inference_mode():
                want = [o.numpy() for o in program.host_runner([torch.from_numpy(x) for x in kw["requests"][0].inputs])]
        sent[a.id] = (a, want)
        ex.submit(a)

    failed = wrong = 0
    for name in SMALL:
        submit(ActionKind.LOAD, programs[name])
    pending = list(sent)
    for _ in pending:  # the small models are resident before any INFER of them
        r = done.get(timeout=120)
        failed += not r.ok
    resident_big: list[tuple[str, str]] = []  # (holder, program)
    held = 0
    for i in range(steps):
        if rng.random() < 0.35:  # churn the arena with the big models (what fits: the load lane refuses the rest)
            if resident_big and (held >= int(1.6 * big) or rng.random() < 0.5):
                holder, name = resident_big.pop(int(rng.integers(len(resident_big))))
                held -= extent_layout(programs[name])[3]
                submit(ActionKind.UNLOAD, programs[name], holder)
            else:
                name = BIG[int(rng.integers(len(BIG)))]
                if held + extent_layout(programs[name])[3] <= int(2.15 * big):
                    resident_big.append((f"{name}-{i}", name))
                    held += extent_layout(programs[name])[3]
                    submit(ActionKind.LOAD, programs[name], resident_big[-1][0])
        else:
            p = programs[SMALL[int(rng.integers(len(SMALL)))]]
            n = int(rng.integers(1, p.spec.max_batch_size + 1))
            xs = tuple((rng.standard_normal((n, *t.sample_shape))).astype(t.datatype.numpy) for t in p.spec.inputs)
            submit(ActionKind.INFER, p, batch_size=p.spec.batch_size_for(n),
                   requests=[InferenceRequest(p.spec, xs, n, 0.0, 0.0)])
    for holder, name in resident_big:
        submit(ActionKind.UNLOAD, programs[name], holder)
    for _ in range(len(sent) - len(pending)):
        r = done.get(timeout=120)
        _, want = sent[r.action.id]
        if not r.ok:
            failed += 1
        elif want is not None:
            assert r.outputs is not None
            if not all(np.allclose(o, w, rtol=1e-4, atol=1e-5) for o, w in zip(r.outputs, want, strict=True)):
                wrong += 1
    ex.stop()
    return {"seed": seed, "actions": len(sent), "races": len(api.races.races), "wrong_outputs": wrong,
            "failed_actions": failed, "compactions": be.compactions, "first_race": api.races.races[:1]}


def run(quick: bool = False, json_out: str | None = None, seeds: int | None = None, steps: int = 120) -> dict[str, Any]:
    seeds = seeds or (20 if quick else 200)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        programs = _programs(Path(tmp))
        rows = [_one_seed(s, programs, steps) for s in range(seeds)]
    summary = {"seeds": seeds, "actions": sum(r["actions"] for r in rows),
               "races": sum(r["races"] for r in rows), "wrong_outputs": sum(r["wrong_outputs"] for r in rows),
               "failed_actions": sum(r["failed_actions"] for r in rows),
               "seeds_with_compaction": sum(1 for r in rows if r["compactions"]),
               "seconds": time.monotonic() - t0}
    config = {"command": command("standin-races", quick, {"seeds": seeds} if seeds not in (20, 200) else None),
              "steps_per_seed": steps, "mode": "random", "models": [*SMALL, *BIG]}
    notes = ["Each seed: emucuda:0 in random mode, the executor's infer and load lanes concurrent; INFERs of the "
             "small models against LOAD/UNLOAD churn of the big one (compactions move the small ones)."]
    return results.write("standin-races", config, rows, summary, json_out, notes,
                         columns=["seed", "actions", "races", "wrong_outputs", "failed_actions", "compactions"])
