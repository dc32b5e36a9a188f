"""ParM parity encode/decode on the GPU: escapement's torch code against fused cupy kernels (issue 11 item 5).

`python -m bench.gpu.parity_codec --device cuda:0 --out DIR [--quick]`

What is timed, per case (k = 2, 3, 4; inputs of 784 floats and 3x224x224 images, outputs of 10
and 1000 classes; batch 1, 8, 32; float32):

- encode `sum` (daemon/parity/codes.py `encode_sum`: copy the first member, then k-1 in-place
  adds into the executor's input buffer) against one cupy ElementwiseKernel reading all k
  members and writing the buffer once.
- encode `concat` (`encode_concat`, escapement's default for images at k = 2 and 4: each image
  area-averaged and tiled) against one kernel that averages and tiles in a single pass.
- decode (`decode`: clone the parity output, subtract the k-1 others in place) against one
  kernel computing parity - o_1 - ... - o_{k-1}.

The cupy kernels add in the same order as torch, so the results should be bit-identical; each
case checks `allclose` and records the largest difference. Columns: `us` is device time between
CUDA events around one op on an idle stream (latency, launch cost included), median of the reps
(torch and cupy interleaved rep by rep, so clock drift hits both); `pipelined_us` is one event
pair around all reps issued back to back, divided by the reps (what a busy stream pays);
`launch_us` is host time to issue the op; `cupy_views_us` is cupy with its array views made once
(the cupy column converts the torch tensors on every call, as a daemon holding torch tensors
would); `host_us` is the same torch code on host tensors, which is where escapement runs it
today (the executor encodes into the pinned host buffer; the controller decodes numpy outputs).

cupy is imported lazily and is not a dependency of the project: without it (or without CUDA)
the torch path is timed on the CPU, cupy is marked unavailable and the script still exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from daemon.parity import codes

KS = (2, 3, 4)
BATCHES = (1, 8, 32)
INPUT_SAMPLES: tuple[tuple[int, ...], ...] = ((784,), (3, 224, 224))
OUTPUT_SAMPLES: tuple[tuple[int, ...], ...] = ((10,), (1000,))
MEASURABLE = 0.10  # a ratio within 10% of 1 is called a tie: run-to-run noise is of that order

Op = Callable[[], torch.Tensor]


@dataclass(slots=True)
class Case:
    op: str  # encode_sum, encode_concat, decode
    k: int
    shape: tuple[int, ...]  # one member's tensor, batch first
    torch_op: Op
    cupy_op: Op | None = None
    cupy_views_op: Op | None = None
    host_op: Op | None = None
    torch_impl: str = ""


# ---------------------------------------------------------------------------- cupy kernels


class CupyCodec:
    """Fused kernels, built per k on first use (NVRTC compiles them once; cupy caches on disk)."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self._kernels: dict[tuple[str, int], Any] = {}

    def _kernel(self, op: str, k: int) -> Any:
        key = (op, k)
        if key not in self._kernels:
            self._kernels[key] = self._build(op, k)
        return self._kernels[key]

    def _build(self, op: str, k: int) -> Any:
        ek = self.cp.ElementwiseKernel
        if op == "encode_sum":
            # Left to right, as torch's copy then += does: the same float rounding.
            return ek(", ".join(f"T x{i}" for i in range(k)), "T y",
                      "y = " + " + ".join(f"x{i}" for i in range(k)), f"escapement_encode_sum_{k}")
        if op == "decode":
            return ek(", ".join(["T p", *(f"T o{i}" for i in range(k - 1))]), "T y",
                      "y = p" + "".join(f" - o{i}" for i in range(k - 1)), f"escapement_decode_{k}")
        if op == "encode_concat":
            members = ", ".join(f"raw T x{i}" for i in range(k))
            pick = " : ".join(f"t == {i} ? &x{i}[0]" for i in range(k - 1)) + f" : &x{k - 1}[0]"
            if k == 2:
                # out[.., y, x]: member x / (W/2), columns 2x' and 2x'+1 of its row, halved.
                body = f"""
                const ptrdiff_t w2 = W / 2, x = i % W, row = i / W;
                const int t = (int)(x / w2);
                const T* s = {pick};
                const ptrdiff_t j = row * W + 2 * (x - t * w2);
                y = (s[j] + s[j + 1]) * (T)0.5;"""
            else:
                # Quadrants in reading order; row pairs summed first, then column pairs, as
                # encode_concat's two strided adds do (same rounding).
                body = f"""
                const ptrdiff_t h2 = H / 2, w2 = W / 2, x = i % W, yy = (i / W) % H, plane = i / (H * W);
                const int r = (int)(yy / h2), c = (int)(x / w2), t = 2 * r + c;
                const T* s = {pick};
                const ptrdiff_t j = plane * H * W + 2 * (yy - r * h2) * W + 2 * (x - c * w2);
                y = ((s[j] + s[j + W]) + (s[j + 1] + s[j + 1 + W])) * (T)0.25;"""
            return ek(f"{members}, int64 H, int64 W", "T y", body, f"escapement_encode_concat_{k}")
        raise ValueError(op)

    def run(self, op: str, args: Sequence[Any], out: Any, hw: tuple[int, int] | None = None) -> None:
        kern = self._kernel(op, len(args))  # k members, or the parity and k-1 others
        if hw is None:
            kern(*args, out)
        else:
            kern(*args, hw[0], hw[1], out)


def load_cupy() -> tuple[Any | None, str]:
    """cupy, or None and why not (it is optional: only the GPU image has it)."""
    try:
        import cupy  # lazy on purpose: not a project dependency, only the GPU image has it
    except Exception as e:  # ImportError, or a CUDA library it cannot load
        return None, f"import cupy failed: {type(e).__name__}: {e}"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "cupy sees no CUDA device"
    except Exception as e:
        return None, f"cupy sees no CUDA device: {type(e).__name__}: {e}"
    return cupy, ""


# ---------------------------------------------------------------------------- torch paths


def encode_concat_on_device(xs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """codes.encode_concat with its k = 4 scratch allocated on the members' device: escapement's
    own allocates it on the host (no device=), so it cannot take CUDA tensors at k = 4."""
    if len(xs) == 2:
        return codes.encode_concat(xs, out=out)
    x0 = xs[0]
    _, _, h, w = x0.shape
    h2, w2 = h // 2, w // 2
    rows = torch.empty((*x0.shape[:2], h2, w), dtype=x0.dtype, device=x0.device)
    for i, x in enumerate(xs):
        r, c = divmod(i, 2)
        torch.add(x[:, :, 0::2], x[:, :, 1::2], out=rows)
        torch.add(rows[..., 0::2], rows[..., 1::2], out=out[:, :, r * h2 : (r + 1) * h2, c * w2 : (c + 1) * w2])
    return out.mul_(0.25)


def concat_impl(xs: Sequence[torch.Tensor], out: torch.Tensor) -> tuple[Callable[..., torch.Tensor], str]:
    """escapement's encode_concat where it runs on these tensors, else the device-scratch copy."""
    try:
        codes.encode_concat(xs, out=out)
    except (RuntimeError, ValueError) as e:
        return encode_concat_on_device, f"encode_concat_on_device (codes.encode_concat raised: {str(e)[:120]})"
    return codes.encode_concat, "codes.encode_concat"


# ---------------------------------------------------------------------------- cases


def make_cases(dev: torch.device, cc: CupyCodec | None, host: bool) -> list[Case]:
    gen = torch.Generator(device="cpu").manual_seed(11)

    def members(n: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
        return [torch.randn(shape, generator=gen).to(dev) for _ in range(n)]

    cases: list[Case] = []
    for k in KS:
        for sample in INPUT_SAMPLES:
            for b in BATCHES:
                shape = (b, *sample)
                xs = members(k, shape)
                cases.append(encode_case("encode_sum", xs, cc, host))
                if len(sample) == 3 and k in (2, 4):  # the concat code is defined for images at k = 2, 4
                    cases.append(encode_case("encode_concat", xs, cc, host))
        for sample in OUTPUT_SAMPLES:
            for b in BATCHES:
                cases.append(decode_case(members(k, (b, *sample)), cc, host))
    return cases


def encode_case(op: str, xs: list[torch.Tensor], cc: CupyCodec | None, host: bool) -> Case:
    out = torch.empty_like(xs[0])  # the executor encodes into its preallocated input buffer
    if op == "encode_sum":
        enc, impl = codes.encode_sum, "codes.encode_sum"
    else:
        enc, impl = concat_impl(xs, out)
    case = Case(op, len(xs), tuple(xs[0].shape), lambda: enc(xs, out=out), torch_impl=impl)
    hw = (xs[0].shape[-2], xs[0].shape[-1]) if op == "encode_concat" else None
    if cc is not None:
        cp = cc.cp
        cout = torch.empty_like(out)  # a buffer of its own, so the comparison sees cupy's writes

        def fused() -> torch.Tensor:
            cc.run(op, [cp.asarray(x) for x in xs], cp.asarray(cout), hw)
            return cout

        views, vout = [cp.asarray(x) for x in xs], cp.asarray(cout)

        def fused_views() -> torch.Tensor:
            cc.run(op, views, vout, hw)
            return cout

        case.cupy_op, case.cupy_views_op = fused, fused_views
    if host and xs[0].device.type != "cpu":
        hxs = [x.cpu() for x in xs]
        hout = torch.empty_like(hxs[0])
        henc = codes.encode_sum if op == "encode_sum" else codes.encode_concat
        case.host_op = lambda: henc(hxs, out=hout)
    return case


def decode_case(outs: list[torch.Tensor], cc: CupyCodec | None, host: bool) -> Case:
    parity, others = outs[0], outs[1:]
    case = Case("decode", len(outs), tuple(parity.shape), lambda: codes.decode(parity, others),
                torch_impl="codes.decode")
    if cc is not None:
        cp = cc.cp

        def fused() -> torch.Tensor:
            y = torch.empty_like(parity)  # allocated by torch, as codes.decode's clone is
            cc.run("decode", [cp.asarray(parity), *(cp.asarray(o) for o in others)], cp.asarray(y))
            return y

        vout = torch.empty_like(parity)
        views, vy = [cp.asarray(parity), *(cp.asarray(o) for o in others)], cp.asarray(vout)

        def fused_views() -> torch.Tensor:
            cc.run("decode", views, vy)
            return vout

        case.cupy_op, case.cupy_views_op = fused, fused_views
    if host and parity.device.type != "cpu":
        hp, ho = parity.cpu(), [o.cpu() for o in others]
        case.host_op = lambda: codes.decode(hp, ho)
    return case


# ---------------------------------------------------------------------------- timing


def time_cuda(ops: dict[str, Op], reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per op: median event time of one op on an idle stream, median host issue time, and the
    pipelined time per op over `reps` issued back to back. Ops interleave rep by rep."""
    for _ in range(warmup):
        for fn in ops.values():
            fn()
    torch.cuda.synchronize()
    ev = {name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for name in ops}
    lat: dict[str, list[float]] = {n: [] for n in ops}
    launch: dict[str, list[float]] = {n: [] for n in ops}
    for _ in range(reps):
        for name, fn in ops.items():
            a, b = ev[name]
            a.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()  # the next op starts on an idle stream: this times latency, not overlap
            lat[name].append(a.elapsed_time(b) * 1e3)
            launch[name].append((t1 - t0) * 1e6)
    res = {}
    for name, fn in ops.items():
        a, b = ev[name]
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        res[name] = {"us": statistics.median(lat[name]), "launch_us": statistics.median(launch[name]),
                     "pipelined_us": a.elapsed_time(b) * 1e3 / reps}
    return res


def time_host(fn: Op, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    d = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        d.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(d)


def compare(ref: torch.Tensor, got: torch.Tensor) -> tuple[bool, float]:
    return bool(torch.allclose(got, ref, rtol=1e-5, atol=1e-6)), float((got - ref).abs().max())


def run_case(c: Case, cuda: bool, reps: int, warmup: int, host_reps: int) -> dict[str, Any]:
    row: dict[str, Any] = {"op": c.op, "k": c.k, "shape": list(c.shape), "dtype": "float32",
                           "bytes": 4 * int(torch.Size(c.shape).numel()), "torch_impl": c.torch_impl}
    if not cuda:
        row.update(torch_us=time_host(c.torch_op, reps, warmup), cupy_us=None, ratio=None)
        return row
    ops: dict[str, Op] = {"torch": c.torch_op}
    if c.cupy_op is not None and c.cupy_views_op is not None:
        ref = c.torch_op().clone()
        ok, diff = compare(ref, c.cupy_op().clone())
        ok2, diff2 = compare(ref, c.cupy_views_op().clone())
        row.update(allclose=ok and ok2, max_abs_diff=max(diff, diff2))
        ops |= {"cupy": c.cupy_op, "cupy_views": c.cupy_views_op}
    t = time_cuda(ops, reps, warmup)
    row.update(torch_us=t["torch"]["us"], torch_launch_us=t["torch"]["launch_us"],
               torch_pipelined_us=t["torch"]["pipelined_us"])
    if "cupy" in t:
        row.update(cupy_us=t["cupy"]["us"], cupy_launch_us=t["cupy"]["launch_us"],
                   cupy_pipelined_us=t["cupy"]["pipelined_us"], cupy_views_us=t["cupy_views"]["us"],
                   ratio=t["cupy"]["us"] / t["torch"]["us"],
                   ratio_pipelined=t["cupy"]["pipelined_us"] / t["torch"]["pipelined_us"])
    else:
        row.update(cupy_us=None, ratio=None)
    if c.host_op is not None:
        row["host_us"] = time_host(c.host_op, host_reps, min(warmup, 5))
    return row


# ---------------------------------------------------------------------------- report


def label(r: dict[str, Any]) -> str:
    return "x".join(map(str, r["shape"]))


def verdict(rows: list[dict[str, Any]], cupy_reason: str) -> str:
    if cupy_reason:
        return f"cupy unavailable ({cupy_reason}): torch timed alone, no comparison; keep torch"
    cmp = [r for r in rows if r.get("ratio") is not None]
    if not cmp:
        return "no case compared: keep torch"
    bad = [r for r in cmp if not r.get("allclose")]
    wins = [r for r in cmp if r["ratio"] < 1 - MEASURABLE]
    losses = [r for r in cmp if r["ratio"] > 1 + MEASURABLE]
    total = sum(r["cupy_us"] for r in cmp) / sum(r["torch_us"] for r in cmp)
    total_p = sum(r["cupy_pipelined_us"] for r in cmp) / sum(r["torch_pipelined_us"] for r in cmp)

    def span(rs: list[dict[str, Any]]) -> str:
        lo, hi = min(r["bytes"] for r in rs), max(r["bytes"] for r in rs)
        ratios = [r["ratio"] for r in rs]
        return f"{size(lo)}-{size(hi)}, cupy/torch {min(ratios):.2f}-{max(ratios):.2f}"

    per_op = []
    for op in sorted({r["op"] for r in cmp}):
        w, lo = [r for r in wins if r["op"] == op], [r for r in losses if r["op"] == op]
        parts = ([f"cupy faster in {len(w)} ({span(w)})"] if w else []) + \
                ([f"torch faster in {len(lo)} ({span(lo)})"] if lo else [])
        n = sum(r["op"] == op for r in cmp)
        per_op.append(f"{op}: " + (", ".join(parts) or "ties") + f" of {n}")
    keep = "cupy" if total < 1 - MEASURABLE and not bad else "torch"
    return (f"{'; '.join(per_op)}; summed latency cupy/torch {total:.2f} (pipelined {total_p:.2f})"
            f"{'; cupy results differ in ' + str(len(bad)) + ' cases' if bad else ''} -> keep {keep}")


def size(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    cuda = result["timing"] == "cuda events"
    lines = [f"# ParM parity encode/decode: torch vs fused cupy on {result['device']}", "",
             f"`{result['command']}`", "",
             f"torch {result['torch']} (CUDA {result['torch_cuda']}), cupy {result['cupy'] or 'unavailable'}"
             + (f" (CUDA runtime {result['cupy_cuda_runtime']})" if result.get("cupy_cuda_runtime") else "")
             + f"; timing: {result['timing']}, median of {result['reps']} reps after {result['warmup']} warm-up",
             "", f"**Verdict:** {result['verdict']}", "",
             "escapement runs these codes on the host today (the executor encodes into the pinned input buffer, "
             "the controller decodes numpy outputs): the GPU columns are for a device-side codec.", ""]
    lines += [f"Note: {n}" for n in result["notes"]] + ([""] if result["notes"] else [])
    if cuda:
        lines += ["µs per op. `torch`/`cupy`: CUDA-event time of one op on an idle stream (launch included); "
                  "`pipe`: per op with the reps issued back to back; `views`: cupy with its array views made once; "
                  "`launch`: host time to issue; `host`: the same torch code on host tensors (where escapement "
                  "runs it today).", "",
                  "| op | k | shape | KiB | torch | cupy | cupy/torch | torch pipe | cupy pipe | pipe ratio | "
                  "cupy views | launch torch/cupy | host | allclose |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            launch = f"{fmt(r.get('torch_launch_us'))} / {fmt(r.get('cupy_launch_us'))}"
            lines.append(
                f"| {r['op']} | {r['k']} | {label(r)} | {r['bytes'] / 1024:.2f} | {fmt(r['torch_us'])} | "
                f"{fmt(r.get('cupy_us'))} | {fmt(r.get('ratio'), '.2f')} | {fmt(r.get('torch_pipelined_us'))} | "
                f"{fmt(r.get('cupy_pipelined_us'))} | {fmt(r.get('ratio_pipelined'), '.2f')} | "
                f"{fmt(r.get('cupy_views_us'))} | {launch} | {fmt(r.get('host_us'))} | "
                f"{r.get('allclose', '-')} |")
    else:
        lines += ["µs per op on the host (perf_counter; no GPU, so no cupy).", "",
                  "| op | k | shape | KiB | torch µs |", "|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['k']} | {label(r)} | {r['bytes'] / 1024:.2f} | {r['torch_us']:.1f} |"
                  for r in result["rows"]]
    impls = sorted({r["torch_impl"] for r in result["rows"]} - {"codes.encode_sum", "codes.decode",
                                                                 "codes.encode_concat"})
    if impls:
        lines += ["", "Torch stand-ins for escapement functions that could not run here:"]
        lines += [f"- {i}" for i in impls]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.parity_codec")
    ap.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (torch on the host, no cupy)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer reps (still >= 200 on a GPU)")
    ap.add_argument("--no-host", action="store_true", help="skip the host-tensor reference column on a GPU")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        notes.append(f"{args.device} asked for but torch sees no CUDA device: timed torch on the CPU")
        cuda = False
    installed = "installed" if importlib.util.find_spec("cupy") else "not installed"
    cp, reason = load_cupy() if cuda else (None, f"no CUDA device to run it on (cupy {installed} here)")
    dev = torch.device(args.device if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
        reps, warmup = (200, 20) if args.quick else (1000, 50)
        device_name = torch.cuda.get_device_name(dev)
    else:
        reps, warmup = (20, 3) if args.quick else (200, 10)
        device_name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"
    t0 = time.monotonic()
    cc = CupyCodec(cp) if cp is not None else None
    rows = []
    stream = torch.cuda.Stream(dev) if cuda else None
    cp_stream = cp.cuda.ExternalStream(stream.cuda_stream) if cp is not None and stream is not None else None
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
          cp_stream if cp_stream is not None else contextlib.nullcontext()):
        # torch and cupy issue on one stream, so events around either time the same queue
        cases = make_cases(dev, cc, host=cuda and not args.no_host)
        for c in cases:
            try:
                rows.append(run_case(c, cuda, reps, warmup, host_reps=min(reps, 100)))
            except Exception as e:  # a cupy failure (NVRTC missing, driver too old) must not lose the torch figures
                if cc is None or c.cupy_op is None:
                    raise
                reason = f"cupy failed on {c.op} k={c.k} {list(c.shape)}: {type(e).__name__}: {str(e)[:300]}"
                cc = None
                for rest in cases:
                    rest.cupy_op = rest.cupy_views_op = None
                rows.append(run_case(c, cuda, reps, warmup, host_reps=min(reps, 100)))
            r = rows[-1]
            print(f"{r['op']:14} k={r['k']} {label(r):>14}: torch {r['torch_us']:9.1f} µs  cupy "
                  f"{fmt(r.get('cupy_us')):>9} µs  ratio {fmt(r.get('ratio'), '.2f')}", flush=True)
    if reason and cuda:
        for r in rows:  # a mid-run failure leaves no half-compared table
            for key in ("cupy_us", "cupy_launch_us", "cupy_pipelined_us", "cupy_views_us", "ratio",
                        "ratio_pipelined", "allclose", "max_abs_diff"):
                r.pop(key, None)
    cupy_version = cp.__version__ if cp is not None and not reason else None
    result = {
        "device": device_name, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cupy": cupy_version,
        "cupy_cuda_runtime": cp.cuda.runtime.runtimeGetVersion() if cupy_version else None,
        "cupy_unavailable": reason or None,
        "command": f"python -m bench.gpu.parity_codec --device {args.device} --out DIR"
                   + (" --quick" if args.quick else "") + (" --no-host" if args.no_host else ""),
        "timing": "cuda events" if cuda else "host perf_counter", "reps": reps, "warmup": warmup,
        "notes": notes, "seconds": time.monotonic() - t0, "rows": rows,
    }
    result["verdict"] = verdict(rows, reason)
    (out / "parity_codec.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "parity_codec.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
