"""INFER profiles of standard architectures per batch size, through escapement's own CUDA backend.

`python -m bench.gpu.profiles --device cuda:0 --out DIR [--quick] [--runs N]`

Models (random weights, written here in plain torch: no torchvision): ResNet-18 and ResNet-50 on
3x224x224, an MLP 784-1024-1024-10 (the demo's mlp_784), and a transformer encoder (4 layers,
d_model 256, 4 heads, 64 tokens, mean-pooled into 10 outputs). Each is saved with the repo's own
save path (`demo.save_model`, model.pt2), read back with `load_program`, LOADed by the backend and
run with `CudaBackend.infer` at batch 1..32, CUDA graphs off and on: median and p99 of the device
time (the backend's events around the kernel), and the median wall time of the whole INFER
(input copy, kernel, output copy).

Writes `DIR/profiles.json`, which the simulator reads as device profiles
(`daemon.sim.load_profiles`: per model weight bytes, LOAD seconds and median INFER seconds per
batch size, in the mode the daemon runs by default: CUDA graphs where they capture), with every
measurement beside it, and `DIR/profiles.md`, a table naming the GPU.

On the stand-in (`emucuda:N`) times are modelled (kernels at their CPU time): the run only shows
the script works, so it uses small inputs, batch 1 and 2, and few runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from daemon.demo import save_model
from daemon.errors import ProgramError
from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import IOBuffers, Resident
from daemon.runtime.cuda import CudaBackend
from daemon.runtime.devices import Device
from daemon.runtime.executor import make_backend
from daemon.runtime.program import Program, load_program

MIN_RUNS = 20  # a cell out of time still runs this many (its p99 is then its maximum)

FORMAT = "escapement.sim-profiles/1"  # daemon.sim.load_profiles checks it

# ------------------------------------------------------------------ models (torchvision's ResNets, rewritten)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = _downsample(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + (self.down(x) if self.down is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)  # stride on the 3x3 (ResNet v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = _downsample(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + (self.down(x) if self.down is not None else x))


def _downsample(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock | Bottleneck], layers: tuple[int, ...], classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        stages: list[nn.Module] = []
        cin = 64
        for i, n in enumerate(layers):
            width = 64 << i
            blocks: list[nn.Module] = []
            for j in range(n):
                blocks.append(block(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's init: activations stay finite through 50 layers
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


class Encoder(nn.Module):
    """nn.TransformerEncoder (batch_first) over already-embedded tokens, mean-pooled to `classes`."""

    def __init__(self, d_model: int = 256, heads: int = 4, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        # No nested tensors: export needs the plain path (and inputs have no padding mask).
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


@dataclass(frozen=True)
class Arch:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample
    outputs: int
    description: str


def architectures(image: int, tokens: int) -> list[Arch]:
    return [
        Arch("resnet18", lambda: ResNet(BasicBlock, (2, 2, 2, 2)), (3, image, image), 1000,
             f"ResNet-18, 3x{image}x{image}"),
        Arch("resnet50", lambda: ResNet(Bottleneck, (3, 4, 6, 3)), (3, image, image), 1000,
             f"ResNet-50, 3x{image}x{image}"),
        Arch("mlp_784", lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                              nn.Linear(1024, 10)), (784,), 10, "MLP 784-1024-1024-10"),
        Arch("transformer", Encoder, (tokens, 256), 10,
             f"transformer encoder, 4 layers, d_model 256, 4 heads, {tokens} tokens"),
    ]


def export(arch: Arch, max_batch: int, root: Path) -> Program:
    """Save through the repo's own path (model.pt2 and config.toml), then load it as the daemon does."""
    torch.manual_seed(0)
    model = arch.build().eval()
    save_model(model, "pt2", torch.zeros(2, *arch.input_shape), max_batch, root / arch.name / "1" / "model.pt2")
    shape = ", ".join(str(d) for d in (-1, *arch.input_shape))
    (root / arch.name / "config.toml").write_text(
        f'description = "{arch.description}"\nmax_batch_size = {max_batch}\n'
        f'[[inputs]]\nname = "x"\ndatatype = "FP32"\nshape = [{shape}]\n'
        f'[[outputs]]\nname = "y"\ndatatype = "FP32"\nshape = [-1, {arch.outputs}]\n')
    return load_program(next(m for m in scan(root).models if m.name == arch.name))


# ------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class Plan:
    image: int
    tokens: int
    max_batch: int
    runs: int  # measured runs per model, batch and mode (fewer if cell_s runs out)
    warmup: int  # runs before those, not counted
    cell_s: float  # wall seconds one (model, batch, mode) may take at most
    budget_s: float  # wall seconds all cells may take: each gets its share of what is left
    load_reps: int


def plan_for(kind: str, quick: bool, runs: int | None) -> Plan:
    if kind == "cuda":
        p = Plan(224, 64, 32, 50 if quick else 200, 10, 0.8 if quick else 2.5, 15 if quick else 45, 3)
    else:  # the stand-in runs kernels on this machine's CPU: small inputs, batch 1 and 2
        p = Plan(64, 16, 2, 5 if quick else 20, 2, 1.0 if quick else 3.0, 8 if quick else 25, 2)
    return p if runs is None else replace(p, runs=runs)


class Budget:
    """Shares the measuring time among the cells still to run, so slow models cannot stretch the run."""

    def __init__(self, seconds: float, cells: int) -> None:
        self.end = time.monotonic() + seconds
        self.cells = cells

    def next_cell(self, most_s: float) -> float:
        share = max(0.0, self.end - time.monotonic()) / max(self.cells, 1)
        self.cells -= 1
        return min(most_s, share)


def _sizes(max_batch: int) -> tuple[int, ...]:
    return ModelSpec("n", 1, Path("n"), "pt2", (), (), max_batch, 0.1).batch_sizes  # the daemon's batch sizes


def device_name(dev: Device) -> str:
    if dev.kind == "cuda":
        return torch.cuda.get_device_name(dev.index)
    return f"{dev.name} (the CPU stand-in: modelled times)"


def _release_cache(dev: Device) -> None:
    # The backend counts what the caching allocator holds against its workspace reserve; what eager
    # runs cached must not count against the graphs captured next.
    if dev.kind == "cuda":
        torch.cuda.empty_cache()


def run_cell(be: CudaBackend, res: Resident, spec: ModelSpec, b: int, plan: Plan, cell_s: float
             ) -> tuple[list[float], list[float]]:
    """Device and wall seconds of INFERs of one batch size, as figures.infer_spread runs them."""
    rng = np.random.default_rng(b)
    xs = tuple(rng.random((b, *t.sample_shape)).astype(t.datatype.numpy) for t in spec.inputs)
    req = InferenceRequest(spec, xs, b, 0.0, 0.0)
    io = res.io[b]

    def fill(io: IOBuffers, r: InferenceRequest = req) -> int:
        return io.fill([r])

    device: list[float] = []
    wall: list[float] = []
    for _ in range(plan.warmup):
        be.infer(res, io, fill, time.monotonic() + 10)
    stop = time.monotonic() + cell_s
    for i in range(plan.runs):
        t0 = time.perf_counter()
        outs, seconds = be.infer(res, io, fill, time.monotonic() + 10)
        wall.append(time.perf_counter() - t0)
        device.append(seconds)
        del outs  # hands the output slot back to the ring
        if i >= MIN_RUNS and time.monotonic() > stop:  # the rows say how many ran
            break
    return device, wall


def profile_model(be: CudaBackend, program: Program, plan: Plan, budget: Budget
                  ) -> tuple[list[dict[str, Any]], list[float]]:
    spec = program.spec
    loads: list[float] = []
    for i in range(plan.load_reps - 1):  # extra LOADs, only for the LOAD time (graphs off: cheaper)
        be.graphs_enabled = False
        res, seconds = be.load(f"{spec.name}-load{i}", program, time.monotonic() + 120)
        loads.append(seconds)
        be.unload(res)
    rows: list[dict[str, Any]] = []
    for graphs in (False, True):
        be.graphs_enabled = graphs
        res, seconds = be.load(f"{spec.name}-{'graph' if graphs else 'eager'}", program, time.monotonic() + 120)
        loads.append(seconds)
        if graphs and res.notes:
            print(f"{spec.name}: {res.notes}", flush=True)
        mode = "graph" if res.state.graphs else "eager"
        for b in spec.batch_sizes:
            device, wall = run_cell(be, res, spec, b, plan, budget.next_cell(plan.cell_s))
            d = np.array(device)
            rows.append({"model": spec.name, "graphs_enabled": graphs, "mode": mode, "batch": b, "runs": len(d),
                         "median_us": float(np.median(d)) * 1e6, "p99_us": float(np.percentile(d, 99)) * 1e6,
                         "min_us": float(d.min()) * 1e6, "max_us": float(d.max()) * 1e6,
                         "wall_median_us": statistics.median(wall) * 1e6, "notes": res.notes})
        be.unload(res)
        _release_cache(be.device)
    be.graphs_enabled = True
    return rows, loads


def sim_profile(program: Program, rows: list[dict[str, Any]], loads: list[float]) -> dict[str, Any]:
    """What daemon.sim.load_profiles reads: the runs with graphs enabled (the daemon's default, which
    falls back to eager when a model does not capture)."""
    mine = sorted((r for r in rows if r["graphs_enabled"]), key=lambda r: r["batch"])
    return {"weight_bytes": program.weight_bytes, "load_s": statistics.median(loads),
            "mode": mine[0]["mode"] if mine else "eager",
            "infer_s": {str(r["batch"]): r["median_us"] / 1e6 for r in mine},
            "infer_p99_s": {str(r["batch"]): r["p99_us"] / 1e6 for r in mine}}


# ------------------------------------------------------------------ report


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# INFER profiles on {result['device']}", "",
             f"`{result['command']}` (torch {result['torch']}, {result['seconds']:.0f} s)", "",
             "Device time per INFER (the backend's events around the kernel), CUDA graphs off and on; "
             "wall: the whole INFER (input copy, kernel, output copy) seen from the host.", ""]
    for name, m in result["models"].items():
        if "error" in m:
            lines += [f"## {name}: {m['description']}", "", f"not served: {m['error']}", ""]
            continue
        prof = result["profiles"][name]
        lines += [f"## {name}: {m['description']}", "",
                  f"weights {m['weight_bytes'] / 1e6:.1f} MB, LOAD {prof['load_s'] * 1e3:.2f} ms (median of "
                  f"{m['loads']}); simulator profile mode: {prof['mode']}", ""]
        if m["notes"]:
            lines += [f"graphs not used: {m['notes']}", ""]
        lines += ["| batch | eager median µs | eager p99 µs | graph median µs | graph p99 µs | graph/eager "
                  "| wall median µs (graph) | runs |", "|---|---|---|---|---|---|---|---|"]
        by = {(r["batch"], r["graphs_enabled"]): r for r in result["measurements"] if r["model"] == name}
        for b in sorted({k[0] for k in by}):
            e, g = by.get((b, False)), by.get((b, True))
            if e is None or g is None:
                continue
            ratio = g["median_us"] / e["median_us"] if e["median_us"] > 0 else float("nan")
            lines.append(f"| {b} | {e['median_us']:.1f} | {e['p99_us']:.1f} | {g['median_us']:.1f} | "
                         f"{g['p99_us']:.1f} | {ratio:.3f} | {g['wall_median_us']:.1f} | {g['runs']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.profiles")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=None, help="measured runs per model, batch and mode")
    ap.add_argument("--models", default="", help="comma-separated subset (resnet18,resnet50,mlp_784,transformer)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kind, _, idx = args.device.partition(":")
    plan = plan_for(kind, args.quick, args.runs)
    # cuda: a roomy workspace, so ResNet-50's batch-32 graphs fit beside its eager activations.
    budget, workspace = ((6 << 30), (4 << 30)) if kind == "cuda" else ((768 << 20), (256 << 20))
    dev = Device(args.device, kind, int(idx), budget, workspace)  # type: ignore[arg-type]
    be = make_backend(dev, 1)
    assert isinstance(be, CudaBackend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    archs = architectures(plan.image, plan.tokens)
    if args.models:
        want = set(args.models.split(","))
        archs = [a for a in archs if a.name in want]
    t0 = time.monotonic()
    budget = Budget(plan.budget_s, 2 * sum(len(_sizes(plan.max_batch)) for _ in archs))
    measurements: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    models: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for arch in archs:
                t1 = time.monotonic()
                program = export(arch, plan.max_batch, Path(tmp))
                t2 = time.monotonic()
                try:
                    rows, loads = profile_model(be, program, plan, budget)
                except ProgramError as e:  # a finding, not a reason to lose the other models' figures
                    print(f"{arch.name}: not served on {args.device}: {e}", flush=True)
                    models[arch.name] = {"description": arch.description, "input_shape": list(arch.input_shape),
                                         "weight_bytes": program.weight_bytes, "error": str(e)}
                    continue
                measurements += rows
                profiles[arch.name] = sim_profile(program, rows, loads)
                notes = next((r["notes"] for r in rows if r["graphs_enabled"] and r["notes"]), "")
                models[arch.name] = {"description": arch.description, "input_shape": list(arch.input_shape),
                                     "weight_bytes": program.weight_bytes, "loads": len(loads), "notes": notes,
                                     "export_s": t2 - t1, "measure_s": time.monotonic() - t2}
                print(f"{arch.name}: export+load_program {t2 - t1:.1f} s, measured in "
                      f"{time.monotonic() - t2:.1f} s", flush=True)
    finally:
        be.close()
    cmd = f"python -m bench.gpu.profiles --device {args.device} --out DIR" + (" --quick" if args.quick else "")
    if args.runs is not None:
        cmd += f" --runs {args.runs}"
    if args.models:
        cmd += f" --models {args.models}"
    result = {"format": FORMAT, "device": device_name(dev), "device_kind": kind, "torch": torch.__version__,
              "command": cmd, "seconds": time.monotonic() - t0,
              "tf32": {"matmul": torch.backends.cuda.matmul.allow_tf32, "cudnn": torch.backends.cudnn.allow_tf32},
              "cudnn_benchmark": torch.backends.cudnn.benchmark,
              "stat": "infer_s: median device seconds per INFER, with CUDA graphs enabled (eager where they "
                      "did not capture, see each profile's mode); infer_p99_s: the p99",
              "plan": asdict(plan), "profiles": profiles, "models": models, "measurements": measurements}
    (out / "profiles.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (out / "profiles.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
