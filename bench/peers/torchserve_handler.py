"""TorchServe handler for the `peers` benchmark: a batch of JSON requests through one forward.

Each request body is {"inputs": [[...], ...]}; the answer is {"outputs": [[...], ...]}.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler


class Handler(BaseHandler):
    def initialize(self, context: Any) -> None:
        model_dir = context.system_properties.get("model_dir")
        self.model = torch.export.load(os.path.join(model_dir, "model.pt2")).module()
        self.initialized = True

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        rows: list[list[list[float]]] = []
        for item in data:
            body = item.get("body") if item.get("body") is not None else item.get("data")
            if isinstance(body, bytes | bytearray):
                body = json.loads(body)
            rows.append(body["inputs"])
        counts = [len(r) for r in rows]
        x = torch.tensor([v for r in rows for v in r], dtype=torch.float32)
        with torch.inference_mode():
            y = self.model(x).tolist()
        out, i = [], 0
        for n in counts:
            out.append({"outputs": y[i : i + n]})
            i += n
        return out
