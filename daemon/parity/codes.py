"""Parity codes, one implementation for training and serving so the two cannot disagree.

A coding group is k data batches of one model; its parity batch is `encode(k inputs)`, served
by a parity model trained so that F_P(encode(X_1..X_k)) ≈ F(X_1) + ... + F(X_k). When one data
output is missing, `decode` gives F_P(P) - Σ of the other k-1 outputs (on logits).

- `sum`: the parity is the elementwise sum of the k inputs (any input shape).
- `concat`: for images [B, C, H, W] (H, W even) and k = 2 or 4: each image is downsampled by
  area averaging to half width (k = 2) or half height and width (k = 4) and tiled side by side
  (k = 2) or in quadrants (k = 4). Channels are kept apart: channel c of the parity comes from
  channel c of every member (the original ParM trainer mixed channels across images; see
  reference/parm.md).

`default_encoder` picks `concat` where it applies and `sum` elsewhere: on the zoo's image models
the degraded-mode drop with concat against sum was 6.9 against 21.1 points (residual CNN) and
6.0 against 20.3 (transformer) at k = 4, 0.7 against 3.5 and 1.8 against 2.2 at k = 2
(bench/results/parity-accuracy.md).

Members of a group may fill different numbers of rows; rows a member lacks count as zeros.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from daemon.request import InferenceRequest

ENCODERS = ("sum", "concat")


def encode_sum(xs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ xs, into `out` when given (the executor passes its input buffer: no copy of the result)."""
    if out is None:
        out = xs[0].clone()
    else:
        out.copy_(xs[0])
    for x in xs[1:]:
        out += x
    return out


def encode_concat(xs: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The k images tiled, each area-averaged to fit; into `out` when given."""
    k = len(xs)
    x0 = xs[0]
    if x0.dim() != 4:
        raise ValueError(f"the concat encoder takes images [B, C, H, W], not shape {list(x0.shape)}")
    _, _, h, w = x0.shape
    if h % 2 or w % 2:
        raise ValueError(f"the concat encoder needs an even height and width, not {h}x{w}")
    if k not in (2, 4):
        raise ValueError(f"the concat encoder supports k = 2 or 4, not {k}")
    # Area averaging as strided adds written straight into the tiles: avg_pool2d and torch.cat took
    # 10x longer (1.65 ms against 0.16 ms for 32 images of 3x32x32 at k = 4, one thread), and the
    # executor encodes every parity batch.
    out = torch.empty_like(x0) if out is None else out
    h2, w2 = h // 2, w // 2
    if k == 2:
        for i, x in enumerate(xs):
            torch.add(x[..., 0::2], x[..., 1::2], out=out[..., i * w2 : (i + 1) * w2])
        return out.mul_(0.5)
    rows = torch.empty((*x0.shape[:2], h2, w), dtype=x0.dtype)
    for i, x in enumerate(xs):  # quadrants in reading order: 0 1 / 2 3
        r, c = divmod(i, 2)
        torch.add(x[:, :, 0::2], x[:, :, 1::2], out=rows)  # pairs of rows first: contiguous, cheap
        torch.add(rows[..., 0::2], rows[..., 1::2], out=out[:, :, r * h2 : (r + 1) * h2, c * w2 : (c + 1) * w2])
    return out.mul_(0.25)


Encoder = Callable[..., torch.Tensor]  # (members, out=None) -> the parity input


def encoder(name: str) -> Encoder:
    if name == "sum":
        return encode_sum
    if name == "concat":
        return encode_concat
    raise ValueError(f"unknown encoder {name!r}; encoders: {', '.join(ENCODERS)}")


def check(name: str, k: int, sample_shape: Sequence[int]) -> None:
    """Raise ValueError if `name` with `k` cannot encode inputs of `sample_shape` (no batch dim)."""
    if not 2 <= k <= 8:
        raise ValueError(f"k = {k}: a coding group has 2 to 8 data batches")
    if name == "concat":
        if k not in (2, 4):
            raise ValueError(f"the concat encoder supports k = 2 or 4, not {k}")
        if len(sample_shape) != 3 or sample_shape[1] % 2 or sample_shape[2] % 2:
            raise ValueError(f"the concat encoder needs [C, H, W] inputs with even H and W, not {list(sample_shape)}")
    elif name != "sum":
        raise ValueError(f"unknown encoder {name!r}; encoders: {', '.join(ENCODERS)}")


def default_encoder(k: int, sample_shape: Sequence[int]) -> str:
    """`concat` for images it can tile (ParM's best code on images), else `sum`."""
    try:
        check("concat", k, sample_shape)
    except ValueError:
        return "sum"
    return "concat"


def decode(parity_out: torch.Tensor, others: Sequence[torch.Tensor]) -> torch.Tensor:
    """The missing member's output: the parity output minus the k-1 other outputs."""
    out = parity_out.clone()
    for o in others:
        out -= o
    return out


def stack_members(members: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
    """Members padded with zero rows to `rows` rows (a member may fill fewer rows than others)."""
    out = []
    for m in members:
        if m.shape[0] < rows:
            pad = torch.zeros((rows - m.shape[0], *m.shape[1:]), dtype=m.dtype)
            m = torch.cat([m, pad])
        out.append(m)
    return out


def encode_requests(buffers: Sequence[np.ndarray], members: Sequence[Sequence[InferenceRequest]], name: str) -> int:
    """A parity batch's inputs: each member's rows (its requests' inputs, in turn) encoded with `name`
    straight into the first rows of `buffers` (one per input); returns how many rows that is."""
    enc = encoder(name)
    rows = max((sum(r.samples for r in m) for m in members), default=0)
    for i, buf in enumerate(buffers):
        # np.concatenate copies even one request's input: inputs may be read-only views of the wire
        # buffer, which torch.from_numpy refuses (a warning, an error under the tests' filters)
        parts = [torch.from_numpy(np.concatenate([r.inputs[i] for r in m]) if m else
                                  np.zeros((0, *buf.shape[1:]), dtype=buf.dtype)) for m in members]
        enc(stack_members(parts, rows), out=torch.from_numpy(buf[:rows]))  # straight into the buffer
    return rows


def decode_member(parity_out: Sequence[np.ndarray], others: Sequence[Sequence[np.ndarray]],
                  rows: int) -> tuple[tuple[np.ndarray, ...], float]:
    """A lost member's outputs from its group's parity outputs and the k-1 other members' outputs
    (one array per output each), cut to its `rows`; and the seconds the decode took."""
    t0 = time.perf_counter()  # a measurement for telemetry, not an input to any decision
    outs = []
    for i, p in enumerate(parity_out):
        rest = [torch.from_numpy(_rows(o[i], p.shape[0])) for o in others]
        outs.append(decode(torch.from_numpy(p), rest).numpy()[:rows])
    return tuple(outs), time.perf_counter() - t0


def _rows(a: np.ndarray, rows: int) -> np.ndarray:
    """`a` padded with zero rows to `rows` rows (members may fill fewer rows than the parity has)."""
    if a.shape[0] >= rows:
        return a[:rows]
    pad = np.zeros((rows - a.shape[0], *a.shape[1:]), dtype=a.dtype)
    return np.concatenate([a, pad])
