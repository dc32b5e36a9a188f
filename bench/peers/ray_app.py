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

# python bench/peers/ray_app.py MODEL.pt2 PORT [MAX_BATCH WAIT_MS]: the batching knobs are read before
# the class is defined, because @serve.batch takes them there (the class travels to Ray's workers whole).
MAX_BATCH = int(sys.argv[3]) if len(sys.argv) > 3 else 32
WAIT_S = float(sys.argv[4]) / 1000 if len(sys.argv) > 4 else 0.005


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class Model:
    def __init__(self, path: str) -> None:
        torch.set_num_threads(1)
        self.model = torch.export.load(path).module()

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=WAIT_S)
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
