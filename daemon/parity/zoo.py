"""A zoo of deployed models the parity trainer was not tuned on, trained on the bundled digits.

Used by the parity benchmark (`python -m bench run parity`, summary `accuracy`) and the
parity-training tests to check that `train-parity`'s defaults hold beyond the demo models:

- `zoo_mlp`: MLP 64-128-128-10 with LayerNorm and dropout.
- `zoo_rescnn`: CNN with BatchNorm and two residual blocks (one strided), global average pool.
- `zoo_transformer`: a 2-layer pre-norm transformer encoder over the 8 rows of a digit image
  (8 tokens of 8 pixels), learned position embeddings, dropout, mean pooling.

Each is trained on the digits' training split (`datasets.digits_split`, seed 0) and written like
a demo model (`model.pt2` with a dynamic batch dimension and a `config.toml`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from daemon import demo
from daemon.parity.datasets import digits_split

SEED = 0


class ZooMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(128, 128), nn.LayerNorm(128), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 16.0)


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.skip(x))


class ZooResCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.Sequential(_Residual(16, 16, 1), _Residual(16, 32, 2))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x / 16.0))
        return self.head(h.mean(dim=(2, 3)))


class _EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.ff(self.ln2(x)))


class ZooTransformer(nn.Module):
    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(1, 8, d))
        self.layers = nn.Sequential(*[_EncoderLayer(d, 4, 2 * d, 0.1) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], 8, 8) / 16.0  # [B, 1, 8, 8] -> 8 tokens of 8 pixels
        h = self.layers(self.embed(rows) + self.pos)
        return self.head(self.norm(h).mean(dim=1))


# name -> (constructor, input shape per sample, epochs, learning rate, description)
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int, float, str]] = {
    "zoo_mlp": (ZooMLP, (64,), 60, 1e-3, "MLP 64-128-128-10 with LayerNorm and dropout, trained on digits"),
    "zoo_rescnn": (ZooResCNN, (1, 8, 8), 30, 2e-3, "CNN with BatchNorm and residual blocks, trained on digits"),
    "zoo_transformer": (ZooTransformer, (1, 8, 8), 80, 2e-3,
                        "transformer encoder over the rows of a digit image, trained on digits"),
}


def build(out: str | Path, names: list[str] | None = None, epochs: int | None = None) -> dict[str, dict[str, object]]:
    """Train and write the zoo models under `out` (a model repository); returns their metadata.

    `epochs` overrides each model's training epochs (tests use 1: a fast, barely trained model)."""
    out = Path(out)
    xtr, ytr, xte, yte = digits_split()
    built: dict[str, dict[str, object]] = {}
    for name in names or list(ZOO):
        ctor, shape, default_epochs, lr, description = ZOO[name]
        t0 = time.perf_counter()
        torch.manual_seed(SEED)
        model = ctor()
        xt, yt = torch.from_numpy(xtr).reshape(-1, *shape), torch.from_numpy(ytr)
        xv, yv = torch.from_numpy(xte).reshape(-1, *shape), torch.from_numpy(yte)
        demo._train(model, xt, yt, epochs=default_epochs if epochs is None else epochs, batch=64, lr=lr)
        acc = demo._accuracy(model.eval(), xv, yv)
        m = demo.DemoModel(name, "pt2", lambda: (nn.Identity(), {}), shape, 10, 32, 100.0, description)
        meta: dict[str, object] = {"dataset": "scikit-learn digits (8x8, pixels 0..16), 80/20 split, seed 0",
                                   "test_accuracy": round(acc, 4), "test_samples": len(yte),
                                   "train_seconds": round(time.perf_counter() - t0, 1)}
        demo.save_model(model, "pt2", torch.zeros((2, *shape)), m.max_batch_size, out / name / "1" / "model.pt2")
        (out / name / "config.toml").write_text(demo.config_text(m, meta), encoding="utf-8")
        built[name] = meta
    return built

