"""A family of fine-tuned variants for `escapement demo`: one backbone, many heads.

The backbone (an MLP 64-512-256 on scikit-learn's 8x8 digits) is trained once on digit
identity; each variant is the same backbone, frozen, with its own linear head trained for a
task: digit identity, parity, >= 5, and label maps (each digit mapped onto a few classes, as a
customer's own categories would). Every variant is a complete model file of its own, as a
user would export it: the daemon finds the backbone they share by content (runtime/objstore.py)
and keeps it once in host memory and on each device.

The same family is also written as plans of stages (`<out>-staged`): one backbone program in
`.stages/backbone.pt2` and, per variant, its head as `head.pt2` with `stages = [backbone, head]`
in its config. The daemon serves both forms with the backbone run once for several variants
(cross-model batching): the staged form as declared, the monolithic one split where the
variants begin alike, found at load (runtime/shared_prefix.py, `runtime.detect_shared_prefix`).

Deterministic (fixed seeds and split); idempotent (a variant already built is left alone).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from daemon.demo import SEED, DemoModel, config_text, save_model
from daemon.parity.datasets import digits_split

log = logging.getLogger("escapement.demo")

HIDDEN = (512, 256)
DEFAULT_VARIANTS = 4


@dataclass(frozen=True)
class Task:
    name: str
    labels: tuple[int, ...]  # the class of each digit 0..9
    description: str

    @property
    def classes(self) -> int:
        return max(self.labels) + 1


def tasks(n: int) -> list[Task]:
    """The first `n` tasks: identity, parity, >= 5, then seeded label maps onto 2..6 classes."""
    fixed = [
        Task("identity", tuple(range(10)), "digit identity (10 classes)"),
        Task("parity", tuple(d % 2 for d in range(10)), "parity of the digit (even 0, odd 1)"),
        Task("ge5", tuple(int(d >= 5) for d in range(10)), "digit >= 5"),
    ]
    out = fixed[:n]
    for i in range(len(out), n):
        rng = np.random.default_rng(SEED + i)
        k = int(rng.integers(2, 7))
        labels = tuple(int(c) for c in rng.permutation(10) % k)  # every class gets at least one digit
        out.append(Task(f"map{i:03d}", labels, f"label map {i} onto {k} classes"))
    return out


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        a, b = HIDDEN
        self.net = nn.Sequential(nn.Linear(64, a), nn.ReLU(), nn.Linear(a, b), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 16.0)  # digits pixels are 0..16


class Variant(nn.Module):
    def __init__(self, backbone: Backbone, head: nn.Linear) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _train(params: list[nn.Parameter], loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], epochs: int,
           x: torch.Tensor, y: torch.Tensor, batch: int, lr: float) -> None:
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            loss_of(x[idx], y[idx]).backward()
            opt.step()


def train_family(n: int, backbone_epochs: int = 8, ridge: float = 1.0) -> list[tuple[Task, Variant, float]]:
    """The backbone trained on digit identity, then `n` heads fitted on it frozen: (task, model,
    held-out accuracy). Each head is a ridge-regression fit of its one-hot labels on the backbone's
    features: one linear solve serves every head (200 heads in well under a second), where SGD per
    head cost ~0.3 s each."""
    xtr, ytr, xte, yte = digits_split()
    xt, yt, xv, yv = map(torch.from_numpy, (xtr, ytr, xte, yte))
    torch.manual_seed(SEED)
    backbone = Backbone()
    pretrain = nn.Linear(HIDDEN[-1], 10)
    loss = nn.CrossEntropyLoss()
    _train([*backbone.parameters(), *pretrain.parameters()], lambda x, y: loss(pretrain(backbone(x)), y),
           backbone_epochs, xt, yt, 256, 3e-3)
    backbone.eval().requires_grad_(False)
    family_tasks = tasks(n)
    with torch.no_grad():
        ft = torch.cat([backbone(xt), torch.ones(len(xt), 1)], 1).double()  # a bias column
        fv = backbone(xv)
        targets = torch.cat([nn.functional.one_hot(torch.tensor(t.labels)[yt], t.classes) for t in family_tasks],
                            1).double() if family_tasks else torch.zeros(len(xt), 0, dtype=torch.float64)
        gram = ft.T @ ft + ridge * torch.eye(ft.shape[1], dtype=torch.float64)
        solved = torch.linalg.solve(gram, ft.T @ targets).float()  # (features + 1, all heads' classes)
    family = []
    col = 0
    for task in family_tasks:
        head = nn.Linear(HIDDEN[-1], task.classes)
        with torch.no_grad():
            head.weight.copy_(solved[:-1, col : col + task.classes].T)
            head.bias.copy_(solved[-1, col : col + task.classes])
            acc = float((head(fv).argmax(1) == torch.tensor(task.labels)[yv]).float().mean())
        col += task.classes
        family.append((task, Variant(backbone, head.eval().requires_grad_(False)).eval(), acc))
    return family


def default_out(demo_out: str | Path) -> Path:
    """Where `escapement demo` puts the variants: a repository of their own beside the demo's
    (`models-variants` for `models`), so a daemon serving the demo models is not changed."""
    p = Path(demo_out)
    return p.with_name(f"{p.name}-variants")


def model_name(task: Task) -> str:
    return f"digits_head_{task.name}"


STAGES_DIR = ".stages"  # the staged repository's shared stage files (a dot: the scan skips it)
BACKBONE_FILE = "backbone.pt2"
HEAD_FILE = "head.pt2"


def staged_out(out: str | Path) -> Path:
    """Where the staged form of the variants in `out` goes."""
    p = Path(out)
    return p.with_name(f"{p.name}-staged")


def build(out: str | Path, n: int = DEFAULT_VARIANTS, force: bool = False, staged: Path | None = None) -> list[str]:
    """Write `n` variants as a model repository under `out`, and their staged form under `staged`
    (default: `staged_out(out)`); returns the names built."""
    out = Path(out)
    staged = staged or staged_out(out)

    def missing(t: Task) -> bool:
        return force or not all(p.exists() for p in (
            out / model_name(t) / "1" / "model.pt2", out / model_name(t) / "config.toml",
            staged / model_name(t) / "1" / HEAD_FILE, staged / model_name(t) / "config.toml",
            staged / STAGES_DIR / BACKBONE_FILE))
    todo = [t for t in tasks(n) if missing(t)]
    if not todo:
        log.info("%d variants: already built in %s", n, out)
        return []
    t0 = time.perf_counter()
    family = {t.name: (m, acc) for t, m, acc in train_family(n)}
    built = []
    for task in todo:
        model, acc = family[task.name]
        name = model_name(task)
        spec = DemoModel(name, "pt2", functools.partial(_built, model), (64,), task.classes, 32, 100.0,
                         f"variant of the digits backbone (64-512-256, frozen) with a head for {task.description}")
        save_model(model, "pt2", torch.zeros((2, 64)), spec.max_batch_size, out / name / "1" / "model.pt2")
        meta: dict[str, object] = {
            "dataset": "scikit-learn digits (8x8, pixels 0..16), 80/20 split, seed 0",
            "test_accuracy": round(acc, 4), "task": task.name, "labels": list(task.labels),
            "backbone": "digits 64-512-256, trained on digit identity, frozen for every head"}
        (out / name / "config.toml").write_text(config_text(spec, meta), encoding="utf-8")
        _write_staged(staged, spec, model, meta)
        built.append(name)
    log.info("%d variants built in %s in %.1f s (%s)", len(built), out, time.perf_counter() - t0,
             ", ".join(f"{model_name(t)} {family[t.name][1]:.3f}" for t in todo[:4])
             + (" ..." if len(todo) > 4 else ""))
    return built


def _write_staged(root: Path, spec: DemoModel, model: Variant, meta: dict[str, object]) -> None:
    """One variant as a plan of two stages: the shared backbone program, then its own head."""
    backbone = root / STAGES_DIR / BACKBONE_FILE
    if not backbone.exists():  # every variant's backbone is the same module: written once
        save_model(model.backbone, "pt2", torch.zeros((2, 64)), spec.max_batch_size, backbone)
    save_model(model.head, "pt2", torch.zeros((2, HIDDEN[-1])), spec.max_batch_size,
               root / spec.name / "1" / HEAD_FILE)
    text = config_text(spec, meta).replace(
        "\nmax_batch_size", f'\nstages = ["../../{STAGES_DIR}/{BACKBONE_FILE}", "{HEAD_FILE}"]\nmax_batch_size', 1)
    (root / spec.name / "config.toml").write_text(text, encoding="utf-8")


def _built(model: nn.Module) -> tuple[nn.Module, dict[str, object]]:
    """A DemoModel's build step for a variant already trained: the model, no extra metadata."""
    return model, {}
