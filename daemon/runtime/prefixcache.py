"""Outputs of a shared leading stage kept by input (Pretzel's sub-plan materialization).

When the same input is sent to several models whose plans begin with one stage (an application
scoring one image with many heads), the stage's output for it is computed once and served from
here to the others. Keyed by the stage's identity and a hash of the request's input bytes,
shapes and dtypes; least recently used entries go first; bounded in count and in bytes. One per
device, used only by its INFER thread (no lock); `stats()` is read from the event loop (its counts
are plain ints, each read whole: a snapshot at most one batch old).

A large input is hashed whole only once it has been seen before. Hashing every input costs its
bytes on the INFER thread whether or not anything repeats (blake2b: ~0.6-1.3 ms for one 3x224x224
image, longer than a ResNet-18 INFER on an H200), so an input above `WHOLE_BYTES` first gets a
sketch: a hash of its shape, dtype and `SKETCH_WINDOWS` evenly spaced byte windows (~4 KiB). Only
when the sketch was seen in an earlier batch, or twice in this one, is the whole input hashed and
looked up. A sketch that matches by chance costs one whole hash, never a wrong answer: the cache
is keyed by whole hashes alone. So a large input repeated across batches is kept at its second
sighting and served from its third; repeats within one batch are computed once, as before.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from daemon.request import InferenceRequest

_whole: Callable[[], Any] | None = None


def _whole_hash() -> Any:
    """A fresh hash object of the faster of two strong hashes on this CPU, picked at first use:
    sha256 where the CPU has SHA instructions (445 against blake2b's 861 µs for 588 KiB on a Xeon
    with SHA-NI), blake2b elsewhere. Either is sound; a wrong pick only costs time."""
    global _whole
    if _whole is None:
        data = bytes(1 << 17)
        took = {}
        for make in (hashlib.sha256, hashlib.blake2b):
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                make(data).digest()
                best = min(best, time.perf_counter() - t)
            took[make] = best
        _whole = min(took, key=took.__getitem__)
    return _whole()


WHOLE_BYTES = 16 << 10  # inputs up to this are hashed whole at once (~20 µs here at most)
SKETCH_WINDOWS = 64  # windows of `SKETCH_WINDOW` bytes a large input's sketch samples
SKETCH_WINDOW = 64


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """One device's prefix cache, as /metrics and the daemon's statistics report it."""

    hits: int  # requests whose prefix output came from the cache
    misses: int  # requests looked up and not found (then computed, and kept if they fit)
    evictions: int  # entries dropped to make room (count or bytes)
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    unseen: int = 0  # large inputs seen for the first time: not hashed whole, looked up or kept


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, tuple[tuple[torch.Tensor, ...], int, str]] = OrderedDict()
        self._held: dict[str, int] = {}  # entries per stage identity
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.unseen = 0
        # sketches of large inputs seen lately (least recent first), a few times the entries
        self._sketches: OrderedDict[bytes, None] = OrderedDict()
        self.max_sketches = min(max(4 * max_entries, 1024), 1 << 16)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.hits, self.misses, self.evictions, len(self._entries), self.nbytes,
                                self.max_entries, self.max_bytes, self.unseen)

    @staticmethod
    def key(sid: str, inputs: Sequence[np.ndarray]) -> bytes:
        h = _whole_hash()
        h.update(sid.encode())
        for a in inputs:
            h.update(f"|{a.dtype.str}{a.shape}|".encode())
            h.update(np.ascontiguousarray(a).data)
        return h.digest()[:16]

    def holds(self, sid: str) -> bool:
        """Whether any output of stage `sid` is kept (else a lookup can only miss)."""
        return self._held.get(sid, 0) > 0

    @staticmethod
    def sketch(sid: str, inputs: Sequence[np.ndarray]) -> bytes | None:
        """A cheap hash of a large input's sampled bytes; None for an input small enough to hash whole."""
        if sum(a.nbytes for a in inputs) <= WHOLE_BYTES:
            return None
        h = hashlib.blake2b(sid.encode(), digest_size=16)
        for a in inputs:
            h.update(f"|{a.dtype.str}{a.shape}|".encode())
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            n = len(flat)
            if n <= SKETCH_WINDOWS * SKETCH_WINDOW:
                h.update(flat.data)
                continue
            step = (n - SKETCH_WINDOW) // (SKETCH_WINDOWS - 1)
            starts = np.arange(SKETCH_WINDOWS, dtype=np.int64) * step
            h.update(flat[starts[:, None] + np.arange(SKETCH_WINDOW, dtype=np.int64)].tobytes())
        return h.digest()

    def seen(self, sketch: bytes) -> bool:
        """Whether `sketch` was remembered; remembers it (most recent) either way, bounded."""
        known = sketch in self._sketches
        if known:
            self._sketches.move_to_end(sketch)
        else:
            if len(self._sketches) >= self.max_sketches:
                self._sketches.popitem(last=False)
            self._sketches[sketch] = None
        return known

    def get(self, key: bytes) -> tuple[torch.Tensor, ...] | None:
        hit = self._entries.get(key)
        if hit is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return hit[0]

    def put(self, key: bytes, value: tuple[torch.Tensor, ...], sid: str = "") -> None:
        """Keep `value` (tensors the caller no longer writes); the oldest entries make room."""
        if key in self._entries:
            return
        n = sum(t.numel() * t.element_size() for t in value)
        if n > self.max_bytes or not self.enabled:
            return
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + n > self.max_bytes):
            _, (_, freed, gone) = self._entries.popitem(last=False)
            self._held[gone] -= 1
            self.nbytes -= freed
            self.evictions += 1
        self._entries[key] = (value, n, sid)
        self._held[sid] = self._held.get(sid, 0) + 1
        self.nbytes += n


@dataclass(slots=True)
class PrefixPlan:
    """Which requests of a batch of plans run the shared first stage, and where every request's
    output of it comes from."""

    run: list[InferenceRequest]  # requests whose prefix is computed (each distinct input once)
    keys: list[bytes | None]  # per request of `run`: its cache key (None: no cache)
    starts: list[int]  # per request of `run`: its first row among the computed ones
    # per request of the batch, in order: (its request's index in `run`, -1 if held) and the held output
    sources: list[tuple[int, tuple[torch.Tensor, ...] | None]]
    sid: str = ""  # the stage's identity, which the cache counts its entries by

    @property
    def rows(self) -> int:
        return sum(r.samples for r in self.run)

    def parts(self, computed: tuple[torch.Tensor, ...], first: int, count: int) -> tuple[torch.Tensor, ...]:
        """The prefix output of batch requests first .. first+count-1, their rows in order."""
        parts: list[tuple[torch.Tensor, ...]] = []
        for j, held in self.sources[first : first + count]:
            if held is not None:
                parts.append(held)
            else:
                at, n = self.starts[j], self.run[j].samples
                parts.append(tuple(o[at : at + n] for o in computed))
        return parts[0] if len(parts) == 1 else tuple(torch.cat(c) for c in zip(*parts, strict=True))

    def keep(self, cache: PrefixCache, computed: tuple[torch.Tensor, ...]) -> None:
        """Copies of the computed rows into the cache (a view would keep the whole batch's output alive)."""
        for r, k, at in zip(self.run, self.keys, self.starts, strict=True):
            if k is not None:
                cache.put(k, tuple(o[at : at + r.samples].clone() for o in computed), self.sid)


def plan_prefix(cache: PrefixCache, sid: str, requests: Sequence[InferenceRequest], look: bool = True) -> PrefixPlan:
    """Look every request up (the stage `sid`'s output for its input): held ones are served from the
    cache, repeats of one input in the batch computed once. Without `look`, every request runs
    (no hashing) and nothing is kept."""
    plan = PrefixPlan([], [], [], [], sid)
    pending: dict[bytes, int] = {}  # key -> its position in `run`
    at = 0
    look = look and cache.enabled
    whole = _worth_hashing(cache, sid, requests) if look else []
    for i, r in enumerate(requests):
        k = cache.key(sid, r.inputs) if look and whole[i] else None
        if k is not None:
            j = pending.get(k)
            if j is not None:  # the same input earlier in this batch
                plan.sources.append((j, None))
                continue
            held = cache.get(k)
            if held is not None:
                plan.sources.append((-1, held))
                continue
            pending[k] = len(plan.run)
        plan.sources.append((len(plan.run), None))
        plan.keys.append(k)
        plan.starts.append(at)
        plan.run.append(r)
        at += r.samples
    return plan


def _worth_hashing(cache: PrefixCache, sid: str, requests: Sequence[InferenceRequest]) -> list[bool]:
    """Per request, whether its input is hashed whole: a small one always; a large one when its
    sketch was seen in an earlier batch or appears twice in this one; none in a batch with object
    (BYTES) inputs, which are never looked up."""
    if any(a.dtype.hasobject for r in requests for a in r.inputs):
        return [False] * len(requests)  # (BYTES: objects, whose bytes are pointers, not content)
    sketches = [cache.sketch(sid, r.inputs) for r in requests]
    if all(s is None for s in sketches):
        return [True] * len(requests)
    counts: dict[bytes, int] = {}
    for s in sketches:
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    known = {s for s in counts if cache.seen(s)}
    out = [s is None or s in known or counts[s] > 1 for s in sketches]
    cache.unseen += out.count(False)
    return out
