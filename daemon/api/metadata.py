"""A model's description as the KServe v2 protocol gives it: metadata and Triton's ModelConfig.

One shape for every frontend: HTTP and the socket send these dicts as JSON / msgpack, gRPC
fills its messages from the same fields.
"""

from __future__ import annotations

from typing import Any

from daemon.model import ModelSpec, TensorSpec


def model_metadata_json(spec: ModelSpec, versions: list[int]) -> dict[str, Any]:
    return {
        "name": spec.name, "versions": [str(v) for v in versions], "platform": spec.platform,
        "inputs": [t.as_json() for t in spec.inputs], "outputs": [t.as_json() for t in spec.served_outputs],
    }


def config_datatype(t: TensorSpec) -> str:
    """Triton's config name of a datatype: TYPE_FP32, ..., and TYPE_STRING for BYTES."""
    return "TYPE_STRING" if t.datatype.name == "BYTES" else f"TYPE_{t.datatype.name}"


def model_config_json(spec: ModelSpec) -> dict[str, Any]:
    """The model's configuration in the shape of Triton's ModelConfig JSON, plus our own fields."""
    def io(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "data_type": config_datatype(t), "dims": list(t.sample_shape)}

    return {
        "name": spec.name,
        "platform": spec.platform,
        "backend": "pytorch",
        "version_policy": {"all": {}},
        "max_batch_size": spec.max_batch_size,
        "input": [io(t) for t in spec.inputs],
        "output": [io(t) for t in spec.served_outputs],  # a personalized output only answers a user
        "dynamic_batching": {"preferred_batch_size": list(spec.batch_sizes)},
        "parameters": {"slo_ms": {"string_value": f"{spec.slo_s * 1000:g}"}},
        "escapement": {"slo_ms": spec.slo_s * 1000, "batch_sizes": list(spec.batch_sizes),
                       "description": spec.description, "metadata": spec.metadata},
    }
