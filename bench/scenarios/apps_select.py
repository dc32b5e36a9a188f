"""Applications (Clipper's selection and ensembles) for `python -m bench run apps`.

On the demo's three digits classifiers with the same input (digits_mlp, digits_cnn64,
digits_linear; docs/applications.md), through a real daemon:

- Selection under drift: a stream of held-out digits, each query sent to an exp3 application, an
  exp4 application and to each model alone, every answer's true label fed back. Midway the best
  model degrades: a version 2 of digits_mlp with untrained weights is loaded through the
  repository API (a bad deploy), and the applications' members follow it. Figures: accuracy of
  each policy and each model, per half and overall, and the regret of each policy against the
  best single model in hindsight (correct answers it would have given over the whole stream,
  minus the policy's).
- Ensembles under a tight SLO with one slow member: two CPU devices, the members preloaded;
  the device that holds exactly one member is slowed by fault injection (`add_ms`, so that member
  cannot make the SLO). The exp4 application answers queries at a tight deadline (skipping the
  member the controller expects late, combining the others), and the same queries with a
  deadline long enough to wait for all three. Figures: latency, on-time share, accuracy, the
  members that answered, and how often the slow member was left out vs run.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from bench.servers import ROOT, Escapement
from daemon import demo
from daemon.client import HttpClient, SocketClient
from daemon.parity.datasets import digits_split

MEMBERS = ("digits_mlp", "digits_cnn64", "digits_linear")
APPS_TOML = """
[[applications]]
name = "sel"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp3"
seed = {seed}

[[applications]]
name = "ens"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp4"

[[applications]]
name = "ens_tight"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp4"
slo_ms = {slo_ms}
default_output = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]

[[applications]]
name = "ens_clipper"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp4"
slo_ms = {slo_ms}
default_output = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
skip_late = false
"""


def build_repo(root: Path, preload: bool, seed: int = 0, slo_ms: float = 20.0) -> Path:
    """The three digits classifiers (copied from the demo repository `models/` when built there)."""
    built = ROOT / "models"
    for name in MEMBERS:
        if (built / name / "1" / "model.pt2").exists():
            shutil.copytree(built / name, root / name, ignore=shutil.ignore_patterns("*profile.json", "parity*"))
        else:
            demo.build(root, only=[name])
        cfg = root / name / "config.toml"
        text = cfg.read_text(encoding="utf-8")
        if "[parity]" in text:  # the applications do not need the parity models
            text = text[: text.index("[parity]")]
        if preload:
            text = "preload_replicas = 1\n" + text
        cfg.write_text(text, encoding="utf-8")
    (root / "applications.toml").write_text(APPS_TOML.format(seed=seed, slo_ms=slo_ms), encoding="utf-8")
    return root


def _degraded(repo: Path) -> None:
    """Version 2 of digits_mlp: the same network untrained (~10% accuracy), a bad deploy."""
    model = demo._seeded(demo.DigitsMLP)
    torch.manual_seed(12345)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    demo.save_model(model.eval(), "pt2", torch.zeros(2, 64), 32, repo / "digits_mlp" / "2" / "model.pt2")


def _correct(out: np.ndarray, label: int) -> int:
    return int(int(np.asarray(out).reshape(-1).argmax()) == label)


def selection(quick: bool, seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    _, _, xte, yte = digits_split()
    n = 600 if quick else 2000
    order = np.random.default_rng(seed).integers(0, len(yte), n)
    names = ("sel", "ens", *MEMBERS)
    hits = {k: np.zeros(n, np.int64) for k in names}
    chosen: list[str] = []
    with tempfile.TemporaryDirectory(prefix="apps-select-") as tmp:
        repo = build_repo(Path(tmp) / "repo", preload=False, seed=seed)
        with Escapement(repo, server={"frontend_workers": 0, "admin_open_loopback": True},
                        apps={"db_path": str(Path(tmp) / "apps.sqlite3")}) as server, \
                SocketClient(server.socket) as c:
            for t, i in enumerate(order):
                if t == n // 2:  # the best model degrades: a bad version 2 is deployed
                    _degraded(repo)
                    with HttpClient(f"127.0.0.1:{server.port}") as h:
                        status, body, _ = h.request("POST", "/v2/repository/models/digits_mlp/load", b"",
                                                    {"Content-Type": "application/json"})
                        assert status == 200, body
                x, y = xte[i : i + 1], int(yte[i])
                for app in ("sel", "ens"):
                    r = c.app_infer(app, {"INPUT__0": x})
                    hits[app][t] = _correct(r.output, y)
                    c.app_feedback(app, r.query_id, label=y)
                    if app == "sel":
                        chosen.append(r.models[0])
                for m in MEMBERS:
                    hits[m][t] = _correct(c.infer(m, {"INPUT__0": x}).outputs["OUTPUT__0"], y)
            weights = {app: c.app_status(app)["weights"] for app in ("sel", "ens")}
    half = n // 2
    best = max(MEMBERS, key=lambda m: int(hits[m].sum()))
    rows = []
    for k in names:
        rows.append({"label": f"selection: {k}", "requests": n, "acc_first_half": float(hits[k][:half].mean()),
                     "acc_second_half": float(hits[k][half:].mean()),
                     "acc_last_quarter": float(hits[k][half + half // 2:].mean()), "accuracy": float(hits[k].mean()),
                     "regret": int(hits[best].sum() - hits[k].sum())})
    tail = chosen[half + half // 2:]  # the last quarter: where exp3 went once it had learned
    summary = {
        "selection_queries": n,
        "selection_best_single": best,
        "selection_best_single_accuracy": float(hits[best].mean()),
        "exp3_accuracy": float(hits["sel"].mean()),
        "exp4_accuracy": float(hits["ens"].mean()),
        "exp3_regret": int(hits[best].sum() - hits["sel"].sum()),
        "exp4_regret": int(hits[best].sum() - hits["ens"].sum()),
        "exp3_second_half_accuracy": float(hits["sel"][half:].mean()),
        "exp4_second_half_accuracy": float(hits["ens"][half:].mean()),
        "degraded_model_second_half_accuracy": float(hits["digits_mlp"][half:].mean()),
        "exp3_last_quarter_accuracy": float(hits["sel"][half + half // 2:].mean()),
        "exp4_last_quarter_accuracy": float(hits["ens"][half + half // 2:].mean()),
        "exp3_last_quarter_picks": {m: tail.count(m) for m in MEMBERS},
        "final_weights": weights,
    }
    return rows, summary


def _stats(name: str, lat: list[float], ok: list[int], slo_ms: float, answers: list[dict[str, Any]]
           ) -> dict[str, Any]:
    lat_sorted = sorted(lat)
    return {"label": name, "requests": len(lat), "p50_ms": statistics.median(lat),
            "p99_ms": lat_sorted[min(len(lat) - 1, int(len(lat) * 0.99))],
            "on_time": sum(x <= slo_ms for x in lat) / len(lat), "accuracy": sum(ok) / len(ok),
            "partial": sum(bool(a.get("partial")) for a in answers) / len(answers),
            "default": sum(bool(a.get("default")) for a in answers) / len(answers),
            "members_mean": statistics.mean(len(a.get("models", [])) for a in answers)}


def stragglers(quick: bool, slo_ms: float = 20.0, add_ms: float = 40.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    _, _, xte, yte = digits_split()
    n = 300 if quick else 1000
    with tempfile.TemporaryDirectory(prefix="apps-straggle-") as tmp:
        repo = build_repo(Path(tmp) / "repo", preload=True, slo_ms=slo_ms)
        with Escapement(repo, server={"frontend_workers": 0, "admin_open_loopback": True, "allow_faults": True},
                        runtime={"devices": ["cpu:0", "cpu:1"]},
                        apps={"db_path": str(Path(tmp) / "apps.sqlite3")}) as server, \
                HttpClient(f"127.0.0.1:{server.port}") as h, SocketClient(server.socket) as c:
            where: dict[str, list[int]] = {}
            for st in h.get_json("/v2/models/stats")["model_stats"]:
                where[st["name"]] = [m["id"] for m in st["memory_usage"]]
            by_device: dict[int, list[str]] = {}
            for m in MEMBERS:
                for d in where.get(m, []):
                    by_device.setdefault(d, []).append(m)
            lone = [(d, ms[0]) for d, ms in sorted(by_device.items()) if len(ms) == 1]
            if not lone:
                raise RuntimeError(f"no device holds exactly one member: {where}")
            device, slow = lone[0]
            status, body, _ = h.request("POST", "/v2/admin/faults",
                                        orjson.dumps({"device": f"cpu:{device}", "add_ms": add_ms}),
                                        {"Content-Type": "application/json"})
            assert status == 200, body
            rows = []
            for label, app, timeout_us in (("tight SLO, members that make it", "ens_tight", None),
                                           ("tight SLO, all run (Clipper: no forecast)", "ens_clipper", None),
                                           ("waiting for all members", "ens_tight", 1_000_000)):
                lat: list[float] = []
                ok: list[int] = []
                answers: list[dict[str, Any]] = []
                before = c.app_status(app)["counters"]
                for k in range(n):
                    i = k % len(yte)
                    t0 = time.perf_counter()
                    r = c.call({"op": "app_infer", "app": app, **({"timeout_us": timeout_us}
                                                                           if timeout_us else {}),
                                "inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 64],
                                            "data": xte[i : i + 1].tobytes()}]})
                    lat.append((time.perf_counter() - t0) * 1e3)
                    out = np.frombuffer(r["outputs"][0]["data"], np.float32)
                    ok.append(_correct(out, int(yte[i])))
                    answers.append(r)
                after = c.app_status(app)["counters"]
                row = _stats(label, lat, ok, slo_ms, answers)
                row["slow_member_skipped"] = after["skipped"] - before["skipped"]
                row["slow_member_late"] = after["late"] - before["late"]
                rows.append(row)
            alone = []
            for m in MEMBERS:  # each member's own accuracy on the same inputs (no deadline)
                preds = [_correct(c.infer(m, {"INPUT__0": xte[i : i + 1]}).outputs["OUTPUT__0"], int(yte[i]))
                         for i in range(len(yte))]
                alone.append({"label": f"ensemble member {m}" + (" (slowed)" if m == slow else ""),
                              "requests": len(preds), "accuracy": sum(preds) / len(preds)})
            rows += alone
    tight, clipper, wait = rows[0], rows[1], rows[2]
    summary = {
        "straggler_slo_ms": slo_ms,
        "straggler_slow_member": slow,
        "straggler_fault_add_ms": add_ms,
        "straggler_tight_p99_ms": tight["p99_ms"],
        "straggler_tight_on_time": tight["on_time"],
        "straggler_tight_accuracy": tight["accuracy"],
        "straggler_tight_members_mean": tight["members_mean"],
        "straggler_slow_member_skipped": tight["slow_member_skipped"],
        "straggler_slow_member_run_late": tight["slow_member_late"],
        "straggler_no_forecast_p50_ms": clipper["p50_ms"],
        "straggler_no_forecast_on_time": clipper["on_time"],
        "straggler_no_forecast_accuracy": clipper["accuracy"],
        "straggler_no_forecast_slow_member_run_late": clipper["slow_member_late"],
        "straggler_wait_all_p50_ms": wait["p50_ms"],
        "straggler_wait_all_on_time": wait["on_time"],
        "straggler_wait_all_accuracy": wait["accuracy"],
    }
    return rows, summary


def run_all(quick: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows, summary = selection(quick)
    more_rows, more = stragglers(quick)
    return rows + more_rows, {**summary, **more}
