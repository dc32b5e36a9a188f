"""`escapement train-parity` on a tiny linear classifier, from an npz dataset, end to end.

For a linear model f(x) = Wx + b the sum code is exact once the parity model learns
f_P(x1 + x2) = W(x1 + x2) + 2b, so training must reach (nearly) perfect reconstruction.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from daemon import cli
from daemon.parity import codes
from daemon.repository import scan
from daemon.runtime.program import load_program

CONFIG = """max_batch_size = 16
slo_ms = 100

[[inputs]]
name = "x"
datatype = "FP32"
shape = [-1, 4]

[[outputs]]
name = "logits"
datatype = "FP32"
shape = [-1, 3]
"""


def _linear_repo(root: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with torch.no_grad():  # well separated logits and a bias the parity model must learn to double
        model.weight.mul_(2.0)
        model.bias.copy_(torch.tensor([1.0, -0.5, 0.3]))
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(model.eval(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    (root / "lin" / "1").mkdir(parents=True)
    torch.export.save(ep, str(root / "lin" / "1" / "model.pt2"))
    (root / "lin" / "config.toml").write_text(CONFIG)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4000, 4)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy()  # labels the model gets right: available = 1.0
    return root, x, y


def test_train_parity_writes_a_parity_model_that_reconstructs_a_linear_model(tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    repo, x, y = _linear_repo(tmp_path / "repo")
    data = tmp_path / "data.npz"
    np.savez(data, x=x, y=y)
    rc = cli.main(["train-parity", "lin", "--k", "2", "--data", str(data), "--seed", "1", "--epochs", "10",
                   "--lr", "0.01", "--models", str(repo)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "val reconstruction" in out and "chosen on validation" in out and "held-out test" in out
    assert "overall accuracy at unavailability f: f=0.01" in out

    (spec,) = scan(repo).models  # the config now carries the parity settings it wrote
    assert spec.parity is not None and spec.parity.k == 2 and spec.parity.encoder == "sum"
    text = (repo / "lin" / "config.toml").read_text()
    assert "[parity.accuracy]" in text and "available = 1.0" in text

    # the written program decodes what the deployed model would have answered
    deployed = load_program(spec).host_runner
    parity = torch.export.load(str(spec.path.parent / spec.parity.file)).module()
    a, b = torch.from_numpy(x[:256]), torch.from_numpy(x[256:512])
    rows = [(deployed([a[i : i + 16]])[0], deployed([b[i : i + 16]])[0], a[i : i + 16], b[i : i + 16])
            for i in range(0, 256, 16)]  # in batches the programs take
    out_a = torch.cat([r[0] for r in rows])
    with torch.no_grad():
        p = torch.cat([parity(codes.encoder("sum")([r[2], r[3]])) for r in rows])
    rebuilt = codes.decode(p, [torch.cat([r[1] for r in rows])])
    # an untrained parity model (the deployed one) would be off by the bias: W(a+b)+b - (Wb+b) = Wa
    untrained = float(torch.cat([deployed([r[2] + r[3]])[0] - r[1] for r in rows]).sub(out_a).abs().mean())
    assert float((rebuilt - out_a).abs().mean()) < untrained / 2
    assert float((rebuilt.argmax(1) == out_a.argmax(1)).float().mean()) >= 0.9


def test_train_parity_refuses_data_of_the_wrong_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo, _, _ = _linear_repo(tmp_path / "repo")
    data = tmp_path / "bad.npz"
    np.savez(data, x=np.zeros((10, 5), np.float32))
    rc = cli.main(["train-parity", "lin", "--data", str(data), "--epochs", "1", "--models", str(repo)])
    assert rc == 2
    assert "takes [4]" in capsys.readouterr().err


def test_train_parity_refuses_a_bad_validation_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo, x, y = _linear_repo(tmp_path / "repo")
    data = tmp_path / "data.npz"
    np.savez(data, x=x, y=y)
    rc = cli.main(["train-parity", "lin", "--data", str(data), "--val-fraction", "0.95", "--models", str(repo)])
    assert rc == 2
    assert "val_fraction" in capsys.readouterr().err


def test_train_parity_names_an_unknown_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo, _, _ = _linear_repo(tmp_path / "repo")
    assert cli.main(["train-parity", "nope", "--models", str(repo)]) == 2
    assert "nope" in capsys.readouterr().err
