"""Triton python-backend model for the `peers` benchmark: the demo program behind Triton's
dynamic batcher. peers.py writes it as `<repo>/mlp_784/1/model.py`, with the peer's
site-packages in SITE (the backend's stub runs the base interpreter, which neither sees the
venv nor takes PYTHONPATH), and a config.pbtxt naming the program file (parameter `model_path`)
and the intra-op threads (`threads`).

As a Triton user would serve a torch model without the libtorch backend (the PyPI wheel has
none): load the program once per instance, trace it to TorchScript (one call per batch, no
Python per op, as escapement's CPU path runs it), and run each batch the dynamic batcher forms.
"""

from __future__ import annotations

import json
import sys
from typing import Any

SITE = "@SITE_PACKAGES@"  # peers.py writes the peer's site-packages here
sys.path.insert(0, SITE)  # before numpy is imported: the stub's own numpy may be another version

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402  # provided by the python backend's stub


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        params = json.loads(args["model_config"]).get("parameters", {})
        torch.set_num_threads(int(params.get("threads", {}).get("string_value", "1")))
        program = torch.export.load(params["model_path"]["string_value"]).module()
        with torch.inference_mode():
            self.model = torch.jit.trace(program, torch.zeros(2, 784), check_trace=False)
            for b in (1, 8, 32):
                self.model(torch.zeros(b, 784))

    def execute(self, requests: list[Any]) -> list[Any]:
        xs = [pb_utils.get_input_tensor_by_name(r, "INPUT__0").as_numpy() for r in requests]
        with torch.inference_mode():
            y = self.model(torch.from_numpy(np.concatenate(xs))).numpy()
        out, i = [], 0
        for x in xs:
            rows = np.ascontiguousarray(y[i : i + len(x)])
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT__0", rows)]))
            i += len(x)
        return out
