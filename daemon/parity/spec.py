"""A model's parity model: its spec and its key, derived from the model's (pure, no torch).

The parity model takes the model's inputs and gives its outputs (it is trained so that
F_P(encode(X_1..X_k)) ≈ F(X_1) + ... + F(X_k)); it is served as a model of its own, named
`<model>.parity`, with the version of the model it protects.
"""

from __future__ import annotations

from daemon.model import ModelSpec


def parity_key(spec: ModelSpec) -> str:
    return f"{spec.name}.parity:{spec.version}"


def parity_model(spec: ModelSpec) -> ModelSpec:
    """The spec of a model's parity model: same inputs and outputs, its own file and key."""
    assert spec.parity is not None
    return ModelSpec(f"{spec.name}.parity", spec.version, spec.path.parent / spec.parity.file, "pt2", spec.inputs,
                     spec.outputs, spec.max_batch_size, spec.slo_s, f"parity model (k={spec.parity.k}) of {spec.name}")


def parity_problem(spec: ModelSpec) -> str:
    """Why the model cannot have parity with its declared code ('' when it can)."""
    assert spec.parity is not None
    if len(spec.inputs) != 1 or len(spec.outputs) != 1:
        return "parity needs a model with one input and one output"
    from daemon.parity.codes import check  # (torch: only where a parity model is prepared)

    try:
        check(spec.parity.encoder, spec.parity.k, spec.inputs[0].sample_shape)
    except ValueError as e:
        return str(e)
    return ""
