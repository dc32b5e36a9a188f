"""Observability over HTTP: Prometheus metrics and Triton's statistics extension.

`GET /metrics` is the text exposition of the daemon's own registry (daemon/metrics.py).
`GET /v2/models[/{model}[/versions/{version}]]/stats` answers in the shape of Triton's
statistics extension, which `tritonclient`'s `get_inference_statistics` and perf_analyzer
read; without a version, every ready version of the model is reported, as Triton does.
Both read the controller's state on the event loop, where it is consistent.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from daemon import metrics
from daemon.api.httpserver import Request, Response, Router
from daemon.api.throttle import RenderBudget
from daemon.controller.scheduler import Scheduler
from daemon.controller.telemetry import ModelStats, Span
from daemon.registry import ModelState
from daemon.repository import ModelSpec

if TYPE_CHECKING:
    from daemon.server import Daemon


def add_routes(router: Router, daemon: Daemon) -> None:
    """Add /metrics and the statistics routes. Call it before the routes of `/v2/models/{model}`:
    routes are tried in order, and `{model}` would match `stats`."""
    handlers = ObserveHandlers(daemon)
    router.add("GET", "/metrics", handlers.metrics)
    router.add("GET", "/v2/models/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/versions/{version:[0-9]+}/stats", handlers.stats)


class ObserveHandlers:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.registry = metrics.make_registry(lambda: daemon.controller.scheduler, daemon.overload)
        self.rendering = RenderBudget(lambda: metrics.render(self.registry))

    async def metrics(self, request: Request) -> Response:
        # Rendered here on the loop, not in a thread: the collector reads the controller's state.
        # Within a budget of loop time: a flood of scrapes gets the last rendering.
        return Response(self.rendering.get(), 200, metrics.CONTENT_TYPE)

    async def stats(self, request: Request) -> Response:
        """Raises NotFound for an unknown model or version, Unavailable for one that is not ready."""
        registry = self.daemon.registry
        name = request.params.get("model")
        if name is None:
            specs = [e.spec for n in registry.names() for _, e in sorted(registry.versions(n).items())
                     if e.state == ModelState.READY]
        elif request.params.get("version") is not None:
            specs = [registry.resolve(name, request.params["version"])]
        else:
            specs = [e.spec for _, e in sorted(registry.versions(name).items()) if e.state == ModelState.READY]
            if not specs:
                specs = [registry.resolve(name)]  # raises: unknown, broken, or no version ready
        sched = self.daemon.controller.scheduler
        epoch = time.time() - self.daemon.clock.now()  # the daemon's clock is monotonic
        body = {"model_stats": [model_stats_json(sched, spec, epoch) for spec in specs]}
        return Response(orjson.dumps(body))


def model_stats_json(sched: Scheduler, spec: ModelSpec, epoch: float) -> dict[str, Any]:
    """One `$model_stat` of Triton's statistics extension; `epoch` turns clock times into Unix times."""
    m = sched.telemetry.models.get(spec.key) or ModelStats(spec)
    entry = sched.models.get(spec.key)
    weights = entry.weight_bytes if entry is not None else 0
    none = Span().as_json()
    last = round((m.last_inference + epoch) * 1000) if m.last_inference else 0
    return {
        "name": spec.name,
        "version": str(spec.version),
        "last_inference": last,
        "inference_count": m.inference_count,
        "execution_count": m.execution_count,
        "inference_stats": {
            "success": m.success.as_json(), "fail": m.fail.as_json(), "queue": m.queue.as_json(),
            "compute_input": m.compute_input.as_json(), "compute_infer": m.compute_infer.as_json(),
            "compute_output": m.compute_output.as_json(),
            "cache_hit": none, "cache_miss": none,  # escapement has no response cache
        },
        "response_stats": {},
        "batch_stats": [
            {"batch_size": size,
             "compute_input": {"count": b.count, "ns": 0},
             "compute_infer": {"count": b.count, "ns": round(b.infer_s * 1e9)},
             "compute_output": {"count": b.count, "ns": round(b.other_s * 1e9)}}
            for size, b in sorted(m.batches.items())
        ],
        "memory_usage": [{"type": "GPU" if d.kind == "cuda" else "CPU", "id": d.device.index, "byte_size": weights}
                         for d in sched.devices.values() if d.memory.is_ready(spec.key)],
    }
