"""Training a parity model for a repository model (ParM's recipe, with defaults that converge).

- Architecture: the deployed program's own (its lifted torch.export graph). Weights start from
  the deployed model's (`init="deployed"`, the default: measured to converge faster) or fresh
  (`"fresh"`, ParM's way): Linear and Conv weights Xavier-uniform with ReLU gain (ParM draws
  Linear weights from N(0, 0.01), which left a 3-layer MLP at 27% after 60 epochs), biases 0,
  normalisation scale 1 and shift 0, running statistics reset.
- Training mode: the exported graph is the deployed model's eval-mode graph, so the trainer
  keeps a second copy with BatchNorm in training mode (batch statistics of *parity* inputs,
  sums of k inputs, whose statistics differ from single inputs); the eval copy uses the
  running statistics. Before each validation (and so in the exported checkpoint) the running
  statistics are recalibrated exactly on 1,024 parity inputs (`norm="recalibrate"`, the
  default; `"batch"` keeps the momentum averages; `"frozen"` is the old eval-mode graph whose
  BatchNorm is a plain affine layer). Dropout stays off unless `dropout=True` (the parity model
  regresses logits; dropout's noise slowed the zoo MLP). LayerNorm, residuals and attention
  need nothing special.
- Samples: the deployed model's outputs (logits) are computed once; every step draws fresh
  coding groups of k training samples. The parity model sees encode(group) and learns the sum
  of the group's logits with MSE (or, `loss="decode"`, a KL loss on each member's decoded
  softmax); Adam (lr 1e-3, weight decay 1e-5, short warm-up, gradient
  norm clipped at 5); 64 groups per step at k = 2, else 32.
- Convergence: validation every epoch (at least every 25 steps). When the validation loss
  has not improved for `patience` validations (10·k by default) the learning rate is divided by 4;
  after `max_lr_drops` drops without improvement training stops. A step budget scaled to the data
  set and to k (`max_epochs` epochs, 500·k by default) and a wall-clock limit (`time_limit_s`)
  bound it.
- Honest evaluation: `val_fraction` of the training data (seeded) is held out for validation,
  which chooses the checkpoint (best validation reconstruction accuracy, ties to the lower
  loss). The test split is used once, after training, for the reported available,
  reconstruction (argmax of the decoded output equals the deployed model's) and degraded-mode
  (equals the true label) accuracies, every member of each group erased in turn.
- The chosen checkpoint is exported with a dynamic batch dimension, like the deployed model
  (daemon/parity/lifted.py: the trainable copy of the graph, and its export).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from daemon.model import ModelSpec
from daemon.parity import codes
from daemon.parity.datasets import Dataset
from daemon.parity.lifted import Lifted, NormMode
from daemon.signature import read_exported_file

log = logging.getLogger("escapement.parity")

LossMode = Literal["mse", "decode"]
FREQUENCIES = (0.01, 0.05, 0.10)  # unavailability rates reported in production terms


@dataclass(frozen=True)
class TrainConfig:
    """How a parity model is trained; the defaults are meant to work on untuned architectures."""

    max_epochs: int | None = None
    """Upper bound on training, in epochs of coding groups (None: scaled to the data set, see `step_budget`)."""
    time_limit_s: float = 240.0
    """Wall-clock limit for the training loop; the best checkpoint so far is kept."""
    lr: float = 1e-3
    """Adam's initial learning rate."""
    weight_decay: float = 1e-5
    """Adam's weight decay."""
    patience: int | None = None
    """Validations without improvement of the validation loss before the learning rate drops; None:
    10·k (20 at k = 2). 8 stopped the zoo CNN at k = 4 at 0.754 test reconstruction accuracy in 13 s,
    20 reached 0.772 in 79 s; larger k learns more slowly: the zoo MLP at k = 4 stopped at a 13.3
    point degraded drop with 20 and reached 11.5 with 40."""
    max_lr_drops: int = 3
    """Learning-rate drops (each /4) after which a further plateau stops training."""
    val_fraction: float = 0.2
    """Share of the training data held out to choose the checkpoint (seeded)."""
    norm: NormMode = "recalibrate"
    """BatchNorm: train on parity-batch statistics, then `recalibrate` running stats exactly, or `batch`
    (momentum averages only) or `frozen` (eval-mode graph, BatchNorm as an affine layer)."""
    dropout: bool = False
    """Run the model's dropout while training (off: the parity model regresses logits, and dropout's
    noise slowed the zoo MLP's convergence)."""
    init: Literal["fresh", "deployed"] = "deployed"
    """Start from the deployed model's weights (measured: the zoo CNN at k = 2 reached a validation
    reconstruction accuracy of 0.94 in 500 steps, against 0.88 from fresh ones) or from fresh
    weights, as ParM does."""
    loss: LossMode = "mse"
    """`mse`: ParM's, the parity output against the sum of the group's logits. `decode`: the
    reconstruction each member would get (parity output minus the other members' logits) against
    that member's softmax, by KL divergence, so only errors that change decoded probabilities
    count. Measured at k = 4 (one seed, patience 20): transformer/concat 12.0 -> 10.1 points of degraded drop,
    MLP/sum 13.3 -> 13.3, and with cross-entropy on the argmax instead residual CNN/concat
    7.2 -> 8.1: not a consistent gain, so not the default."""
    seed: int = 0
    """Seeds the validation split, the weights and the groups: a run is repeatable."""

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 0.9:
            raise ValueError(f"val_fraction = {self.val_fraction}: use a share between 0 and 0.9, e.g. 0.2")
        if self.time_limit_s <= 0 or self.lr <= 0 or (self.patience is not None and self.patience < 1):
            raise ValueError(f"time_limit_s ({self.time_limit_s}), lr ({self.lr}) and patience ({self.patience}) "
                             "must be positive")
        if self.max_epochs is not None and self.max_epochs < 1:
            raise ValueError(f"max_epochs = {self.max_epochs}: at least 1 (or None for the data-scaled budget)")


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
    steps: int = 0
    best_step: int = 0
    stopped: str = ""
    val_reconstruction_accuracy: float = 0.0
    val_degraded_accuracy: float | None = None
    config: dict[str, object] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)

    def overall_accuracy(self, f: float) -> float | None:
        """ParM's accuracy when a share f of predictions is unavailable: (1-f)·A_available + f·A_degraded."""
        if self.available_accuracy is None or self.degraded_accuracy is None:
            return None
        return (1 - f) * self.available_accuracy + f * self.degraded_accuracy

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "history"}
        out["overall_accuracy"] = {f"{f:g}": self.overall_accuracy(f) for f in FREQUENCIES}
        return out


def _logits(program_runner: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]], x: np.ndarray,
            batch: int) -> torch.Tensor:
    outs = []
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            outs.append(program_runner([torch.from_numpy(np.ascontiguousarray(x[i : i + batch]))])[0].float())
    return torch.cat(outs)


def parity_loss(p_out: torch.Tensor, members: torch.Tensor, mode: LossMode = "mse") -> torch.Tensor:
    """The training loss of parity outputs `p_out` [G, C] for groups whose members' deployed logits
    are `members` [G, k, C] (see `TrainConfig.loss`)."""
    target = members.sum(1)
    if mode == "mse":
        return torch.nn.functional.mse_loss(p_out, target)
    g, k, c = members.shape
    # member i's reconstruction, p_out - Σ_{j≠i} F(x_j), is F(x_i) plus the parity output's error
    recon = (members + (p_out - target)[:, None, :]).reshape(g * k, c)
    return torch.nn.functional.kl_div(torch.log_softmax(recon, 1), torch.log_softmax(members.reshape(g * k, c), 1),
                                      log_target=True, reduction="batchmean")


@dataclass
class Evaluation:
    loss: float
    reconstruction: float
    degraded: float | None


def evaluate(parity: torch.nn.Module, enc: Callable[[list[torch.Tensor]], torch.Tensor], k: int, x: torch.Tensor,
             logits: torch.Tensor, y: torch.Tensor | None, seed: int = 1, rounds: int = 1,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Evaluation:
    """Loss and accuracies over `rounds` fixed groupings of x, each member of each group erased in turn."""
    n = (len(x) // k) * k
    rng = np.random.default_rng(seed)
    recon_hits = degraded_hits = total = 0
    loss = 0.0
    for _ in range(rounds):
        order = torch.from_numpy(rng.permutation(len(x))[:n]).view(-1, k)
        with torch.no_grad():
            p_out = parity(enc([x[order[:, i]] for i in range(k)])).float()
        loss += float((loss_fn or parity_loss)(p_out, logits[order]))
        for m in range(k):
            decoded = codes.decode(p_out, [logits[order[:, i]] for i in range(k) if i != m])
            pred = decoded.argmax(1)
            recon_hits += int((pred == logits[order[:, m]].argmax(1)).sum())
            if y is not None:
                degraded_hits += int((pred == y[order[:, m]]).sum())
            total += len(order)
    return Evaluation(loss / rounds, recon_hits / total, degraded_hits / total if y is not None else None)


def step_budget(n_train: int, k: int, groups_per_step: int, max_epochs: int | None) -> tuple[int, int]:
    """(steps per epoch, step budget). Without `max_epochs`: 500·k epochs (1,000 at k = 2), at least
    5,000 and at most 100,000 steps, so small data sets get enough steps and large ones a bounded
    number (the plateau and the time limit usually end training before). The budget grows with k
    because larger groups learn more slowly: at k = 4 the zoo transformer was still improving
    when 1,000 epochs ran out."""
    per_epoch = max(1, math.ceil(n_train // k / groups_per_step))
    if max_epochs is not None:
        return per_epoch, per_epoch * max_epochs
    return per_epoch, min(max(500 * k * per_epoch, 5000), 100_000)


def _split(n: int, cfg: TrainConfig, k: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(cfg.seed).permutation(n)
    n_val = max(2 * k, round(cfg.val_fraction * n))
    if n - n_val < 2 * k:
        raise ValueError(f"{n} training samples are too few to hold out a validation split at k = {k}")
    return order[n_val:], order[:n_val]


def _groups(n: int, k: int, groups_per_step: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless minibatches of coding groups (index rows of k), re-drawn every epoch."""
    while True:
        perm = torch.randperm(n, generator=gen)[: (n // k) * k].view(-1, k)
        for i in range(0, len(perm), groups_per_step):
            if len(perm) - i >= 2:  # a 1-sample batch has no batch statistics
                yield perm[i : i + groups_per_step]


def _parity_inputs(enc: Callable[[list[torch.Tensor]], torch.Tensor], x: torch.Tensor, k: int, n: int,
                   gen: torch.Generator) -> torch.Tensor:
    """About n parity inputs from random groups of x (for recalibrating BatchNorm statistics)."""
    rows: list[torch.Tensor] = []
    while sum(len(r) for r in rows) < n:
        rows.append(torch.randperm(len(x), generator=gen)[: (len(x) // k) * k].view(-1, k))
    g = torch.cat(rows)[:n]
    return enc([x[g[:, j]] for j in range(k)])


def train(spec: ModelSpec, runner: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]], data: Dataset, k: int,
          encoder_name: str = "sum", epochs: int | None = None, seed: int = 0,
          progress: Callable[[dict[str, float]], None] | None = None,
          config: TrainConfig | None = None) -> tuple[torch.nn.Module, TrainReport]:
    """Train a parity model; returns the chosen module (for `export`) and the report.

    `epochs` and `seed` are shorthands for `config.max_epochs` and `config.seed` (used when no
    config is given). `progress` gets one row per validation."""
    if len(spec.inputs) != 1 or len(spec.outputs) != 1:
        raise ValueError(f"{spec.key}: parity models need one input and one output (logits)")
    cfg = config or TrainConfig(max_epochs=epochs, seed=seed)
    codes.check(encoder_name, k, spec.inputs[0].sample_shape)
    enc = codes.encoder(encoder_name)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    parity = Lifted(read_exported_file(spec.path), cfg.norm, cfg.dropout, cfg.init == "fresh")
    tr, va = _split(len(data.x_train), cfg, k)
    x_all = torch.from_numpy(np.ascontiguousarray(data.x_train)).float()
    l_all = _logits(runner, data.x_train.astype(np.float32), spec.max_batch_size)
    y_all = torch.from_numpy(data.y_train) if data.y_train is not None else None
    xtr, ltr, xva, lva = x_all[tr], l_all[tr], x_all[va], l_all[va]
    yva = y_all[va] if y_all is not None else None
    groups_per_step = 64 if k == 2 else 32
    per_epoch, budget = step_budget(len(xtr), k, groups_per_step, cfg.max_epochs)
    patience = cfg.patience if cfg.patience is not None else 10 * k
    eval_every = min(max(per_epoch, 25), budget)
    opt = torch.optim.Adam([p for p in parity.weights if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    warmup = min(100, budget // 20)
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = _groups(len(xtr), k, groups_per_step, gen)
    def loss_fn(p_out: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        return parity_loss(p_out, members, cfg.loss)

    trainable = [p for p in parity.weights if p.requires_grad]
    best_acc, best_loss, best_state, best_step, best_eval = -1.0, math.inf, parity.state(), 0, None
    plateau_loss, bad, drops, lr = math.inf, 0, 0, cfg.lr
    history: list[dict[str, float]] = []
    step, running, stopped = 0, 0.0, "budget"
    while step < budget:
        # 1. one optimizer step on fresh coding groups
        parity.train()
        g = next(batches)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / max(warmup, 1))
        loss = loss_fn(parity(enc([xtr[g[:, j]] for j in range(k)])), ltr[g])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 5.0)
        opt.step()
        running += loss.item()
        step += 1
        if step % eval_every and step < budget:
            continue
        # 2. validate: recalibrated statistics, then the checkpoint and plateau bookkeeping
        parity.eval()
        parity.recalibrate(_parity_inputs(enc, xtr, k, 1024, gen))  # a no-op without BatchNorm
        ev = evaluate(parity, enc, k, xva, lva, yva, seed=cfg.seed + 1, rounds=4, loss_fn=loss_fn)
        row = {"step": step, "epoch": step / per_epoch, "lr": lr, "loss": running / eval_every,
               "val_loss": ev.loss, "reconstruction_accuracy": ev.reconstruction,
               "seconds": time.perf_counter() - t0}
        if ev.degraded is not None:
            row["degraded_accuracy"] = ev.degraded
        running = 0.0
        history.append(row)
        if progress is not None:
            progress(row)
        if ev.reconstruction > best_acc or (ev.reconstruction == best_acc and ev.loss < best_loss):
            best_acc, best_loss, best_state, best_step, best_eval = (ev.reconstruction, ev.loss, parity.state(),
                                                                     step, ev)
        if ev.loss < plateau_loss * (1 - 1e-3):
            plateau_loss, bad = ev.loss, 0
        else:
            bad += 1
        if bad >= patience:
            if drops >= cfg.max_lr_drops:
                stopped = "plateau"
                break
            drops, bad, lr = drops + 1, 0, lr / 4
        if time.perf_counter() - t0 > cfg.time_limit_s:
            stopped = "time limit"
            break
    # 3. the chosen checkpoint, measured once on the test split
    parity.load(best_state)
    parity.eval()
    lte = _logits(runner, data.x_test.astype(np.float32), spec.max_batch_size)
    yte = torch.from_numpy(data.y_test) if data.y_test is not None else None
    xte = torch.from_numpy(np.ascontiguousarray(data.x_test)).float()
    test = evaluate(parity, enc, k, xte, lte, yte, seed=cfg.seed + 2, rounds=4)
    available = float((lte.argmax(1) == yte).float().mean()) if yte is not None else None
    report = TrainReport(spec.name, k, encoder_name, math.ceil(step / per_epoch), math.ceil(best_step / per_epoch),
                         available, test.reconstruction, test.degraded, time.perf_counter() - t0, step, best_step,
                         stopped, best_eval.reconstruction if best_eval else 0.0,
                         best_eval.degraded if best_eval else None, {**asdict(cfg), "patience": patience},
                         history)
    log.info("%s: parity k=%d trained in %.1f s, %d steps (%s), test reconstruction %.4f", spec.key, k,
             report.seconds, step, stopped, test.reconstruction)
    return parity, report


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
