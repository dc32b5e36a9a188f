"""Ray Serve app for the `peers` benchmark: `@serve.batch` over one forward, JSON in and out.

    python bench/peers/ray_app.py MODEL.pt2 PORT
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import ray
import torch
from ray import serve
from starlette.requests import Request


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class Model:
    def __init__(self, path: str) -> None:
        torch.set_num_threads(1)
        self.model = torch.export.load(path).module()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def batched(self, xs: list[np.ndarray]) -> list[list[list[float]]]:
        counts = [len(x) for x in xs]
        with torch.inference_mode():
            y = self.model(torch.from_numpy(np.concatenate(xs))).tolist()
        out, i = [], 0
        for n in counts:
            out.append(y[i : i + n])
            i += n
        return out

    async def __call__(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"outputs": await self.batched(np.asarray(body["inputs"], dtype=np.float32))}


def main() -> None:
    path, port = sys.argv[1], int(sys.argv[2])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Model.bind(path), route_prefix="/", name="peer")
    print("ray serve ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
