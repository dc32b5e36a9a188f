"""GPU figures through the device seam, on `cuda:N` (or `emucuda:N`, to check the script).

`python -m bench.gpu.figures --device cuda:0 --models DIR --out DIR [--quick]`

- LOAD bandwidth: the backend's chunked LOAD of a model's weights against one plain pinned
  host-to-device copy of the same bytes, in the same run (device time from events; median).
- INFER spread: device time per INFER over 10,000 counted runs per model, mode and batch size
  (after 200 not counted): the demo's mlp_784 eager against CUDA graphs at batch 1, 8 and 32, and
  ResNet-18 (graphs at 1 and 8, eager at 1) and ResNet-50 (graphs at 1) on 3x224x224: p50, p99,
  p99.9, p99.99 and p99.99 / p50 (Clockwork measured 1.0003 on a V100).

On the stand-in every time is modelled (copies at its configured bandwidth, kernels at their
CPU time): the figures only show that the script works.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.gpu.profiles import architectures, export
from daemon.demo import save_model
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.cuda import CudaBackend
from daemon.runtime.devices import Device
from daemon.runtime.executor import make_backend
from daemon.runtime.program import Program, load_program


def device_name(dev: Device) -> str:
    if dev.kind == "cuda":
        return torch.cuda.get_device_name(dev.index)
    return f"{dev.name} (the CPU stand-in: modelled times)"


def weights_model(mib: int, root: Path) -> Program:
    """A two-layer model holding about `mib` MiB of random weights."""
    width = int((mib * 2**20 / 4 / 2) ** 0.5)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 8)).eval()
    extra = torch.nn.Linear(width, width)  # a second square layer without its own output
    model = torch.nn.Sequential(model[0], extra, model[1]).eval()
    save_model(model, "pt2", torch.zeros(2, width), 2, root / f"w{mib}" / "1" / "model.pt2")
    (root / f"w{mib}" / "config.toml").write_text(
        f'max_batch_size = 2\n[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [-1, {width}]\n'
        '[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1, 8]\n')
    return load_program(next(m for m in scan(root).models if m.name == f"w{mib}"))


def load_bandwidth(be: CudaBackend, program: Program, reps: int) -> dict[str, Any]:
    api = be.api
    n = program.weight_bytes
    loads, plain = [], []
    for i in range(reps):
        res, seconds = be.load(f"bw{i}", program, time.monotonic() + 60)
        loads.append(seconds)
        be.unload(res)
    src = be.host.block(program.host_block, api, "plain copy source")
    stream = api.stream("figures-plain")
    api.synchronize(time.monotonic() + 60)  # the last UNLOAD's work on the arena is done
    a, b = api.event(), api.event()
    for _ in range(reps):
        api.record(a, stream)
        api.copy(be.arena_buf.region(0, n), src.region(0, n), stream)
        api.record(b, stream)
        b.wait(time.monotonic() + 60)
        plain.append(a.elapsed_s(b))
    api.synchronize(time.monotonic() + 60)
    load_s, plain_s = statistics.median(loads), statistics.median(plain)
    return {"weight_bytes": n, "load_gbps": n / load_s / 1e9, "plain_copy_gbps": n / plain_s / 1e9,
            "fraction_of_plain": plain_s / load_s, "load_ms": load_s * 1e3, "plain_ms": plain_s * 1e3,
            "reps": reps}


def copy_overlap(be: CudaBackend, load_mib: int, input_kib: int, reps: int) -> dict[str, Any]:
    """Does an INFER's input copy (the h2d stream) wait behind a LOAD's copy (the load stream)?
    A LOAD is one copy from pinned memory; where one engine served both streams in order, an input
    copy issued during it would wait for the rest of it. Device time of a small pinned copy on h2d,
    alone and issued while a `load_mib` copy runs on the load stream (median of `reps`)."""
    api = be.api
    big, small = load_mib << 20, input_kib << 10
    src = api.alloc_pinned(big + small, "overlap source")
    dst = be.arena_buf
    a, b, la, lb = api.event(), api.event(), api.event(), api.event()

    def small_copy(during_load: bool) -> tuple[float, float]:
        if during_load:
            api.record(la, be.load_s)
            api.copy(dst.region(0, big), src.region(0, big), be.load_s)
            api.record(lb, be.load_s)
            time.sleep(0.0005)  # the load copy is under way before the input copy is issued
        api.record(a, be.h2d)
        api.copy(dst.region(big, small), src.region(big, small), be.h2d)
        api.record(b, be.h2d)
        b.wait(time.monotonic() + 60)
        load_s = 0.0
        if during_load:
            lb.wait(time.monotonic() + 60)
            load_s = la.elapsed_s(lb)
        return a.elapsed_s(b), load_s

    alone = [small_copy(False)[0] for _ in range(reps)]
    during = [small_copy(True) for _ in range(reps)]
    api.synchronize(time.monotonic() + 60)
    api.unpin(src)
    alone_s = statistics.median(alone)
    during_s = statistics.median(d for d, _ in during)
    load_s = statistics.median(x for _, x in during)
    return {"load_mib": load_mib, "input_kib": input_kib, "reps": reps, "input_alone_us": alone_s * 1e6,
            "input_during_load_us": during_s * 1e6, "load_copy_ms": load_s * 1e3,
            "waited_behind_load": during_s > alone_s + 0.25 * load_s}


@dataclass(frozen=True)
class SpreadCell:
    program: Program
    batches: tuple[int, ...]
    modes: tuple[bool, ...]  # graphs off / on


class SmClock:
    """The GPU's SM clock through NVML (nvidia-ml-py's pynvml, where installed), as Clockwork reads
    it around each INFER: are the slow replays the ones at a lower clock? 0 where it cannot be read."""

    def __init__(self, dev: Device) -> None:
        self.why = ""
        self._read: Any = None
        if dev.kind != "cuda":
            self.why = "not a CUDA device"
            return
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            # NVML numbers devices its own way (CUDA_VISIBLE_DEVICES renumbers CUDA's): match by UUID
            want = str(getattr(torch.cuda.get_device_properties(dev.index), "uuid", "")).lower()
            h = pynvml.nvmlDeviceGetHandleByIndex(dev.index)
            for i in range(pynvml.nvmlDeviceGetCount()):
                cand = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(cand)
                uuid = (uuid.decode() if isinstance(uuid, bytes) else uuid).lower().removeprefix("gpu-")
                if want and uuid == want:
                    h = cand
                    break
            self._read = lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            self._read()
        except Exception as e:  # no NVML: the spread is reported without clocks
            self._read, self.why = None, f"{type(e).__name__}: {e}"

    def read(self) -> int:
        if self._read is None:
            return 0
        try:
            return int(self._read())
        except Exception as e:  # a figure without clocks rather than no figure
            self._read, self.why = None, f"{type(e).__name__}: {e}"
            return 0


def clock_facts(d: np.ndarray, mhz: np.ndarray) -> dict[str, Any]:
    """How the clock went during a cell, and the spread among the runs at its most common clock."""
    if not mhz.size or not mhz.any():
        return {}
    values, counts = np.unique(mhz, return_counts=True)
    mode = int(values[counts.argmax()])
    at_mode = d[mhz == mode]
    slow = d >= np.percentile(d, 99.9)
    p50 = float(np.percentile(at_mode, 50))
    return {"clock_mhz_min": int(mhz.min()), "clock_mhz_max": int(mhz.max()), "clock_mhz_mode": mode,
            "runs_at_mode": int(at_mode.size), "slowest_0_1pct_clock_mhz_mean": float(mhz[slow].mean()),
            "p9999_over_p50_at_mode": float(np.percentile(at_mode, 99.99)) / p50 if p50 > 0 else float("nan")}


def infer_spread(be: CudaBackend, cells: list[SpreadCell], runs: int, warmup: int, cell_s: float
                 ) -> list[dict[str, Any]]:
    """Device time per INFER: `warmup` runs not counted, then `runs` counted (fewer only if a cell
    passes `cell_s` wall seconds; each row says how many ran), with the SM clock read after each."""
    rows = []
    clock = SmClock(be.device)
    if clock.why:
        print(f"SM clock not read: {clock.why}", flush=True)
    for cell in cells:
        spec = cell.program.spec
        for graphs in cell.modes:
            be.graphs_enabled = graphs
            res, _ = be.load(f"spread-{spec.name}-{graphs}", cell.program, time.monotonic() + 120)
            if graphs and res.notes:
                print(f"{spec.key}: {res.notes}", flush=True)
            for b in cell.batches:
                xs = tuple(np.random.default_rng(b).random((b, *t.sample_shape)).astype(t.datatype.numpy)
                           for t in spec.inputs)
                req = InferenceRequest(spec, xs, b, 0.0, 0.0)
                d, mhz = [], []
                stop = None
                for i in range(warmup + runs):
                    if i == warmup:
                        stop = time.monotonic() + cell_s
                    outs, seconds = be.infer(res, res.io[b], lambda io, r=req: io.fill([r]), time.monotonic() + 10)
                    del outs
                    if stop is not None:
                        d.append(seconds)
                        mhz.append(clock.read())  # (after the INFER's timed part: it adds nothing to it)
                        if time.monotonic() > stop:
                            break
                a = np.array(d)
                p50, p99, p999, p9999 = (float(np.percentile(a, q)) for q in (50, 99, 99.9, 99.99))
                rows.append({"model": spec.name, "mode": "graph" if graphs and res.state.graphs else "eager",
                             "batch": b, "runs": len(a), "p50_us": p50 * 1e6, "p99_us": p99 * 1e6,
                             "p999_us": p999 * 1e6, "p9999_us": p9999 * 1e6, "max_us": float(a.max()) * 1e6,
                             "p99_over_p50": p99 / p50 if p50 > 0 else float("nan"),
                             "p9999_over_p50": p9999 / p50 if p50 > 0 else float("nan"), "notes": res.notes,
                             **clock_facts(a, np.array(mhz))})
                print(f"spread {spec.name} {rows[-1]['mode']} b{b}: {len(a)} runs, p50 {p50 * 1e6:.1f} us, "
                      f"p99.99/p50 {rows[-1]['p9999_over_p50']:.4f}", flush=True)
            be.unload(res)
            if be.device.kind == "cuda":
                torch.cuda.empty_cache()  # eager activations must not count against the next captures
    be.graphs_enabled = True
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.figures")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", required=True, help="a demo repository (escapement demo --out DIR)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=10_000, help="counted INFERs per model, mode and batch")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kind, _, idx = args.device.partition(":")
    # cuda: a roomy workspace (ResNet-50's graphs beside eager activations, cuBLAS's per-stream
    # workspaces on Hopper); the arena (budget less workspace) holds the 256 MiB LOAD model
    budget, workspace = ((6 << 30), (4 << 30)) if kind == "cuda" else ((768 << 20), (256 << 20))
    dev = Device(args.device, kind, int(idx), budget, workspace)  # type: ignore[arg-type]
    be = make_backend(dev, 1)
    assert isinstance(be, CudaBackend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quick = args.quick or kind != "cuda"
    runs, warmup, cell_s = (300, 30, 5.0) if quick else (args.runs, 200, 20.0)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        bandwidth = [load_bandwidth(be, weights_model(mib, Path(tmp)), 5) for mib in
                     ((16,) if kind != "cuda" else (64, 256))]
        overlap = copy_overlap(be, 16 if quick else 256, 588, 5 if quick else 20)  # 588 KiB: one 3x224x224
        mlp = load_program(next(m for m in scan(args.models).models if m.name == "mlp_784"))
        cells = [SpreadCell(mlp, (1, 8, 32), (False, True))]
        if not quick:  # ResNet-sized work: graphs at batch 1 and 8, eager at batch 1
            r18, r50 = (export(a, 8, Path(tmp)) for a in architectures(224, 64)[:2])
            cells += [SpreadCell(r18, (1,), (False,)), SpreadCell(r18, (1, 8), (True,)),
                      SpreadCell(r50, (1,), (True,))]
        spread = infer_spread(be, cells, runs, warmup, cell_s)
    be.close()
    result = {"device": device_name(dev), "torch": torch.__version__,
              "command": f"python -m bench.gpu.figures --device {args.device} --models DIR --out DIR"
                         + (" --quick" if args.quick else "")
                         + (f" --runs {args.runs}" if args.runs != 10_000 else ""),
              "seconds": time.monotonic() - t0, "load_bandwidth": bandwidth, "copy_overlap": overlap,
              "infer_spread": spread}
    (out / "figures.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# GPU figures on {result['device']}", "", f"`{result['command']}` (torch {torch.__version__})", "",
             "## LOAD bandwidth (chunked LOAD vs one plain pinned copy of the same bytes)", "",
             "| MiB | LOAD GB/s | plain GB/s | fraction |", "|---|---|---|---|"]
    lines += [f"| {r['weight_bytes'] / 2**20:.0f} | {r['load_gbps']:.2f} | {r['plain_copy_gbps']:.2f} | "
              f"{r['fraction_of_plain']:.3f} |" for r in bandwidth]
    lines += ["", "## An input copy issued during a LOAD's copy (h2d stream against the load stream)", "",
              "| LOAD copy MiB | LOAD copy ms | input KiB | input copy alone µs | input copy during the LOAD µs | "
              "waited behind the LOAD |", "|---|---|---|---|---|---|",
              f"| {overlap['load_mib']} | {overlap['load_copy_ms']:.2f} | {overlap['input_kib']} | "
              f"{overlap['input_alone_us']:.1f} | {overlap['input_during_load_us']:.1f} | "
              f"{'yes' if overlap['waited_behind_load'] else 'no'} |"]
    lines += ["", "## INFER device time spread (events inside a graph; around the launches eager)", "",
              "| model | mode | batch | runs | p50 µs | p99 µs | p99.9 µs | p99.99 µs | max µs | p99 / p50 "
              "| p99.99 / p50 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['mode']} | {r['batch']} | {r['runs']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
              f"{r['p999_us']:.1f} | {r['p9999_us']:.1f} | {r['max_us']:.1f} | {r['p99_over_p50']:.4f} | "
              f"{r['p9999_over_p50']:.4f} |" for r in spread]
    clocked = [r for r in spread if "clock_mhz_mode" in r]
    if clocked:
        lines += ["", "## SM clock during the spread runs (NVML, read after each INFER)", "",
                  "| model | mode | batch | clock MHz min / mode / max | runs at the mode | mean clock of the slowest "
                  "0.1% | p99.99 / p50 at the mode |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['mode']} | {r['batch']} | {r['clock_mhz_min']} / {r['clock_mhz_mode']} / "
                  f"{r['clock_mhz_max']} | {r['runs_at_mode']} | {r['slowest_0_1pct_clock_mhz_mean']:.0f} | "
                  f"{r['p9999_over_p50_at_mode']:.4f} |" for r in clocked]
    (out / "figures.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
