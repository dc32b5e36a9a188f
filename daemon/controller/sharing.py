"""Cross-model batching: a leading stage several models share runs once for all their requests.

Models declared as plans of stages (runtime/program.py) whose first stage is the same program
over the same weights share a `prefix` (Pretzel's shared sub-plans). When a device that keeps
shared weights once runs a batch of one of them, requests queued for the others may join it:
the shared stage runs once on every row, then each model's remaining stages on its own rows.
Clockwork's rules hold for the whole batch: it joins only requests that all still finish by
their deadlines when it starts at `start`, by estimates per stage and row count (the prefix's
under `prefix_key`, each model's remaining stages under `tail_key`; the executor measures both).
Pure code: a read-only view in, the requests to add out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from daemon.controller.state import EXTENT_KINDS, DeviceState, ModelEntry
from daemon.controller.view import ControllerView
from daemon.model import ModelSpec
from daemon.request import InferenceRequest
from daemon.runtime.program import prefix_key, tail_key

MAX_MEMBERS: Final = 16  # models in one cross-model batch besides its lead (each adds a tail call)
SCAN: Final = 64  # candidate models looked at for one batch (a pass must stay cheap with thousands)

Members = list[tuple[ModelSpec, list[InferenceRequest]]]


def cost(view: ControllerView, dev: DeviceState, prefix: str, rows: int, tails: Iterable[tuple[str, int]]
         ) -> float | None:
    """Seconds a cross-model batch takes on `dev`: the prefix on `rows`, then each (model, rows) tail;
    None while a stage has no estimate there (the batch is then not planned)."""
    est = view.estimator
    total = est.infer(prefix_key(prefix), rows, dev.kind, dev.name)
    if total is None:
        return None
    for key, n in tails:
        t = est.infer(tail_key(key), n, dev.kind, dev.name)
        if t is None:
            return None
        total += t
    return total


def joined(members: Members, samples: int, deadline: float) -> tuple[int, float]:
    """A batch's samples and earliest deadline once the members' requests join its own."""
    reqs = [r for _, rs in members for r in rs]
    return samples + sum(r.samples for r in reqs), min([deadline] + [r.deadline for r in reqs])


def own_limit(spec: ModelSpec) -> int:
    return spec.max_batch_size


def extend(view: ControllerView, dev: DeviceState, lead: ModelEntry, taken: list[InferenceRequest],
           start: float, candidates: Iterable[str], now: float,
           limit: Callable[[ModelSpec], int] = own_limit) -> tuple[Members, float] | None:
    """Requests of other models sharing `lead`'s prefix, ready on `dev`, that can join the batch
    `taken` of `lead` starting at `start`: (members with their requests, the batch's expected
    seconds), or None when none can. The batch holds at most `lead`'s largest batch of rows (the
    prefix runs in the lead's buffers); members are looked at most urgent first, and each joins
    with as many of its queued requests as fit (at most `limit(its spec)` rows: its own largest
    batch, or what the policy lets it run now, as AIMD's learned size), if every request in the
    batch still meets its deadline (else it is left out whole and the next one is tried)."""
    prefix, cap = lead.prefix, lead.spec.max_batch_size
    rows = sum(r.samples for r in taken)
    deadline = min(r.deadline for r in taken)
    tails: list[tuple[str, int]] = [(lead.key, rows)]
    if rows >= cap or cost(view, dev, prefix, rows, tails) is None:
        return None
    heads: list[tuple[float, str, ModelEntry]] = []
    for key in candidates:
        entry = view.models.get(key)
        if entry is None or entry is lead or entry.prefix != prefix or not dev.memory.is_ready(key) or \
                not dev.healthy_for(key, now):
            continue
        head = entry.queue.head()
        if head is not None:
            heads.append((head.deadline, key, entry))
        if len(heads) >= SCAN:
            break
    heads.sort(key=lambda h: h[:2])
    members: Members = []
    total: float | None = None
    for _, key, entry in heads:
        if rows >= cap or len(members) >= MAX_MEMBERS:
            break
        reqs: list[InferenceRequest] = []
        n, due = 0, deadline
        room = min(cap - rows, limit(entry.spec))  # its own tail runs on its rows: its limit holds
        for r in entry.queue.first(room):
            if n + r.samples > room:
                break
            reqs.append(r)
            n += r.samples
            due = min(due, r.deadline)
        if not reqs:
            continue
        trial = cost(view, dev, prefix, rows + n, [*tails, (key, n)])
        if trial is None or start + trial > due:
            continue  # it would make someone late (or has no estimate yet): the batch goes without it
        members.append((entry.spec, reqs))
        tails.append((key, n))
        rows, deadline, total = rows + n, due, trial
    if not members or total is None:
        return None
    return members, total


def candidates(view: ControllerView, lead: ModelEntry) -> list[str]:
    """Models with queued work that share `lead`'s prefix (for policies that keep no index of their
    own, as clockwork does: one pass over the models with work)."""
    return [e.key for e in view.active() if e.prefix == lead.prefix and e is not lead]


def allowed(dev: DeviceState, lead: ModelEntry) -> bool:
    """Whether a batch of `lead` on `dev` may take in other models' requests: `lead` is a plan of
    stages, the device keeps shared weights once (CPU) or runs a shared stage over the lead's
    weights (CUDA), and ParM does not protect the model (its coding groups are one model's batches)."""
    # (EXTENT_KINDS, CUDA: the lead's extent takes every row, each member's tail runs over its own weights)
    return bool(lead.prefix) and (dev.memory.shares or dev.device.kind in EXTENT_KINDS) and lead.spec.parity is None
