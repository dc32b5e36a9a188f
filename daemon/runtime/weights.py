"""Model weights laid out as one contiguous block.

Every model's parameters, buffers and constant tensors are packed into one flat byte buffer
(each tensor aligned), like Clockwork's paged weights: host memory holds it once (page-locked
in place on CUDA machines, within a budget: hostmem.py), a LOAD copies it into memory the
device owns (an extent of the CUDA weight arena), and the device's tensors are views into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from daemon.runtime.hostmem import page_aligned

ALIGN = 256  # bytes; enough for any dtype and for coalesced GPU access


@dataclass(frozen=True, slots=True)
class WeightEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class WeightLayout:
    entries: tuple[WeightEntry, ...]
    nbytes: int

    @staticmethod
    def of(tensors: list[tuple[str, torch.Tensor]]) -> WeightLayout:
        entries: list[WeightEntry] = []
        offset = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            entries.append(WeightEntry(name, t.dtype, tuple(t.shape), offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        return WeightLayout(tuple(entries), max(offset, ALIGN))

    def views(self, block: torch.Tensor) -> list[torch.Tensor]:
        """Tensors over `block` (a flat uint8 tensor of at least `nbytes`), one per entry."""
        return self.split_views(block, block, len(self.entries), 0)

    def split_views(self, head: torch.Tensor, rest: torch.Tensor, count: int, skip: int) -> list[torch.Tensor]:
        """`views` over a block split in two places: the first `count` entries (the first `skip`
        bytes) over `head`, the others over `rest`, which starts with the byte at `skip`."""
        out: list[torch.Tensor] = []
        for i, e in enumerate(self.entries):
            if not e.nbytes:
                out.append(torch.empty(e.shape, dtype=e.dtype, device=head.device))
                continue
            block, at = (head, e.offset) if i < count else (rest, e.offset - skip)
            if at < 0 or at + e.nbytes > block.numel():
                raise ValueError(f"weight {e.name} does not fall within its part of the split block")
            out.append(block[at : at + e.nbytes].view(e.dtype).view(e.shape))
        return out


def pack(tensors: list[tuple[str, torch.Tensor]]) -> tuple[WeightLayout, torch.Tensor]:
    """Copy `tensors` into one new flat host block; returns its layout and the block."""
    layout = WeightLayout.of(tensors)
    block = page_aligned(layout.nbytes)  # so that a CUDA backend can page-lock it in place
    block.zero_()
    for (_, t), view in zip(tensors, layout.views(block), strict=True):
        view.copy_(t.detach())
    return layout, block
