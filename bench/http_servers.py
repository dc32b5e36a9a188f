"""Bare HTTP servers for the `http-server` scenario: `python -m bench.http_servers KIND PORT`.

Each serves POST /v2/models/{model}/infer with the same handler work (decode the KServe v2 JSON
body with orjson, build the float32 array, answer a fixed 10-float result), so the difference
between them is the HTTP layer alone: aiohttp's web server, or the daemon's own
(daemon/api/httpserver.py).
"""

from __future__ import annotations

import asyncio
import sys

import numpy as np
import orjson
import uvloop

ANSWER = orjson.dumps({"model_name": "m", "model_version": "1",
                       "outputs": [{"name": "y", "datatype": "FP32", "shape": [1, 10], "data": [0.1] * 10}]})


def work(body: bytes) -> bytes:
    obj = orjson.loads(body)
    np.array(obj["inputs"][0]["data"], dtype=np.float32)
    return ANSWER


async def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        return web.Response(body=work(await request.read()), content_type="application/json")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v2/models/{model}/infer", infer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def serve_escapement(port: int) -> None:
    from daemon.api.httpserver import HttpServer, Request, Response, Router, error_response

    async def infer(request: Request) -> Response:
        return Response(work(request.body))

    router = Router()
    router.add("POST", "/v2/models/{model}/infer", infer)
    server = HttpServer(router, lambda req, exc: error_response(exc), max_body=64 * 2**20)
    await server.start("127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    kind, port = sys.argv[1], int(sys.argv[2])
    uvloop.run({"aiohttp": serve_aiohttp, "escapement": serve_escapement}[kind](port))
