"""`classes`: late rather than lost. Requests without a client timeout are answered late instead of
dropped; hard deadlines behave as before; a best-effort flood does not hurt on-time work.

1. **Burst** (a real daemon; `model`, by default cnn_heavy, whose device and not its event loop is
   the bottleneck, over the socket, open loop Poisson). Its capacity at SLO is measured first in
   the same run (bench/scenarios/common.search_capacity) unless `capacity_rps` is given; then
   `factor` x that is offered for `burst_s` seconds, once with no client timeouts (Triton's
   default: every request is a TARGET, the SLO a target) and once with client timeouts equal to the
   SLO (HARD, the behaviour before this scenario's issue). Per run: requests accepted (not refused
   at arrival), answered, 504s, 503s and what they said, and the late answers the daemon counted
   (`escapement_requests_by_class`). `reps` bursts of each; the summary takes medians.
2. **Mixed**, on the same daemon (restarted with `controller.best_effort_priority = 20`): a hard
   stream (client timeout = SLO) at 70% of the capacity, alone, then beside a best-effort flood of
   the same rate (priority 30: best-effort from the start) from a second client on connections of
   its own, `reps` times; the hard stream's SLO
   attainment with the flood minus without, in points (median), and how much of the flood was
   answered. The same in virtual time (the real scheduler and clockwork policy over a simulated
   V100, a hard ResNet-18 stream at 70% beside a ResNet-50 flood), where only the controller's
   decisions, not the machine's cores, are measured.

Summary keys: `burst_answered_fraction` (accepted requests answered, no client timeouts),
`burst_504` (count), `hard_attainment_delta_points`.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import numpy as np
import uvloop

from bench import loadgen, results
from bench.scenarios.common import command, demo_repo, passes, search_capacity, spec_of
from bench.scenarios.soak import LoggedEscapement, overload_frame, play
from daemon.client.wire import infer_message
from daemon.config import ControllerSettings
from daemon.controller.policies.clockwork import ClockworkPolicy
from daemon.request import RequestClass
from daemon.sim import CLOCKWORK_V100, Simulation, sim_spec


def _by_class(port: int, klass: str, outcome: str) -> float:
    """The daemon's count of requests of `klass` that ended `outcome` (every model)."""
    from bench.scenarios.soak import http_get

    _, body = http_get(port, "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith("escapement_requests_by_class_total{") and f'class="{klass}"' in line \
                and f'outcome="{outcome}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def burst_rows(model: str, factor: float, burst_s: float, reps: int, capacity_rps: float | None,
               seed: int) -> tuple[list[dict[str, Any]], float]:
    repo = demo_repo()
    spec = spec_of(repo, model)
    slo_s = spec.slo_s
    server = LoggedEscapement(repo)
    server.start()
    rows: list[dict[str, Any]] = []
    try:
        hard = overload_frame(repo, model, int(slo_s * 1e6))
        soft = overload_frame(repo, model, None)

        def point(rate: float) -> dict[str, Any]:
            run, cores = play(loadgen.poisson(rate, 3.0, seed=len(rows) + seed), server, hard, model, 0.75,
                              max(2.0, 3 * slo_s), 2)
            r = results.row(run, "capacity ramp", slo_s, **cores)
            rows.append(r)
            return r

        point(50.0)  # warm-up: first runs, estimates; not reported
        rows.clear()
        if capacity_rps is None:
            search_capacity(point, [100.0, 200.0], refine=2)
            capacity = max((r["offered_rps"] for r in rows if passes(r)), default=0.0)
        else:
            capacity = float(capacity_rps)
        if capacity <= 0:
            raise RuntimeError(f"no load passed the SLO in the capacity ramp: {rows}")
        out: list[dict[str, Any]] = []
        for rep in range(reps):
            for label, frame in (("no client timeout", soft), ("client timeout = SLO", hard)):
                late0 = _by_class(server.port, "target", "late")
                run, cores = play(loadgen.poisson(factor * capacity, burst_s, seed=seed + 100 + rep), server, frame,
                                  model, 0.0, 60.0, 2)
                time.sleep(0.5)  # (the last answers are counted before the metric is read)
                st = run.records.status
                accepted = int((st != 503).sum())  # (a 503 says which budget was full: see `errors`)
                row = results.row(run, label, slo_s, **cores)
                row.update({"rep": rep, "capacity_rps": capacity, "factor": factor,
                            "accepted": accepted, "answered": int((st == 200).sum()),
                            "answered_fraction": float((st == 200).sum()) / max(accepted, 1),
                            "status_504": int((st == 504).sum()), "status_503": int((st == 503).sum()),
                            "no_answer": int((st == loadgen.NO_ANSWER).sum()),
                            "late_answered": _by_class(server.port, "target", "late") - late0})
                out.append(row)
        return out, capacity
    finally:
        server.stop()


def mixed_daemon(model: str, capacity: float, seconds: float, reps: int, seed: int) -> list[dict[str, Any]]:
    repo = demo_repo()
    spec = spec_of(repo, model)
    slo_s = spec.slo_s
    server = LoggedEscapement(repo, controller={"best_effort_priority": 20})
    server.start()
    out: list[dict[str, Any]] = []
    try:
        hard = overload_frame(repo, model, int(slo_s * 1e6))
        rng = np.random.default_rng(0)
        x = {t.name: rng.random((1, *t.sample_shape)).astype(t.datatype.numpy) for t in spec.inputs}
        flood = loadgen.SocketFrame(infer_message(model, x, priority=30))
        play(loadgen.poisson(50.0, 2.0, seed=seed), server, hard, model, 0.5, 2.0, 2)  # warm-up
        rate = 0.7 * capacity
        for rep in range(reps):
            for with_flood in (False, True):
                h = loadgen.poisson(rate, seconds, seed=seed + 200 + rep)
                f = loadgen.poisson(rate, seconds, seed=seed + 300 + rep)

                async def both(h: loadgen.Schedule = h, f: loadgen.Schedule = f,
                               with_flood: bool = with_flood) -> list[loadgen.Run]:
                    # two clients, each on its own connections: lane requests hold their connection's
                    # in-flight slots (server.max_inflight_per_connection) while they wait
                    runs = [loadgen.run_socket(h, server.socket, [hard], [model], 0.0, 60.0, 2)]
                    if with_flood:
                        runs.append(loadgen.run_socket(f, server.socket, [flood], [model], 0.0, 60.0, 2))
                    return list(await asyncio.gather(*runs))

                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    got = runner.run(both())
                r = got[0].records
                ok = r.status == 200
                fr = got[1].records if with_flood else None
                out.append({"label": "mixed, hard stream " + ("with flood" if with_flood else "alone"), "rep": rep,
                            "offered_rps": (len(h) + (len(f) if with_flood else 0)) / seconds,
                            "hard_attainment": float((ok & (r.latency <= slo_s)).mean()),
                            "hard_p99_ms": float(np.nanpercentile(r.latency[ok], 99) * 1e3),
                            "flood_requests": len(f) if with_flood else 0,
                            "flood_answered": int((fr.status == 200).sum()) if fr is not None else 0})
        return out
    finally:
        server.stop()


def mixed(seconds: float, flood: int, seed: int) -> dict[str, Any]:
    hard, other = sim_spec("hard", 16), sim_spec("flood", 16)
    ph, pf = CLOCKWORK_V100["resnet18"], CLOCKWORK_V100["resnet50"]
    rng = np.random.default_rng(seed)
    rate = 0.7 * 16 / ph.infer(16)
    t_hard = np.cumsum(rng.exponential(1 / rate, int(rate * seconds * 1.2)))
    t_hard = t_hard[t_hard < seconds]
    t_flood = np.sort(rng.uniform(0, seconds, flood))

    def run(with_flood: bool) -> tuple[float, int, int]:
        sim = Simulation([(hard, ph), (other, pf)], 1, ClockworkPolicy(),
                         ControllerSettings(max_pending=10**7, max_pending_per_model=10**7), seed=seed)
        sim.place(hard.key, ["sim:0"])
        sim.place(other.key, ["sim:0"])
        n_f = len(t_flood) if with_flood else 0
        times = np.concatenate([t_hard, t_flood[:n_f]])
        targets = np.concatenate([np.zeros(len(t_hard), int), np.ones(n_f, int)])
        classes = np.concatenate([np.full(len(t_hard), int(RequestClass.HARD)),
                                  np.full(n_f, int(RequestClass.BEST_EFFORT))])
        order = np.argsort(times, kind="stable")
        res = sim.run(times[order], targets[order], [hard.key, other.key], drain_s=120.0, classes=classes[order],
                      max_wait_s=120.0)
        rec, is_hard = res.records, targets[order] == 0
        return (float(rec.met[is_hard].mean()), int(((rec.status == 200) & ~is_hard).sum()),
                int(((rec.status != 200) & ~is_hard).sum()))

    alone, _, _ = run(False)
    with_flood, answered, lost = run(True)
    return {"label": "mixed (virtual time)", "hard_rps": rate, "hard_requests": len(t_hard), "flood_requests": flood,
            "hard_attainment_alone": alone, "hard_attainment_with_flood": with_flood,
            "hard_attainment_delta_points": (with_flood - alone) * 100, "flood_answered": answered,
            "flood_not_answered": lost}


def run(quick: bool = False, json_out: str | None = None, model: str = "cnn_heavy", factor: float = 2.0,
        burst_s: float | None = None, reps: int | None = None, capacity_rps: float | None = None,
        seed: int = 0) -> dict[str, Any]:
    burst_s = burst_s or (2.0 if quick else 5.0)
    reps = reps or (1 if quick else 3)
    rows, capacity = burst_rows(model, factor, burst_s, reps, capacity_rps, seed)
    real = mixed_daemon(model, capacity, burst_s, reps, seed)
    alone = [r["hard_attainment"] for r in real if r["label"].endswith("alone")]
    flooded = [r["hard_attainment"] for r in real if r["label"].endswith("with flood")]
    mix = mixed(1.0 if quick else 4.0, 2000 if quick else 8000, seed)
    soft = [r for r in rows if r["label"] == "no client timeout"]
    hard = [r for r in rows if r["label"] != "no client timeout"]
    summary = {
        "capacity_rps": capacity,
        "burst_answered_fraction": statistics.median(r["answered_fraction"] for r in soft),
        "burst_504": statistics.median(r["status_504"] for r in soft),
        "burst_503": statistics.median(r["status_503"] for r in soft),
        "burst_late_answered": statistics.median(r["late_answered"] for r in soft),
        "burst_hard_answered_fraction": statistics.median(r["answered_fraction"] for r in hard),
        "burst_hard_504": statistics.median(r["status_504"] for r in hard),
        "hard_attainment_delta_points": statistics.median((b - a) * 100 for a, b in zip(alone, flooded, strict=True)),
        "hard_attainment_alone": statistics.median(alone),
        "hard_attainment_with_flood": statistics.median(flooded),
        "flood_answered_fraction": statistics.median(r["flood_answered"] / max(r["flood_requests"], 1)
                                                     for r in real if r["label"].endswith("with flood")),
        "sim_hard_attainment_delta_points": mix["hard_attainment_delta_points"],
        "sim_flood_answered_fraction": mix["flood_answered"] / max(mix["flood_requests"], 1),
    }
    config = {"command": command("classes", quick), "model": model, "factor": factor, "burst_s": burst_s,
              "reps": reps, "transport": "socket, open loop (Poisson)", "mixed": "the daemon: a hard stream at 0.7x "
              "capacity, alone and beside a best-effort flood (priority 30 >= best_effort_priority 20) of the same "
              "rate; virtual time: 1 simulated V100, resnet18 hard at 70% + a best-effort resnet50 flood"}
    notes = ["answered_fraction: answered (200) over accepted (every request not refused with 503); "
             "late_answered: the daemon's own count (escapement_requests_by_class).",
             f"mixed: {mix}"]
    return results.write("classes", config, [*rows, *real, mix], summary, json_out, notes,
                         columns=["label", "rep", "offered_rps", "accepted", "answered", "answered_fraction",
                                  "status_504", "status_503", "late_answered", "p50_ms", "p99_ms", "hard_attainment",
                                  "hard_p99_ms", "flood_answered",
                                  "hard_attainment_alone", "hard_attainment_with_flood",
                                  "hard_attainment_delta_points"])
