"""Models that exercise what the CUDA path must handle (built on the CPU, with the local torch)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from daemon.demo import save_model


class Converts(nn.Module):
    """Converts dtypes and builds tensors in forward: exported with CPU devices baked in."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        with torch.no_grad():
            self.fc.weight.copy_(torch.linspace(-1, 1, 12).reshape(3, 4))
            self.fc.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        return self.fc(x + pos) + torch.zeros(x.shape[0], 1) + torch.full((1, 3), 0.5)


class Branchy(nn.Module):
    """A branch on data: needs a host sync, which CUDA graph capture forbids (TorchScript)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):
            return x * 2
        return x - 1


class Wide(nn.Module):
    """A few MiB of weights: LOADs of several chunks."""

    def __init__(self, width: int = 1024, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = nn.Linear(16, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


class TwoInputs(nn.Module):
    """Two inputs of 1,000 floats: at a batch size below the largest, the second input's place in
    the staging buffer differs from its place at the largest (rows of 4,000 bytes)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.a = nn.Linear(1000, 4)
        self.b = nn.Linear(1000, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.a(x) - 2 * self.b(y)


def save_two_inputs(path: Path, max_batch: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    ep = torch.export.export(TwoInputs().eval(), (torch.zeros(2, 1000), torch.zeros(2, 1000)),
                             dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(ep, str(path))
    (path.parent.parent / "config.toml").write_text(f"""max_batch_size = {max_batch}
slo_ms = 1000
[[inputs]]
name = "X"
datatype = "FP32"
shape = [-1, 1000]
[[inputs]]
name = "Y"
datatype = "FP32"
shape = [-1, 1000]
[[outputs]]
name = "OUTPUT__0"
datatype = "FP32"
shape = [-1, 4]
""")


def config(inp: int, out: int, in_type: str = "FP32", max_batch: int = 8) -> str:
    return f"""max_batch_size = {max_batch}
slo_ms = 1000
[[inputs]]
name = "INPUT__0"
datatype = "{in_type}"
shape = [-1, {inp}]
[[outputs]]
name = "OUTPUT__0"
datatype = "FP32"
shape = [-1, {out}]
"""


def build_device_repo(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    half = torch.zeros(2, 4, dtype=torch.float16)
    save_model(Converts().eval(), "pt2", half, 8, root / "converts" / "1" / "model.pt2")
    (root / "converts" / "config.toml").write_text(config(4, 3, "FP16"))
    save_model(Branchy().eval(), "ts", torch.zeros(2, 3), 8, root / "branchy" / "1" / "model.ts")
    (root / "branchy" / "config.toml").write_text(config(3, 3))
    save_model(Wide().eval(), "pt2", torch.zeros(2, 16), 8, root / "wide" / "1" / "model.pt2")
    (root / "wide" / "config.toml").write_text(config(16, 4))
    # the same structure over other weights: LOADs that may replay wide's parked graphs
    save_model(Wide(seed=1).eval(), "pt2", torch.zeros(2, 16), 8, root / "wide_other" / "1" / "model.pt2")
    (root / "wide_other" / "config.toml").write_text(config(16, 4))
    save_two_inputs(root / "two_inputs" / "1" / "model.pt2")
    return root
