"""The peers gRPC generator records a failed RPC by what its status code means (bench results
count an overload refusal as "unavailable", not as an internal error)."""

from __future__ import annotations

import grpc

from bench import results
from bench.scenarios.peers_protocols import GRPC_ERROR, grpc_status


def test_a_refusal_a_deadline_and_other_failures_keep_their_meaning() -> None:
    assert results.ERROR_NAMES[grpc_status(grpc.StatusCode.UNAVAILABLE.name)] == "unavailable"
    assert results.ERROR_NAMES[grpc_status(grpc.StatusCode.RESOURCE_EXHAUSTED.name)] == "unavailable"
    assert results.ERROR_NAMES[grpc_status(grpc.StatusCode.DEADLINE_EXCEEDED.name)] == "deadline"
    assert grpc_status(grpc.StatusCode.INTERNAL.name) == GRPC_ERROR
    assert grpc_status(grpc.StatusCode.UNKNOWN.name) == GRPC_ERROR
