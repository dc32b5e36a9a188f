"""Parity codes: exact round trips where the model is linear, and the concat layout."""

from __future__ import annotations

import pytest
import torch

from daemon.coding import codes


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
