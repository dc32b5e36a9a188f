"""`limit`: what this machine's cores could serve at most, with no server in the way.

In one process, for the exact request bytes the `peers` scenario sends (KServe v2 JSON, one
[1, 784] tensor for `mlp_784`), the CPU time of the work no server can avoid:

1. parse the HTTP request (httptools, the C parser escapement's server also uses);
2. decode its JSON into a float32 tensor;
3. run the model, at the batch size where it costs least per sample (one intra-op thread, the
   program's own native runner: the cheapest way this program runs here);
4. encode the answer as KServe v2 JSON.

The sum is the CPU time one request must cost; `cores / sum` is the request rate the machine
could serve if every core did nothing else. Every system's capacity in `peers` is reported as
a fraction of it. Each step is timed over many repetitions in a tight loop (caches warm): a
floor, never reachable by a real server, which also pays for sockets, the event loop and
scheduling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import httptools
import numpy as np
import orjson
import torch

from bench import results
from bench.scenarios.common import command, demo_repo, http_json, spec_of
from daemon.runtime.program import load_program


def _per_call(fn: Callable[[], object], seconds: float) -> float:
    """Median CPU seconds per call over rounds of `seconds` / 5 each."""
    fn()
    rounds = []
    for _ in range(5):
        n = 0
        t0 = time.process_time()
        end = time.monotonic() + seconds / 5
        while time.monotonic() < end:
            for _ in range(20):
                fn()
            n += 20
        rounds.append((time.process_time() - t0) / n)
    return float(np.median(rounds))


def measure(model: str = "mlp_784", seconds: float = 2.0) -> dict[str, Any]:
    """The per-request CPU floor and the limit it implies (the `peers` scenario calls this)."""
    torch.set_num_threads(1)
    spec = spec_of(demo_repo(), model)
    raw = http_json(spec).raw
    body = raw.partition(b"\r\n\r\n")[2]

    class _Sink:
        def on_body(self, b: bytes) -> None:
            pass

    def parse() -> None:
        httptools.HttpRequestParser(_Sink()).feed_data(raw)

    def decode() -> np.ndarray:
        t = orjson.loads(body)["inputs"][0]
        return np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])

    program = load_program(spec)
    runner = program.host_runner
    per_sample = {}
    with torch.inference_mode():
        for b in spec.batch_sizes:
            x = [torch.from_numpy(np.random.default_rng(b).random((b, *spec.inputs[0].sample_shape))
                                  .astype(np.float32))]
            per_sample[b] = _per_call(lambda x=x: runner(x), seconds) / b
    best_batch = min(per_sample, key=lambda b: per_sample[b])
    y = np.random.default_rng(0).random((1, *spec.outputs[0].sample_shape)).astype(np.float32)

    def encode() -> bytes:
        return orjson.dumps({"model_name": spec.name, "model_version": str(spec.version),
                             "outputs": [{"name": spec.outputs[0].name, "datatype": "FP32",
                                          "shape": list(y.shape), "data": y.ravel().tolist()}]})

    steps = {"http_parse_us": _per_call(parse, seconds) * 1e6, "json_decode_us": _per_call(decode, seconds) * 1e6,
             "model_us": per_sample[best_batch] * 1e6, "json_encode_us": _per_call(encode, seconds) * 1e6}
    per_request = sum(steps.values()) * 1e-6
    cores = len(os.sched_getaffinity(0))
    return {"model": model, "request_bytes": len(raw), "body_bytes": len(body), "best_batch": best_batch,
            "model_us_per_sample_by_batch": {str(b): v * 1e6 for b, v in per_sample.items()}, **steps,
            "cpu_us_per_request": per_request * 1e6, "cores": cores, "limit_rps": cores / per_request}


def run(quick: bool = False, json_out: str | None = None, model: str = "mlp_784") -> dict[str, Any]:
    m = measure(model, 1.0 if quick else 3.0)
    rows = [{"label": k.removesuffix("_us"), "cpu_us": v} for k, v in m.items()
            if k.endswith("_us") and k != "cpu_us_per_request"]
    summary = {k: m[k] for k in ("model", "best_batch", "cpu_us_per_request", "cores", "limit_rps")}
    config = {"command": command("limit", quick), "model": model, "request_bytes": m["request_bytes"],
              "model_us_per_sample_by_batch": m["model_us_per_sample_by_batch"]}
    notes = ["A floor: each step timed alone in a tight loop, in one process, no sockets, no event loop; "
             "limit_rps = cores / (the steps' CPU per request)."]
    return results.write("limit", config, rows, summary, json_out, notes, columns=["label", "cpu_us"])
