"""Observability over HTTP: Prometheus metrics and Triton's statistics extension.

`GET /metrics` is the text exposition of the daemon's own registry (daemon/metrics.py).
`GET /v2/models[/{model}[/versions/{version}]]/stats` answers in the shape of Triton's
statistics extension, which `tritonclient`'s `get_inference_statistics` and perf_analyzer
read; without a version, every ready version of the model is reported, as Triton does.
Both are rendered by the gateway, on the event loop, where the controller's state is consistent.
"""

from __future__ import annotations

import orjson

from daemon import metrics
from daemon.api.httpserver import Request, Response, Router
from daemon.gateway import Gateway


def add_routes(router: Router, gateway: Gateway) -> None:
    """Add /metrics and the statistics routes. Call it before the routes of `/v2/models/{model}`:
    routes are tried in order, and `{model}` would match `stats`."""
    handlers = ObserveHandlers(gateway)
    router.add("GET", "/metrics", handlers.metrics)
    router.add("GET", "/v2/models/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/stats", handlers.stats)
    router.add("GET", "/v2/models/{model}/versions/{version:[0-9]+}/stats", handlers.stats)


class ObserveHandlers:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def metrics(self, request: Request) -> Response:
        return Response(self.gateway.metrics(), 200, metrics.CONTENT_TYPE)

    async def stats(self, request: Request) -> Response:
        """Raises NotFound for an unknown model or version, Unavailable for one that is not ready."""
        stats = self.gateway.model_statistics(request.params.get("model"), request.params.get("version"))
        return Response(orjson.dumps({"model_stats": stats}))
