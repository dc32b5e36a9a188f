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

`summary.accuracy` gives the demo classifiers' accuracy when everything is available, and in
degraded mode (every prediction reconstructed from a parity model) at k = 2, 3, 4, training the
parity models it needs (`escapement train-parity`'s trainer) on the bundled digits.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import loadgen, results
from bench.scenarios.common import demo_repo, measure, spec_of
from bench.servers import Escapement
from daemon.coding import trainer
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.repository import ParitySpec, parity_model, scan
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


def accuracy(epochs: int) -> list[dict[str, Any]]:
    base = demo_repo()
    out = []
    for name in ("digits_mlp", "digits_cnn"):
        spec = next(m for m in scan(base).models if m.name == name)
        runner = load_program(spec).host_runner
        data = trainer.load_dataset(spec, None)
        for k in KS:
            _, rep = trainer.train(spec, runner, data, k, "sum", epochs=epochs)
            out.append({"model": name, "k": k, "available_accuracy": rep.available_accuracy,
                        "degraded_accuracy": rep.degraded_accuracy,
                        "reconstruction_accuracy": rep.reconstruction_accuracy, "epochs": epochs,
                        "best_epoch": rep.best_epoch})
    return out


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
        add_ms: float = 20.0, cpu_duty: float = 0.05, cpu_burst_s: float = 0.1, epochs: int | None = None,
        skip_cpu: bool = False, skip_accuracy: bool = False) -> dict[str, Any]:
    seconds = seconds or (4.0 if quick else 20.0)
    seeds = seeds or (1 if quick else 3)
    cpu_seconds = cpu_seconds or (4.0 if quick else 20.0)
    cpu_reps = cpu_reps or (1 if quick else 3)
    epochs = epochs or (15 if quick else 100)
    t0 = time.monotonic()
    rows = simulated(quick, seconds, load, slo_ms, share, burst_s, factor, seeds)
    if not skip_cpu:
        rows += real_cpu(quick, cpu_rate, cpu_seconds, cpu_reps, add_ms, cpu_duty, cpu_burst_s)
    summary: dict[str, Any] = {f"simulated_k{k}": _pair(rows, "simulated", k) for k in KS}
    if not skip_cpu:
        summary["cpu_k2"] = _pair(rows, "cpu", 2)
    if not skip_accuracy:
        summary["accuracy"] = accuracy(epochs)
    summary["targets"] = {"p999_reduction": ">= 0.40", "median_ratio": "<= 1.05",
                          "degraded_accuracy_drop_k2": "<= 0.065"}
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
              "accuracy_epochs": None if skip_accuracy else epochs, "wall_s": None}
    config["wall_s"] = round(time.monotonic() - t0, 1)
    notes = ["parity-kK: n data devices + n/k parity devices; equal-resources: the same number of devices all "
             "serving the model (the `devices` field), no coding. Same arrivals and slowdowns for both.",
             "Rows give the median over runs (seeds / repetitions); p999_ms_runs lists each run's p99.9.",
             "A reconstruction answers a request whose batch overran its predicted end by more than "
             "max(1 ms, half its run), failed, or whose deadline is at hand, once the group's other outputs are in."]
    return results.write("parity", config, rows, summary, json_out, notes,
                         columns=["label", "setting", "k", "devices", "offered_rps", "p50_ms", "p99_ms", "p999_ms",
                                  "slo_attainment", "reconstructions", "reconstructed"])
