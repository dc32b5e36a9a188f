"""Parameters stored once: host tensors addressed by their content (Pretzel's object store).

A tensor's content id is a hash of its bytes, its dtype and its shape. Loading a model version
puts each of its weights here; one whose content is already held (the backbone a fine-tuned
variant shares with its siblings, the tensors a new version left unchanged) is replaced by the
held tensor, so host memory keeps each distinct tensor once across all models and versions.

A held tensor lives as long as a program refers to it: the store's entries are weak, so Python's
reference count is the store's, and dropping the last version that uses a tensor frees it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref

import torch

from daemon.runtime.weights import ALIGN


def content_id(t: torch.Tensor) -> str:
    """The tensor's content: dtype, shape and bytes (two tensors with one id are interchangeable)."""
    flat = t.detach().contiguous().reshape(-1)
    h = hashlib.blake2b(f"{flat.dtype}|{tuple(t.shape)}|".encode(), digest_size=16)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def block_bytes(t: torch.Tensor) -> int:
    """Bytes a device block of `t` takes (aligned as packed weights are: weights.ALIGN)."""
    return -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN


class ObjectStore:
    """Content-addressed host tensors, shared by every program that holds the same content."""

    def __init__(self) -> None:
        self._tensors: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
        self._lock = threading.RLock()  # programs load on worker threads (reentrant: a weakref callback may run inside)
        # held tensor's id -> (a weak reference to it, its content id): a tensor put again (a program
        # read ahead, runtime/shared_prefix.py, then loaded) is not hashed again
        self._held: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}

    def put(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(content id, the held tensor): `t` itself the first time its content is seen."""
        with self._lock:
            known = self._held.get(id(t))
            if known is not None and known[0]() is t:
                return known[1], t
        cid = content_id(t)
        with self._lock:
            held = self._tensors.get(cid)
            if held is None:
                held = t.detach()
                if not held.is_contiguous() or held.untyped_storage().nbytes() != held.numel() * held.element_size():
                    held = held.contiguous().clone()  # a view would keep its whole storage alive
                self._tensors[cid] = held
                key = id(held)
                self._held[key] = (weakref.ref(held, functools.partial(self._forget, key)), cid)
            return cid, held

    def _forget(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        with self._lock:
            if (e := self._held.get(key)) is not None and e[0] is ref:
                del self._held[key]

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Host bytes of the distinct tensors held now."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._tensors.values())


STORE = ObjectStore()  # the process's store: every model version loads its weights through it
