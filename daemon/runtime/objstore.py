"""Parameters stored once: host tensors addressed by their content (Pretzel's object store).

A tensor's content id is a hash of its bytes, its dtype and its shape. Loading a model version
puts each of its weights here; one whose content is already held (the backbone a fine-tuned
variant shares with its siblings, the tensors a new version left unchanged) is replaced by the
held tensor, so host memory keeps each distinct tensor once across all models and versions.

A held tensor lives as long as a program refers to it: the store's entries are weak, so Python's
reference count is the store's, and dropping the last version that uses a tensor frees it.
"""

from __future__ import annotations

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
        self._lock = threading.Lock()  # programs load on worker threads

    def put(self, t: torch.Tensor) -> tuple[str, torch.Tensor]:
        """(content id, the held tensor): `t` itself the first time its content is seen."""
        cid = content_id(t)
        with self._lock:
            held = self._tensors.get(cid)
            if held is None:
                held = t.detach()
                if not held.is_contiguous() or held.untyped_storage().nbytes() != held.numel() * held.element_size():
                    held = held.contiguous().clone()  # a view would keep its whole storage alive
                self._tensors[cid] = held
            return cid, held

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        """Host bytes of the distinct tensors held now."""
        with self._lock:
            return sum(t.numel() * t.element_size() for t in self._tensors.values())


STORE = ObjectStore()  # the process's store: every model version loads its weights through it
