"""The plainest server: aiohttp, one forward per request in the handler, JSON in and out.

    python bench/peers/plain_server.py MODEL.pt2 PORT

POST /infer {"inputs": [[...], ...]} -> {"outputs": [[...], ...]}; GET /health.
"""

from __future__ import annotations

import sys

import orjson
import torch
from aiohttp import web


def main() -> None:
    path, port = sys.argv[1], int(sys.argv[2])
    model = torch.export.load(path).module()

    async def infer(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        x = torch.tensor(body["inputs"], dtype=torch.float32)
        with torch.inference_mode():
            y = model(x)
        return web.Response(body=orjson.dumps({"outputs": y.tolist()}), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/infer", infer)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


if __name__ == "__main__":
    main()
