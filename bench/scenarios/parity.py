"""`parity`: ParM coding against equal resources, under the same injected slowdowns.

Two settings:

- **Simulated, at the paper's scale.** n = 12 devices serve ResNet18 (Clockwork's V100
  profile, batch 1, as ParM serves one query per batch) with coding groups of k = 2, 3, 4 and
  n/k more devices for the parity model, against equal resources: n + n/k devices running the
  deployed model, no coding. Every device of both suffers the same random slowdown bursts
  (exponential gaps and lengths, `factor` x durations, about `share` of the time): ParM's
  background load imbalance. Poisson arrivals at `load` of the n data devices' batch-1
  capacity, the same schedule for both, repeated with `seeds` seeds (rows report the median).
- **Real CPU devices, smaller.** The daemon with three CPU devices serves digits_mlp: with
  parity (k = 2: two data devices and one parity device), or equal resources (the model on all
  three, no parity). Each device gets the same injected random slowdown (a fixed delay added
  to INFERs in randomly chosen windows). Socket clients, Poisson arrivals, repeated runs.

`summary.accuracy` gives, for the zoo (`daemon.parity.zoo`: an MLP with LayerNorm and dropout, a
residual CNN with BatchNorm, a transformer encoder over image rows, each trained on the bundled
digits), accuracy when everything is available and in degraded mode (every prediction
reconstructed from a parity model) at k = 2, 3, 4, with the parity trainer's defaults and the
default code for the input (`codes.default_encoder`: concat for images at k = 2 and 4, else sum):
held-out test figures, the checkpoint chosen on a validation split, overall accuracy at
unavailability f = 1%, 5%, 10% ((1-f)·available + f·degraded) and training wall time.

`summary.codec_us` gives what a parity batch costs the executor beyond a plain batch (filling
its input buffer from the k members' requests with each code: `IOBuffers.fill_coded` against
`IOBuffers.fill`) and what a decode costs the controller, per batch size and input shape.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import loadgen, results
from bench.scenarios.common import demo_repo, measure, spec_of
from bench.servers import Escapement
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.model import ParitySpec
from daemon.parity import codes, datasets, trainer, zoo
from daemon.parity.spec import parity_model
from daemon.repository import scan
from daemon.request import InferenceRequest
from daemon.runtime.backend import IOBuffers
from daemon.runtime.program import load_program
from daemon.sim import CLOCKWORK_V100, Simulation, random_bursts, sim_spec

N = 12
KS = (2, 3, 4)
MODEL = "resnet18"
CPU_MODEL = "digits_mlp"


def _stats(lat_ms: np.ndarray, met: np.ndarray) -> dict[str, float]:
    """Latency percentiles over every request (one that failed counts as infinitely late)."""
    return {"p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99)),
            "p999_ms": float(np.percentile(lat_ms, 99.9)), "max_ms": float(lat_ms.max()),
            "slo_attainment": float(met.mean())}


def simulate_one(k: int, coded: bool, rate: float, seconds: float, slo_s: float, share: float, burst_s: float,
                 factor: float, seed: int) -> dict[str, Any]:
    """One simulated run: ResNet18 on n (+ n/k parity) or n + n/k devices, random bursts on all."""
    prof = CLOCKWORK_V100[MODEL]
    base = sim_spec(MODEL, max_batch=1, slo_s=slo_s)
    devices = N + N // k
    names = [f"sim:{i}" for i in range(devices)]
    spec = replace(base, parity=ParitySpec(k, "sum", "parity.pt2", slo_s * 1e3 / 4)) if coded else base
    models = [(spec, prof), (parity_model(spec), prof)] if coded else [(spec, prof)]
    slow = random_bursts(names, seconds, share=share, mean_s=burst_s, factor=factor, seed=seed)
    sim = Simulation(models, devices, ClockworkPolicy(), slowdowns=slow, seed=seed, noise=0.02)
    if coded:
        sim.place(spec.key, names[:N])
        sim.place(parity_model(spec).key, names[N:])
    else:
        sim.place(spec.key, names)
    rng = np.random.default_rng(1000 + seed)
    times = np.cumsum(rng.exponential(1 / rate, int(rate * seconds)))
    res = sim.run(times, np.zeros(len(times), dtype=int), [spec.key])
    rec = res.records
    ok = rec.status == 200
    c = sim.scheduler.counters
    out = _stats(np.where(ok, (rec.finish - rec.arrival) * 1e3, np.inf), rec.met)
    out.update(requests=len(times), failed=int((~ok).sum()), reconstructions=c["reconstructions"],
               replica_answers=c["replica_answers"], coding_groups=c["coding_groups"], parities_run=c["parities_run"],
               controller_us_per_request=res.controller_s / len(times) * 1e6)
    return out


def _median_row(label: str, runs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"label": label, **extra}
    for key in runs[0]:
        row[key] = float(np.median([r[key] for r in runs]))
    row["runs"] = len(runs)
    row["p999_ms_runs"] = [round(r["p999_ms"], 3) for r in runs]
    return row


def simulated(quick: bool, seconds: float, load: float, slo_ms: float, share: float, burst_s: float,
              factor: float, seeds: int) -> list[dict[str, Any]]:
    capacity = N / CLOCKWORK_V100[MODEL].infer(1)
    rate = capacity * load
    rows = []
    for k in KS:
        for coded in (True, False):
            runs = [simulate_one(k, coded, rate, seconds, slo_ms / 1e3, share, burst_s, factor, s)
                    for s in range(seeds)]
            label = f"parity-k{k}" if coded else "equal-resources"
            rows.append(_median_row(label, runs, setting="simulated", k=k, devices=N + N // k,
                                    data_devices=N if coded else N + N // k, offered_rps=rate, slo_ms=slo_ms))
    return rows


# ------------------------------------------------------------------ real CPU devices


def _cpu_repo(base: Path, out: Path, coded: bool) -> None:
    """digits_mlp preloaded on 2 devices with its k=2 parity, or on 3 without parity."""
    shutil.copytree(base / CPU_MODEL, out / CPU_MODEL)
    cfg = out / CPU_MODEL / "config.toml"
    text = cfg.read_text()
    if not coded:
        text = text.replace("[parity]\n", "[parity]\nenabled = false\n", 1)
    cfg.write_text(f"preload_replicas = {2 if coded else 3}\n" + text)


def real_cpu(quick: bool, rate: float, seconds: float, reps: int, add_ms: float, duty: float,
             burst_s: float) -> list[dict[str, Any]]:
    base = demo_repo()
    faults = [{"device": f"cpu:{i}", "add_ms": add_ms, "mode": "random", "duty": duty, "burst_s": burst_s,
               "seed": 11 + i} for i in range(3)]
    rows = []
    for coded in (True, False):
        work = Path(tempfile.mkdtemp(prefix="parity-"))
        try:
            _cpu_repo(base, work, coded)
            spec = spec_of(work, CPU_MODEL)
            with Escapement(work, runtime={"devices": ["cpu:0", "cpu:1", "cpu:2"]}, faults=faults) as server:
                runs = []
                for rep in range(reps + 1):
                    m = measure(loadgen.poisson(rate, seconds, 1, seed=rep), "socket", server.pid, [CPU_MODEL],
                                socket_path=server.socket, specs=[spec], drain_s=1.0)
                    if rep == 0:
                        continue  # warm-up: estimates settle, caches fill
                    r = results.row(m.run, "", spec.slo_s)
                    runs.append({"p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "p999_ms": r["p999_ms"],
                                 "max_ms": r["max_ms"], "slo_attainment": r["slo_attainment"],
                                 "requests": r["requests"], "reconstructed": r["reconstructed"],
                                 "server_cores": m.server_cores})
            rows.append(_median_row("parity-k2" if coded else "equal-resources", runs, setting="cpu", k=2,
                                    devices=3, data_devices=2 if coded else 3, offered_rps=rate,
                                    slo_ms=spec.slo_s * 1e3))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rows


# ------------------------------------------------------------------ accuracy


def accuracy(quick: bool, seed: int = 0) -> list[dict[str, Any]]:
    """The zoo (`daemon.parity.zoo`) trained on digits, and a parity model per k with the trainer's
    defaults (quick: a few epochs of both, a short time limit): held-out test figures."""
    work = Path(tempfile.mkdtemp(prefix="parity-zoo-"))
    out = []
    threads = torch.get_num_threads()
    # NOTE: one intra-op thread: on a shared 2-core machine, two spinning OpenMP threads made training
    # steps up to 10x slower whenever other work ran; the timings below are one core's.
    torch.set_num_threads(1)
    try:
        built = zoo.build(work, epochs=10 if quick else None)
        cfg = trainer.TrainConfig(max_epochs=15, time_limit_s=20.0, seed=seed) if quick else trainer.TrainConfig(
            seed=seed)
        for m in scan(work).models:
            runner = load_program(m).host_runner
            data = datasets.load_dataset(m, None)
            for k in KS:
                encoder = codes.default_encoder(k, m.inputs[0].sample_shape)
                _, rep = trainer.train(m, runner, data, k, encoder, config=cfg)
                row = {"model": m.name, "k": k, "encoder": encoder, "available_accuracy": rep.available_accuracy,
                       "reconstruction_accuracy": rep.reconstruction_accuracy,
                       "degraded_accuracy": rep.degraded_accuracy,
                       "degraded_drop": rep.available_accuracy - rep.degraded_accuracy
                       if rep.available_accuracy is not None and rep.degraded_accuracy is not None else None,
                       "overall_accuracy": {f"f={f:g}": rep.overall_accuracy(f) for f in trainer.FREQUENCIES},
                       "train_seconds": round(rep.seconds, 1), "steps": rep.steps, "best_step": rep.best_step,
                       "stopped": rep.stopped, "val_reconstruction_accuracy": rep.val_reconstruction_accuracy,
                       "deployed_model_train_seconds": built[m.name]["train_seconds"]}
                out.append(row)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(work, ignore_errors=True)
    return out


def accuracy_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: architecture x k: available, reconstruction, degraded, overall at f = 10%, training time."""
    lines = ["| model | k | code | available | reconstruction | degraded | drop | overall f=1% | overall f=5% | "
             "overall f=10% | train s | steps | stopped |", "|" + "---|" * 13]
    for r in rows:
        o = r["overall_accuracy"]
        lines.append(f"| {r['model']} | {r['k']} | {r.get('encoder', 'sum')} | {r['available_accuracy']:.4f} | "
                     f"{r['reconstruction_accuracy']:.4f} | "
                     f"{r['degraded_accuracy']:.4f} | {r['degraded_drop'] * 100:.1f} pt | {o['f=0.01']:.4f} | "
                     f"{o['f=0.05']:.4f} | {o['f=0.1']:.4f} | {r['train_seconds']:.1f} | {r['steps']} | "
                     f"{r['stopped']} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ encode / decode cost

CODEC_SHAPES = ((1, 8, 8), (3, 32, 32), (3, 224, 224))  # the zoo's digits, CIFAR, ImageNet
CODEC_BATCHES = (1, 8, 32)


def _best_us(fn: Any, reps: int) -> float:
    """The median of `reps` timings of fn(), in microseconds (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def codec_cost(quick: bool) -> list[dict[str, Any]]:
    """Microseconds to fill a parity batch's input (k members' requests, encoded) with each code against a
    plain batch's fill, and to decode one member (parity output minus k-1 outputs of 1,000 logits)."""
    spec = sim_spec("codec", max_batch=max(CODEC_BATCHES))
    rng = np.random.default_rng(0)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as an executor's CPU thread encodes
    try:
        for shape in CODEC_SHAPES[:2] if quick else CODEC_SHAPES:
            for batch in CODEC_BATCHES:
                buf = IOBuffers(batch, [np.zeros((batch, *shape), np.float32)], [])
                reqs = [[InferenceRequest(spec, (rng.standard_normal((1, *shape), dtype=np.float32),), 1, 0.0, 1.0)
                         for _ in range(batch)] for _ in range(4)]
                reps = 20 if quick or shape[-1] > 100 else 200
                row: dict[str, Any] = {"shape": list(shape), "batch": batch,
                                       "fill_us": _best_us(lambda reqs=reqs, buf=buf: buf.fill(reqs[0]), reps)}
                for k in (2, 4):
                    for name in codes.ENCODERS:
                        row[f"fill_coded_{name}_k{k}_us"] = _best_us(
                            lambda reqs=reqs, buf=buf, k=k, name=name: buf.fill_coded(reqs[:k], name), reps)
                logits = [torch.from_numpy(rng.standard_normal((batch, 1000), dtype=np.float32)) for _ in range(4)]
                row["decode_k4_1000_logits_us"] = _best_us(lambda logits=logits: codes.decode(logits[0], logits[1:]),
                                                           reps)
                out.append(row)
    finally:
        torch.set_num_threads(threads)
    return out


def codec_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per input shape and batch, a plain fill and each code's parity fill, in µs."""
    keys = [f"fill_coded_{name}_k{k}_us" for k in (2, 4) for name in codes.ENCODERS]
    lines = ["| input | batch | fill | " + " | ".join(k.removeprefix("fill_coded_").removesuffix("_us") for k in keys)
             + " | decode k=4 (1,000 logits) |", "|" + "---|" * (len(keys) + 4)]
    for r in rows:
        lines.append(f"| {'x'.join(map(str, r['shape']))} | {r['batch']} | {r['fill_us']:.0f} | "
                     + " | ".join(f"{r[k]:.0f}" for k in keys) + f" | {r['decode_k4_1000_logits_us']:.0f} |")
    return "\n".join(lines)


def _pair(rows: list[dict[str, Any]], setting: str, k: int) -> dict[str, Any]:
    coded = next(r for r in rows if r["setting"] == setting and r["label"] == f"parity-k{k}")
    equal = next(r for r in rows if r["setting"] == setting and r["label"] == "equal-resources" and r["k"] == k)
    return {"p999_reduction": 1 - coded["p999_ms"] / equal["p999_ms"],
            "p99_reduction": 1 - coded["p99_ms"] / equal["p99_ms"],
            "median_ratio": coded["p50_ms"] / equal["p50_ms"],
            "slo_attainment": {"parity": coded["slo_attainment"], "equal": equal["slo_attainment"]}}


def run(quick: bool = False, json_out: str | None = None, seconds: float | None = None, load: float = 0.35,
        slo_ms: float = 100.0, share: float = 0.05, burst_s: float = 0.2, factor: float = 10.0,
        seeds: int | None = None,
        cpu_rate: float = 400.0, cpu_seconds: float | None = None, cpu_reps: int | None = None,
        add_ms: float = 20.0, cpu_duty: float = 0.05, cpu_burst_s: float = 0.1, skip_cpu: bool = False,
        skip_accuracy: bool = False, skip_latency: bool = False, accuracy_seed: int = 0) -> dict[str, Any]:
    seconds = seconds or (4.0 if quick else 20.0)
    seeds = seeds or (1 if quick else 3)
    cpu_seconds = cpu_seconds or (4.0 if quick else 20.0)
    cpu_reps = cpu_reps or (1 if quick else 3)
    t0 = time.monotonic()
    rows = [] if skip_latency else simulated(quick, seconds, load, slo_ms, share, burst_s, factor, seeds)
    if not skip_cpu and not skip_latency:
        rows += real_cpu(quick, cpu_rate, cpu_seconds, cpu_reps, add_ms, cpu_duty, cpu_burst_s)
    summary: dict[str, Any] = {} if skip_latency else {f"simulated_k{k}": _pair(rows, "simulated", k) for k in KS}
    if not skip_cpu and not skip_latency:
        summary["cpu_k2"] = _pair(rows, "cpu", 2)
    if not skip_latency:
        summary["codec_us"] = codec_cost(quick)
    if not skip_accuracy:
        summary["accuracy"] = accuracy(quick, accuracy_seed)
        summary["accuracy_table"] = accuracy_table(summary["accuracy"])
        summary["accuracy_targets_met"] = {
            f"{r['model']}_k{r['k']}": r["degraded_drop"] <= (0.065 if r["k"] == 2 else 0.12)
            for r in summary["accuracy"] if r["k"] in (2, 4)}
    summary["targets"] = {"p999_reduction": ">= 0.40", "median_ratio": "<= 1.05",
                          "degraded_accuracy_drop_k2": "<= 0.065", "degraded_accuracy_drop_k4": "<= 0.12",
                          "train_seconds_k2": "< 300"}
    config = {"command": "python -m bench run parity" + (" --quick" if quick else ""),
              "simulated": {"n": N, "ks": list(KS), "model": f"{MODEL} (Clockwork V100 profile), batch 1",
                            "seconds_virtual": seconds, "load_of_n_devices_batch1_capacity": load, "slo_ms": slo_ms,
                            "slowdown": {"factor": factor, "share_of_time": share, "mean_burst_s": burst_s,
                                         "devices": "all, independently"},
                            "seeds": seeds, "noise_lognormal_sigma": 0.02},
              "cpu": None if skip_cpu else {"model": CPU_MODEL, "devices": 3, "rate_rps": cpu_rate,
                                            "seconds": cpu_seconds, "reps": cpu_reps, "frontend": "socket",
                                            "fault": {"add_ms": add_ms, "mode": "random", "duty": cpu_duty,
                                                      "burst_s": cpu_burst_s, "devices": "all three"}},
              "accuracy": None if skip_accuracy else {
                  "models": list(zoo.ZOO), "data": "scikit-learn digits, 80/20 split (seed 0); parity validation: "
                  "20% of the training split; figures on the test split",
                  "trainer": "TrainConfig(max_epochs=15, time_limit_s=20)" if quick else "TrainConfig() defaults",
                  "encoder": "codes.default_encoder(k, input shape)",
                  "seed": accuracy_seed},
              "wall_s": None}
    config["wall_s"] = round(time.monotonic() - t0, 1)
    notes = ["parity-kK: n data devices + n/k parity devices; equal-resources: the same number of devices all "
             "serving the model (the `devices` field), no coding. Same arrivals and slowdowns for both.",
             "Rows give the median over runs (seeds / repetitions); p999_ms_runs lists each run's p99.9.",
             "A reconstruction answers a request whose batch overran its predicted end by more than "
             "max(1 ms, half its run), failed, or whose deadline is at hand, once the group's other outputs are in."]
    result = results.write("parity", config, rows, summary, json_out, notes,
                           columns=["label", "setting", "k", "devices", "offered_rps", "p50_ms", "p99_ms", "p999_ms",
                                    "slo_attainment", "reconstructions", "reconstructed"])
    md = (Path(json_out) if json_out else results.RESULTS / "parity.json").with_suffix(".md")
    if not skip_latency:  # the tables, readable (the summary lines above hold them on one line)
        md.write_text(md.read_text() + "\n## Encode / decode cost (µs, one thread)\n\n"
                      "`fill`: a plain batch's input buffer filled from its requests; `sum_k2` ...: a parity "
                      "batch's, from k members' requests, encoded (`IOBuffers.fill_coded`); decode: one member "
                      "rebuilt from the parity output and 3 others.\n\n" + codec_table(summary["codec_us"]) + "\n")
    if not skip_accuracy:
        md.write_text(md.read_text() + "\n## Accuracy: the zoo on digits, held-out test split\n\n"
                      + summary["accuracy_table"] + "\n")
    return result
