"""Parity codes: exact round trips where the model is linear, and the concat layout."""

from __future__ import annotations

import pytest
import torch

from daemon.parity import codes


def test_sum_code_decodes_exactly_for_a_linear_model() -> None:
    torch.manual_seed(0)
    f = torch.nn.Linear(6, 3, bias=False)  # linear: f(sum x) = sum f(x), so the parity model is f
    xs = [torch.randn(5, 6) for _ in range(3)]
    parity_out = f(codes.encode_sum(xs))
    outs = [f(x) for x in xs]
    for m in range(3):
        rebuilt = codes.decode(parity_out, [o for i, o in enumerate(outs) if i != m])
        torch.testing.assert_close(rebuilt, outs[m], rtol=1e-5, atol=1e-5)


def test_members_with_fewer_rows_count_as_zeros() -> None:
    a, b = torch.ones(3, 2), torch.full((1, 2), 2.0)
    p = codes.encode_sum(codes.stack_members([a, b], 3))
    assert p.tolist() == [[3, 3], [1, 1], [1, 1]]


def test_concat_k2_and_k4_keep_channels_apart() -> None:
    imgs = [torch.full((1, 3, 4, 4), float(i + 1)) for i in range(4)]
    for img in imgs:
        img[:, 1] *= 10  # channel 1 is 10x channel 0, channel 2 is 100x
        img[:, 2] *= 100
    p2 = codes.encode_concat(imgs[:2])
    assert p2.shape == (1, 3, 4, 4)
    assert p2[0, 0, :, :2].unique().tolist() == [1.0] and p2[0, 0, :, 2:].unique().tolist() == [2.0]
    assert p2[0, 2, :, 2:].unique().tolist() == [200.0]  # channel 2 of member 2, not a mix
    p4 = codes.encode_concat(imgs)
    assert p4.shape == (1, 3, 4, 4)
    assert p4[0, 1, :2, :2].unique().tolist() == [10.0] and p4[0, 1, 2:, 2:].unique().tolist() == [40.0]


def test_concat_averages_when_it_downsamples() -> None:
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    p = codes.encode_concat([x, torch.zeros_like(x)])
    assert p[0, 0, 0, :2].tolist() == [0.5, 2.5]


@pytest.mark.parametrize(("name", "k", "shape", "needle"), [
    ("concat", 3, (1, 8, 8), "k = 2 or 4"),
    ("concat", 2, (64,), "[C, H, W]"),
    ("concat", 2, (1, 7, 8), "even H and W"),
    ("xor", 2, (64,), "unknown encoder"),
    ("sum", 1, (64,), "2 to 8"),
])
def test_bad_codes_are_refused(name: str, k: int, shape: tuple[int, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        codes.check(name, k, shape)


def _concat_reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """ParM's image encoder spelled the slow, obvious way: area-average, then tile."""
    import torch.nn.functional as F

    if len(xs) == 2:
        return torch.cat([F.avg_pool2d(x, kernel_size=(1, 2)) for x in xs], dim=3)
    small = [F.avg_pool2d(x, kernel_size=2) for x in xs]
    return torch.cat([torch.cat(small[:2], dim=3), torch.cat(small[2:], dim=3)], dim=2)


@pytest.mark.parametrize("k", [2, 4])
def test_concat_matches_average_pooling_and_tiling(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    xs = [torch.randn(3, 2, 6, 10, generator=gen) for _ in range(k)]  # not square: rows and columns differ
    torch.testing.assert_close(codes.encode_concat(xs), _concat_reference(xs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("k", "shape", "expected"), [
    (2, (1, 8, 8), "concat"),
    (4, (3, 32, 32), "concat"),
    (3, (1, 8, 8), "sum"),  # concat tiles 2 or 4 images only
    (4, (64,), "sum"),  # not an image
    (4, (1, 7, 8), "sum"),  # odd height
])
def test_the_default_code_is_concat_where_it_applies(k: int, shape: tuple[int, ...], expected: str) -> None:
    assert codes.default_encoder(k, shape) == expected


@pytest.mark.parametrize("name", ["sum", "concat"])
def test_the_served_parity_batch_is_the_training_encoding(name: str) -> None:
    """IOBuffers.fill_coded (the executor's path) gives exactly what training encoded, rows a member
    lacks as zeros, and clears rows a previous, larger batch left behind."""
    import numpy as np

    from daemon.request import InferenceRequest
    from daemon.runtime.backend import IOBuffers
    from daemon.sim import sim_spec

    rng = np.random.default_rng(0)
    spec = sim_spec("m")
    buf = IOBuffers(8, [np.full((8, 1, 4, 4), 7.0, np.float32)], [])
    buf.filled = 8  # a previous batch filled every row

    def req(n: int) -> InferenceRequest:
        x = rng.standard_normal((n, 1, 4, 4), dtype=np.float32)
        x.setflags(write=False)  # as a frontend's view of its receive buffer
        return InferenceRequest(spec, (x,), n, 0.0, 1.0)

    members = [[req(2), req(1)], [req(3)], [req(1)], [req(2)]]  # 3, 3, 1 and 2 rows
    rows = buf.fill_coded(members, name)
    parts = [torch.from_numpy(np.concatenate([r.inputs[0] for r in m])) for m in members]
    expected = codes.encoder(name)(codes.stack_members(parts, 3))
    assert rows == 3
    torch.testing.assert_close(torch.from_numpy(buf.host[0][:3]), expected)
    assert not buf.host[0][3:].any()
