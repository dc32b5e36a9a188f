"""`escapement demo`: build the demo model repository offline.

- `digits_mlp` and `digits_cnn`: real classifiers trained on
  scikit-learn's bundled 8x8 digits; their held-out accuracy is written into their config.
- `digits_cnn64` (the CNN over the 64 flat pixels) and `digits_linear` (logistic regression):
  two more digits classifiers with the MLP's input, and `applications.toml`, the applications
  `digits` (exp3 selection) and `digits_ensemble` (exp4) over the three (docs/applications.md).
- `mlp_784`: a random-weight 784-1024-1024-10 MLP, the model peers are compared on.
- `cnn_heavy`: a random-weight CNN on 3x32x32 inputs whose batch-1 run takes a few ms on one
  core and whose throughput more than doubles with batching, so batching matters.
- `digits_personal`: the digits MLP split Velox-style (docs/personalization.md): outputs `logits`
  and `features` (the 64 values its last layer reads), the last layer as the shared head
  (`1/head.npz`), and `users.npz` beside it: users whose labels are permutations of the digits,
  with a feedback stream and a held-out set to measure what feedback teaches.

Idempotent: a model whose files are already there is left alone unless `force` is given.
Deterministic: fixed seeds and a fixed train/test split.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from daemon.parity.datasets import digits_split

log = logging.getLogger("escapement.demo")

SEED = 0


@dataclass(frozen=True)
class DemoModel:
    name: str
    fmt: str  # "pt2" or "ts"
    build: Callable[[], tuple[nn.Module, dict[str, object]]]
    input_shape: tuple[int, ...]  # per sample
    n_out: int
    max_batch_size: int
    slo_ms: float
    description: str


class DigitsMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 16.0)  # digits pixels are 0..16


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x / 16.0))


class DigitsCNN64(DigitsCNN):
    """The digits CNN over the 64 flat pixels, so that it takes the same input as the MLP (an
    application's models must)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, 1, 8, 8))


class DigitsLinear(nn.Module):
    """Multinomial logistic regression on the pixels: the weakest of the digits classifiers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x / 16.0)


class HeavyCNN(nn.Module):
    """A conv trunk and a wide fully connected head: ~3 ms for one sample on one core, and about
    2.3 times the samples per second at batch 16, since the head's 52 MB of weights are read
    once per batch."""

    def __init__(self) -> None:
        super().__init__()
        def block(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), nn.Conv2d(128, 256, 3, padding=1),
                                      nn.BatchNorm2d(256), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(1024, 3072), nn.ReLU(), nn.Linear(3072, 3072), nn.ReLU(),
                                  nn.Linear(3072, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int, lr: float) -> None:
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=1e-5)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _digits_model(model: nn.Module, shape: tuple[int, ...], epochs: int) -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(SEED)
    xtr, ytr, xte, yte = digits_split()
    xt, yt = torch.from_numpy(xtr).reshape(-1, *shape), torch.from_numpy(ytr)
    xv, yv = torch.from_numpy(xte).reshape(-1, *shape), torch.from_numpy(yte)
    _train(model, xt, yt, epochs=epochs, batch=64, lr=1e-3)
    acc = _accuracy(model, xv, yv)
    return model, {"dataset": "scikit-learn digits (8x8, pixels 0..16), 80/20 split, seed 0",
                   "test_accuracy": round(acc, 4), "test_samples": len(yte),
                   "classes": list(range(10))}


def _random_model(model: nn.Module) -> tuple[nn.Module, dict[str, object]]:
    return model.eval(), {"weights": "random (for timing only)"}


def _seeded(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(SEED)
    return cls()


MODELS: list[DemoModel] = [
    DemoModel("digits_mlp", "pt2", lambda: _digits_model(_seeded(DigitsMLP), (64,), epochs=60),
              (64,), 10, 32, 100.0, "MLP 64-128-64-10 trained on scikit-learn digits"),
    DemoModel("digits_cnn", "pt2", lambda: _digits_model(_seeded(DigitsCNN), (1, 8, 8), epochs=25),
              (1, 8, 8), 10, 32, 100.0, "small CNN trained on scikit-learn digits"),
    DemoModel("digits_cnn64", "pt2", lambda: _digits_model(_seeded(DigitsCNN64), (64,), epochs=25),
              (64,), 10, 32, 100.0, "the digits CNN over the 64 flat pixels (the applications' input)"),
    DemoModel("digits_linear", "pt2", lambda: _digits_model(_seeded(DigitsLinear), (64,), epochs=30),
              (64,), 10, 32, 100.0, "logistic regression trained on scikit-learn digits"),
    DemoModel("mlp_784", "pt2", lambda: _random_model(nn.Sequential(
                  nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))),
              (784,), 10, 32, 100.0, "MLP 784-1024-1024-10, random weights: the model peers are compared on"),
    DemoModel("cnn_heavy", "pt2", lambda: _random_model(_seeded(HeavyCNN)),
              (3, 32, 32), 10, 32, 100.0, "CNN on 3x32x32, random weights: a few ms per batch-1 call, "
              "batching doubles its throughput"),
]


def config_text(m: DemoModel, metadata: dict[str, object]) -> str:
    shape = ", ".join(str(d) for d in (-1, *m.input_shape))
    lines = [
        f"# Built by `escapement demo`. {m.description}.",
        f'description = "{m.description}"',
        f"max_batch_size = {m.max_batch_size}",
        f"slo_ms = {m.slo_ms:g}",
        "",
        "[[inputs]]",
        'name = "INPUT__0"',
        'datatype = "FP32"',
        f"shape = [{shape}]",
        "",
        "[[outputs]]",
        'name = "OUTPUT__0"',
        'datatype = "FP32"',
        f"shape = [-1, {m.n_out}]",
        "",
        "[metadata]",
    ]
    for k, v in metadata.items():
        lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def save_model(model: nn.Module, fmt: str, example: torch.Tensor, max_batch: int, path: Path) -> None:
    """Write `model` as model.pt2 (batch dimension dynamic) or model.ts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")  # keeps the suffix torch.export.save checks
    model = model.eval()
    if fmt == "pt2":
        batch = torch.export.Dim("batch", min=1, max=max(max_batch, 2))
        ep = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        torch.export.save(ep, str(tmp))
    else:  # TorchScript is deprecated in torch 2.13; kept for users who still have such models
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.jit.save(torch.jit.script(model), str(tmp))
    tmp.replace(path)  # never leave a half-written model for the daemon to find


def build(out: str | Path, force: bool = False, only: list[str] | None = None) -> list[str]:
    """Build the demo models under `out`; returns the names built (skipped ones are not listed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    built: list[str] = []
    for m in MODELS:
        if only and m.name not in only:
            continue
        model_dir = out / m.name
        model_file = model_dir / "1" / f"model.{m.fmt}"
        if model_file.exists() and (model_dir / "config.toml").exists() and not force:
            if m.name in PARITY_DEMO and not (model_file.parent / "parity-k2.pt2").exists():
                log.info("%s: already built; parity model added%s", m.name, _build_parity(out, m.name))
                built.append(m.name)
            else:
                log.info("%s: already built", m.name)
            continue
        t0 = time.perf_counter()
        model, meta = m.build()
        example = torch.zeros((2, *m.input_shape))
        save_model(model, m.fmt, example, m.max_batch_size, model_file)
        (model_dir / "config.toml").write_text(config_text(m, meta), encoding="utf-8")
        acc = f", test accuracy {meta['test_accuracy']:.4f}" if "test_accuracy" in meta else ""
        if m.name in PARITY_DEMO:
            acc += _build_parity(out, m.name)
        log.info("%s: built in %.1f s%s", m.name, time.perf_counter() - t0, acc)
        built.append(m.name)
    if not only and (force or not (out / APPLICATIONS_FILE).exists()):
        (out / APPLICATIONS_FILE).write_text(APPLICATIONS_TEXT, encoding="utf-8")
        log.info("%s: the demo applications (digits, digits_ensemble)", APPLICATIONS_FILE)
    done = all((out / PERSONAL / f).exists() for f in ("config.toml", "users.npz", "1/model.pt2", "1/head.npz"))
    if (not only or PERSONAL in only) and (force or not done):
        t0 = time.perf_counter()
        note = _build_personal(out)
        log.info("%s: built in %.1f s%s", PERSONAL, time.perf_counter() - t0, note)
        built.append(PERSONAL)
    elif not only or PERSONAL in only:
        log.info("%s: already built", PERSONAL)
    return built


APPLICATIONS_FILE = "applications.toml"  # read by the daemon (daemon/gateway.py, docs/applications.md)
APPLICATIONS_TEXT = """\
# Built by `escapement demo`: applications over the digits classifiers (docs/applications.md).
[[applications]]
name = "digits"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp3"

[[applications]]
name = "digits_ensemble"
models = ["digits_mlp", "digits_cnn64", "digits_linear"]
policy = "exp4"
combine = "softmax"
# no model back in time: equal logits (every class equally likely), flagged default
default_output = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
"""

PERSONAL = "digits_personal"
PERSONAL_USERS = 5  # users in users.npz, each with its own permutation of the ten labels


class DigitsSplitMLP(nn.Module):
    """DigitsMLP answering its logits and the features its last layer reads."""

    def __init__(self, mlp: DigitsMLP) -> None:
        super().__init__()
        self.body = mlp.net[:4]
        last = mlp.net[4]
        assert isinstance(last, nn.Linear)
        self.last: nn.Linear = last

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.body(x / 16.0)
        return self.last(f), f


def personal_config_text(meta: dict[str, object]) -> str:
    desc = "digits MLP 64-128-64-10 split for per-user weights: logits, and the 64 features its last layer reads"
    lines = [f"# Built by `escapement demo`. {desc}.", f'description = "{desc}"', "max_batch_size = 32",
             "slo_ms = 100", "", "[[inputs]]", 'name = "INPUT__0"', 'datatype = "FP32"', "shape = [-1, 64]", "",
             "[[outputs]]", 'name = "logits"', 'datatype = "FP32"', "shape = [-1, 10]", "",
             "[[outputs]]", 'name = "features"', 'datatype = "FP32"', "shape = [-1, 64]", "",
             "[personalization]", 'features = "features"', 'head = "head.npz"', 'output = "personalized"',
             "prior = 1.0", "", "[metadata]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in meta.items()]
    return "\n".join(lines) + "\n"


def _build_personal(out: Path) -> str:
    """digits_personal: the trained digits MLP, its head (W, bias row, the logits' scale) and the
    users' evaluation data."""
    model, meta = _digits_model(_seeded(DigitsMLP), (64,), epochs=60)
    assert isinstance(model, DigitsMLP)
    split = DigitsSplitMLP(model).eval()
    model_dir = out / PERSONAL
    save_model(split, "pt2", torch.zeros((2, 64)), 32, model_dir / "1" / "model.pt2")
    xtr, ytr, xte, yte = digits_split()
    with torch.no_grad():
        logits, _ = split(torch.from_numpy(xtr))
    last = split.last
    w = np.vstack([last.weight.detach().numpy().T, last.bias.detach().numpy()[None, :]]).astype(np.float64)
    scale = float(logits.abs().mean())  # feedback targets are +-scale: the logits' own size
    np.savez(model_dir / "1" / "head.npz", W=w, scale=np.float64(scale))
    perms = np.stack([np.random.default_rng(100 + u).permutation(10) for u in range(PERSONAL_USERS)])
    np.savez(model_dir / "users.npz", users=np.array([f"user{u}" for u in range(PERSONAL_USERS)]), perms=perms,
             x_feedback=xtr, y_feedback=ytr, x_test=xte, y_test=yte)
    meta = {**meta, "target_scale": round(scale, 4),
            "users": "users.npz: user u sees label perms[u][y] for digit y (feedback stream: the train split)"}
    (model_dir / "config.toml").write_text(personal_config_text(meta), encoding="utf-8")
    return f", test accuracy {meta['test_accuracy']:.4f}, logits' scale {scale:.3f}"


PARITY_DEMO = ("digits_mlp", "digits_cnn")  # the demo classifiers get a parity model (k = 2)


def _build_parity(out: Path, name: str, k: int = 2, epochs: int = 100) -> str:
    from daemon.parity import datasets, lifted, trainer
    from daemon.repository import scan
    from daemon.runtime.program import load_program

    spec = next(m for m in scan(out).models if m.name == name)
    parity, report = trainer.train(spec, load_program(spec).host_runner, datasets.load_dataset(spec, None), k,
                                   epochs=epochs)
    file = f"parity-k{k}.pt2"
    lifted.export(parity, spec, spec.path.parent / file)
    trainer.set_parity_section(out / name / "config.toml", trainer.parity_section(k, "sum", file, report))
    return f"; parity k={k}: degraded-mode accuracy {report.degraded_accuracy:.4f}"
