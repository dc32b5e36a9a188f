"""The `aimd` policy: Clipper's adaptive batching (NSDI '17), kept as a baseline.

Per model, the batch size a device may take grows additively (`controller.aimd_step` samples)
after each full batch that ran within the model's SLO, and is cut multiplicatively
(`controller.aimd_backoff`, Clipper's 10%) after a batch that took longer; it starts at one sample
and never exceeds `max_batch_size`. Everything else is the `dynamic` policy's: a device runs one
batch at a time, the model whose oldest request waited longest goes first, nothing waits to fill,
models are loaded on demand. Clipper learns the batch size from measured latency alone; unlike
`clockwork` it has no estimate of what a batch will take before it runs it. A cross-model batch
(controller/sharing.py) takes each member with at most its own learned size, and teaches each
member's size as its own batch of its rows that took the whole batch's time.
"""

from __future__ import annotations

from daemon.actions import ActionKind, Result
from daemon.controller.policies.dynamic import DynamicBatchingPolicy
from daemon.controller.view import ControllerView
from daemon.model import ModelSpec


class AimdPolicy(DynamicBatchingPolicy):
    name = "aimd"

    def __init__(self, step: float = 1.0, backoff: float = 0.9, cross_model: bool = True) -> None:
        super().__init__(max_queue_delay=0.0, cross_model=cross_model)
        self.step = step
        self.backoff = backoff
        self.caps: dict[str, float] = {}  # model key -> its batch size (fractional: the decrease is)

    def _cap(self, spec: ModelSpec) -> int:
        return max(1, min(spec.max_batch_size, int(self.caps.get(spec.key, 1.0))))

    def on_result(self, view: ControllerView, result: Result, now: float) -> None:
        a = result.action
        if a.kind != ActionKind.INFER or not result.ok or a.coded is not None or a.replica_of or a.best_effort:
            return
        took = result.end - result.begin
        if not a.group:
            self._learn(a.model, a.samples, took)
            return
        i = 0
        for spec, count in a.group:  # (each member's requests, in order: count of them)
            self._learn(spec, sum(r.samples for r in a.requests[i:i + count]), took)
            i += count

    def _learn(self, spec: ModelSpec, rows: int, took: float) -> None:
        cap = self.caps.get(spec.key, 1.0)
        if took > spec.slo_s:
            self.caps[spec.key] = max(1.0, cap * self.backoff)
        elif rows >= int(cap):  # only a full batch says a larger one is wanted
            self.caps[spec.key] = min(float(spec.max_batch_size), cap + self.step)
