"""Training a parity model for a repository model (ParM's recipe).

- Architecture: the deployed program's own (its lifted torch.export graph), with fresh weights:
  Linear and Conv weights Xavier-uniform with ReLU gain (ParM draws Linear weights from
  N(0, 0.01), which left a 3-layer MLP at 27% after 60 epochs), biases 0, normalisation scale
  1 and shift 0, running statistics reset.
- Samples: the deployed model's outputs (logits) on the whole training set are computed once;
  each epoch the training set is shuffled and every k consecutive samples form a coding group
  (groups are re-drawn every epoch). The parity model sees encode(group) and learns the sum of
  the group's logits with MSE; Adam, learning rate 1e-3, weight decay 1e-5; 64 groups per step
  at k = 2, else 32.
- Evaluation on held-out data, fixed groups, every member erased in turn: reconstruction
  accuracy (argmax of the decoded output equals the deployed model's argmax) and degraded-mode
  accuracy (equals the true label), next to the deployed model's own (available) accuracy.
- The checkpoint with the best held-out reconstruction accuracy is kept and exported with a
  dynamic batch dimension, like the deployed model.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.export.graph_signature import InputKind

from daemon.coding import codes
from daemon.repository import ModelSpec

log = logging.getLogger("escapement.coding")


@dataclass
class Dataset:
    x_train: np.ndarray
    x_test: np.ndarray
    y_train: np.ndarray | None = None
    y_test: np.ndarray | None = None


@dataclass
class TrainReport:
    model: str
    k: int
    encoder: str
    epochs: int
    best_epoch: int
    available_accuracy: float | None
    reconstruction_accuracy: float
    degraded_accuracy: float | None
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "history"}


def load_dataset(spec: ModelSpec, data: str | Path | None, seed: int = 0) -> Dataset:
    """The demo digits (data=None) or an npz file: `x` [+ `y`] split 80/20, or `x_train`/`x_test`."""
    shape = spec.inputs[0].sample_shape
    if data is None:
        from daemon.demo import digits_split

        xtr, ytr, xte, yte = digits_split()
        if int(np.prod(shape)) != xtr.shape[1]:
            raise ValueError(f"{spec.name} takes {list(shape)} per sample; the digits are 64 values: pass --data")
        return Dataset(xtr.reshape(-1, *shape), xte.reshape(-1, *shape), ytr, yte)
    z = np.load(data)
    if "x_train" in z:
        d = Dataset(z["x_train"], z["x_test"], z.get("y_train"), z.get("y_test"))
    else:
        x = z["x"]
        y = z.get("y")
        order = np.random.default_rng(seed).permutation(len(x))
        cut = int(0.8 * len(x))
        tr, te = order[:cut], order[cut:]
        d = Dataset(x[tr], x[te], y[tr] if y is not None else None, y[te] if y is not None else None)
    for name in ("x_train", "x_test"):
        arr = getattr(d, name)
        if tuple(arr.shape[1:]) != tuple(shape):
            raise ValueError(f"{data}: {name} has samples of shape {list(arr.shape[1:])}, "
                             f"{spec.name} takes {list(shape)}")
    return d


class _Lifted(torch.nn.Module):
    """The deployed program's lifted graph with trainable weights of its own."""

    def __init__(self, ep: torch.export.ExportedProgram) -> None:
        super().__init__()
        self.gm = ep.graph_module
        self.names: list[str] = []
        self.weights = torch.nn.ParameterList()
        self.plan: list[int] = []
        n_inputs = 0
        for s in ep.graph_signature.input_specs:
            if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                assert s.target is not None
                t = ep.state_dict.get(s.target)
                if t is None:
                    t = ep.constants[s.target]
                p = torch.nn.Parameter(t.detach().clone().float() if t.is_floating_point() else t.detach().clone(),
                                       requires_grad=s.kind == InputKind.PARAMETER and t.is_floating_point())
                self.plan.append(len(self.names))
                self.names.append(s.target)
                self.weights.append(p)
            else:
                self.plan.append(-(n_inputs + 1))
                n_inputs += 1
        self.reset()

    def reset(self) -> None:
        """Fresh weights, as ParM initialises parity models."""
        with torch.no_grad():
            for name, p in zip(self.names, self.weights, strict=True):
                leaf = name.rsplit(".", 1)[-1]
                if not p.is_floating_point():
                    continue
                if leaf == "running_mean" or (leaf == "bias"):
                    p.zero_()
                elif leaf == "running_var" or p.dim() == 1:
                    p.fill_(1.0)
                else:  # Linear and Conv weights (N(0, 0.01) left 3-layer MLPs barely learning)
                    torch.nn.init.xavier_uniform_(p, gain=torch.nn.init.calculate_gain("relu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = [self.weights[i] if i >= 0 else x for i in self.plan]
        out = self.gm(*args)
        return out[0] if isinstance(out, tuple | list) else out

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in zip(self.names, self.weights, strict=True)}


def _logits(program_runner: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]], x: np.ndarray,
            batch: int) -> torch.Tensor:
    outs = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            outs.append(program_runner([torch.from_numpy(np.ascontiguousarray(x[i : i + batch]))])[0].float())
    return torch.cat(outs)


def evaluate(parity: torch.nn.Module, enc: Callable[[list[torch.Tensor]], torch.Tensor], k: int, x: torch.Tensor,
             logits: torch.Tensor, y: torch.Tensor | None, seed: int = 1) -> tuple[float, float | None]:
    """(reconstruction accuracy, degraded-mode accuracy) over fixed groups, each member erased in turn."""
    n = (len(x) // k) * k
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(x))[:n]).view(-1, k)
    with torch.no_grad():
        p_out = parity(enc([x[order[:, i]] for i in range(k)])).float()
    recon_hits = degraded_hits = total = 0
    for m in range(k):
        others = [logits[order[:, i]] for i in range(k) if i != m]
        decoded = codes.decode(p_out, others)
        pred = decoded.argmax(1)
        recon_hits += int((pred == logits[order[:, m]].argmax(1)).sum())
        if y is not None:
            degraded_hits += int((pred == y[order[:, m]]).sum())
        total += len(order)
    return recon_hits / total, (degraded_hits / total if y is not None else None)


def train(spec: ModelSpec, runner: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]], data: Dataset, k: int,
          encoder_name: str = "sum", epochs: int = 100, seed: int = 0,
          progress: Callable[[dict[str, float]], None] | None = None) -> tuple[torch.nn.Module, TrainReport]:
    """Train a parity model; returns the best module (for `export`) and the report."""
    if len(spec.inputs) != 1 or len(spec.outputs) != 1:
        raise ValueError(f"{spec.key}: parity models need one input and one output (logits)")
    codes.check(encoder_name, k, spec.inputs[0].sample_shape)
    enc = codes.encoder(encoder_name)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    ep = torch.export.load(str(spec.path))
    parity = _Lifted(ep)
    xtr = torch.from_numpy(np.ascontiguousarray(data.x_train)).float()
    xte = torch.from_numpy(np.ascontiguousarray(data.x_test)).float()
    ltr = _logits(runner, data.x_train.astype(np.float32), spec.max_batch_size)
    lte = _logits(runner, data.x_test.astype(np.float32), spec.max_batch_size)
    yte = torch.from_numpy(data.y_test) if data.y_test is not None else None
    available = float((lte.argmax(1) == yte).float().mean()) if yte is not None else None
    groups_per_step = 64 if k == 2 else 32
    opt = torch.optim.Adam([p for p in parity.weights if p.requires_grad], lr=1e-3, weight_decay=1e-5)
    loss_fn = torch.nn.MSELoss()
    gen = torch.Generator().manual_seed(seed)
    best: tuple[float, int, dict[str, torch.Tensor], float | None] = (-1.0, 0, parity.state(), None)
    history = []
    n_groups = len(xtr) // k
    for epoch in range(1, epochs + 1):
        parity.train()
        perm = torch.randperm(len(xtr), generator=gen)[: n_groups * k].view(-1, k)  # groups re-drawn each epoch
        total = 0.0
        for i in range(0, n_groups, groups_per_step):
            g = perm[i : i + groups_per_step]
            p_in = enc([xtr[g[:, j]] for j in range(k)])
            target = ltr[g].sum(1)
            opt.zero_grad()
            loss = loss_fn(parity(p_in), target)
            loss.backward()
            opt.step()
            total += loss.item() * len(g)
        parity.eval()
        recon, degraded = evaluate(parity, enc, k, xte, lte, yte)
        row = {"epoch": epoch, "loss": total / max(n_groups, 1), "reconstruction_accuracy": recon}
        if degraded is not None:
            row["degraded_accuracy"] = degraded
        history.append(row)
        if progress is not None:
            progress(row)
        if recon > best[0]:
            best = (recon, epoch, parity.state(), degraded)
    recon, best_epoch, state, degraded = best
    with torch.no_grad():
        for n, p in zip(parity.names, parity.weights, strict=True):
            p.copy_(state[n])
    report = TrainReport(spec.name, k, encoder_name, epochs, best_epoch, available, recon, degraded,
                         time.perf_counter() - t0, history)
    return parity, report


def export(parity: torch.nn.Module, spec: ModelSpec, path: Path) -> None:
    """Write the parity model as a torch.export program with a dynamic batch dimension."""
    assert isinstance(parity, _Lifted)
    ep = torch.export.load(str(spec.path))
    module = ep.module()
    state = parity.state()
    with torch.no_grad():
        for name, value in state.items():
            owner, _, leaf = name.rpartition(".")
            target = module.get_submodule(owner) if owner else module
            getattr(target, leaf).copy_(value.to(getattr(target, leaf).dtype))
    example = torch.zeros((min(2, spec.max_batch_size) if spec.max_batch_size > 1 else 2, *spec.inputs[0].sample_shape),
                          dtype=spec.inputs[0].datatype.torch)
    batch = torch.export.Dim("batch", min=1, max=max(spec.max_batch_size, 2))
    new = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    torch.export.save(new, str(tmp))
    tmp.replace(path)


def parity_section(k: int, encoder_name: str, file: str, report: TrainReport) -> str:
    lines = ["[parity]", f"k = {k}", f'encoder = "{encoder_name}"', f'file = "{file}"', "",
             "[parity.accuracy]"]
    for key in ("available_accuracy", "reconstruction_accuracy", "degraded_accuracy"):
        v = getattr(report, key)
        if v is not None:
            lines.append(f"{key.removesuffix('_accuracy')} = {v:.4f}")
    lines.append(f"best_epoch = {report.best_epoch}")
    return "\n".join(lines) + "\n"


def set_parity_section(config: Path, section: str) -> None:
    """Replace any [parity] / [parity.*] tables of a config.toml with `section` (at the end)."""
    kept: list[str] = []
    skipping = False
    for line in config.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            skipping = stripped.startswith("[parity]") or stripped.startswith("[parity.")
        if not skipping:
            kept.append(line)
    while kept and not kept[-1].strip():
        kept.pop()
    config.write_text("\n".join(kept) + "\n\n" + section, encoding="utf-8")
