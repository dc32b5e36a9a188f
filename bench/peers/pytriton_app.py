"""PyTriton app for the `peers` benchmark: an `@batch` function bound to Triton.

    python bench/peers/pytriton_app.py MODEL.pt2 HTTP_PORT GRPC_PORT METRICS_PORT INSTANCES MAX_BATCH QUEUE_DELAY_US

PyTriton starts the bundled tritonserver and forwards each batch to this process (ZeroMQ);
requests use Triton's KServe v2 HTTP API, the same bytes as escapement's.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main() -> None:
    path = sys.argv[1]
    port, grpc_port, metrics_port, instances, max_batch, delay_us = map(int, sys.argv[2:8])
    torch.set_num_threads(1)
    with torch.inference_mode():
        model = torch.jit.trace(torch.export.load(path).module(), torch.zeros(2, 784), check_trace=False)

    @batch
    def infer(INPUT__0: np.ndarray) -> dict[str, np.ndarray]:
        with torch.inference_mode():
            return {"OUTPUT__0": model(torch.from_numpy(INPUT__0)).numpy()}

    config = TritonConfig(http_address="127.0.0.1", http_port=port, grpc_address="127.0.0.1", grpc_port=grpc_port,
                          metrics_port=metrics_port)
    with Triton(config=config) as triton:
        triton.bind(model_name="mlp_784", infer_func=[infer] * instances,
                    inputs=[Tensor(name="INPUT__0", dtype=np.float32, shape=(784,))],
                    outputs=[Tensor(name="OUTPUT__0", dtype=np.float32, shape=(10,))],
                    config=ModelConfig(max_batch_size=max_batch,
                                       batcher=DynamicBatcher(max_queue_delay_microseconds=delay_us)))
        print("pytriton ready", flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
