"""The prediction cache (Clipper's PredictionCache, Triton's response cache): answers kept by input.

A model version opts in with `[response_cache] enabled = true` in its config.toml; the budget is
daemon-wide (`[cache]` in the daemon's config), like Triton's `--cache-config local,size=N`.

- Key: a BLAKE2b digest of every input's name, datatype, shape and bytes, in the model's input
  order. The requested outputs are not part of it: the controller always computes every output
  of a model and the frontends pick the requested ones when they encode the answer, so an entry
  holds all of them and serves any subset (keying on the subset would only split the hits).
- Entries are per version object: a version reloaded under the same number is another
  `ModelSpec`, and finding one in place of the other drops the old entries (the model manager
  also drops a version's entries as soon as it stops admitting requests).
- Bounded in bytes (outputs plus a fixed overhead per entry) and in count; LRU eviction: an
  OrderedDict moved on each hit costs O(1) and is exact.
- Only what the model itself answered is kept: a ParM reconstruction is an approximation and
  is never stored.

Runs on the event loop thread only (the gateway's submit path), so it takes no lock.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from daemon.api.codec import tensor_bytes
from daemon.model import ModelSpec

ENTRY_OVERHEAD = 256  # bytes an entry costs beyond its outputs (the key, the dict slot, array headers)
_DIM = struct.Struct("<q")


@dataclass(slots=True)
class VersionCache:
    """One version's share of the cache: its entries' digests and its Triton statistics."""

    spec: ModelSpec
    digests: set[bytes] = field(default_factory=set)
    hits: int = 0
    hit_ns: int = 0  # lookups that hit, and copying their answer out
    misses: int = 0
    miss_ns: int = 0  # lookups that missed, plus storing the answer afterwards


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int
    misses: int
    evictions: int
    entries: int
    bytes: int
    limit_bytes: int
    limit_entries: int


class PredictionCache:
    def __init__(self, max_bytes: int, max_entries: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.max_entry_bytes = max_entry_bytes
        self._entries: OrderedDict[tuple[str, bytes], tuple[tuple[np.ndarray, ...], int]] = OrderedDict()
        self._versions: dict[str, VersionCache] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0  # entries pushed out by the bounds (not those of a retired version)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    @staticmethod
    def key(spec: ModelSpec, inputs: tuple[np.ndarray, ...]) -> bytes:
        """The digest of a request's inputs (names, datatypes, shapes and bytes, in model order)."""
        h = hashlib.blake2b(digest_size=16)
        for s, a in zip(spec.inputs, inputs, strict=True):
            h.update(s.name.encode())
            h.update(b"\0" + s.datatype.name.encode() + b"\0")
            h.update(_DIM.pack(a.ndim))
            for d in a.shape:
                h.update(_DIM.pack(d))
            if a.dtype == object:  # BYTES: length-prefixed elements, so element boundaries count
                h.update(tensor_bytes(a))
            else:
                h.update(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)
        return h.digest()

    def get(self, spec: ModelSpec, digest: bytes, began_ns: int) -> tuple[np.ndarray, ...] | None:
        """The answer stored for these inputs of this version, or None (a miss, counted)."""
        v = self._version(spec)
        item = self._entries.get((spec.key, digest))
        if item is None:
            self.misses += 1
            v.misses += 1
            v.miss_ns += time.perf_counter_ns() - began_ns
            return None
        self._entries.move_to_end((spec.key, digest))
        self.hits += 1
        v.hits += 1
        v.hit_ns += time.perf_counter_ns() - began_ns
        return item[0]

    def put(self, spec: ModelSpec, digest: bytes, outputs: tuple[np.ndarray, ...]) -> bool:
        """Store a version's answer (copied, read-only); False if it is larger than an entry may be
        or the version no longer is the one served under its key."""
        began = time.perf_counter_ns()
        v = self._versions.get(spec.key)
        if v is None or v.spec is not spec:
            return False  # dropped meanwhile (retired or replaced while the request ran)
        size = ENTRY_OVERHEAD + sum(a.nbytes for a in outputs)
        if size > self.max_entry_bytes or size > self.max_bytes:
            return False
        k = (spec.key, digest)
        old = self._entries.pop(k, None)  # two misses of the same inputs both ran: keep the later
        if old is not None:
            self.bytes -= old[1]
            v.digests.discard(digest)
        kept = tuple(_frozen(a) for a in outputs)
        while self._entries and (self.bytes + size > self.max_bytes or len(self._entries) >= self.max_entries):
            self._evict_oldest()
        self._entries[k] = (kept, size)
        self.bytes += size
        v.digests.add(digest)
        v.miss_ns += time.perf_counter_ns() - began
        return True

    def drop(self, spec: ModelSpec) -> int:
        """Forget every entry of a version (it was retired, unloaded or replaced); how many."""
        v = self._versions.pop(spec.key, None)
        if v is None:
            return 0
        for d in v.digests:
            _, size = self._entries.pop((spec.key, d))
            self.bytes -= size
        return len(v.digests)

    def version_stats(self, spec: ModelSpec) -> VersionCache | None:
        v = self._versions.get(spec.key)
        return v if v is not None and v.spec is spec else None

    def versions(self) -> list[VersionCache]:
        return list(self._versions.values())

    def stats(self) -> CacheStats:
        return CacheStats(self.hits, self.misses, self.evictions, len(self._entries), self.bytes, self.max_bytes,
                          self.max_entries)

    def _version(self, spec: ModelSpec) -> VersionCache:
        v = self._versions.get(spec.key)
        if v is None or v.spec is not spec:
            if v is not None:
                self.drop(v.spec)  # a reload under the same version number: its answers may differ
            v = self._versions[spec.key] = VersionCache(spec)
        return v

    def _evict_oldest(self) -> None:
        (vkey, digest), (_, size) = self._entries.popitem(last=False)
        self.bytes -= size
        self.evictions += 1
        self._versions[vkey].digests.discard(digest)


def _frozen(a: np.ndarray) -> np.ndarray:
    """An owned, read-only copy: the executor's buffers are reused, and a hit hands out this array."""
    c = np.array(a, copy=True, order="C")
    c.flags.writeable = False
    return c
