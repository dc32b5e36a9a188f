"""The parity trainer on models with BatchNorm, dropout and LayerNorm: training-mode graphs,
recalibrated statistics, export, repeatability, the validation split and plateau stopping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from daemon.model import ModelSpec
from daemon.parity import codes, datasets, lifted, trainer, zoo
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


def _export(model: nn.Module, root: Path, name: str = "m") -> ModelSpec:
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = torch.export.export(model.eval(), (torch.zeros(2, 4),), dynamic_shapes=({0: batch},))
    (root / name / "1").mkdir(parents=True)
    torch.export.save(ep, str(root / name / "1" / "model.pt2"))
    (root / name / "config.toml").write_text(CONFIG)
    return next(m for m in scan(root).models if m.name == name)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))


def _data(n: int = 600) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(n, 4)) * 3 + 5).astype(np.float32)  # far from the 0/1 statistics BatchNorm starts with
    y = (x[:, 0] > 5).astype(np.int64) + (x[:, 1] > 5).astype(np.int64)
    cut = int(0.8 * n)
    return datasets.Dataset(x[:cut], x[cut:], y[:cut], y[cut:])


def test_the_training_graph_turns_batch_norm_and_dropout_on(tmp_path: Path) -> None:
    spec = _export(_bn_model(), tmp_path)
    ep = torch.export.load(str(spec.path))
    train_gm = lifted.training_graph(ep.graph_module, dropout=True)
    bn = next(n for n in train_gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
    drop = next(n for n in train_gm.graph.nodes if n.target is torch.ops.aten.dropout.default)
    assert bn.args[5] is True and drop.args[2] is True
    served = next(n for n in ep.graph_module.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
    assert served.args[5] is False  # the served graph is left alone

    parity = lifted.Lifted(ep, dropout=False)
    x = torch.randn(32, 4) * 3 + 5
    parity.train()
    out_train = parity(x)
    parity.eval()
    assert not torch.allclose(out_train, parity(x))  # batch statistics vs the (reset) running ones


def test_recalibration_sets_running_statistics_to_the_parity_inputs(tmp_path: Path) -> None:
    parity = lifted.Lifted(torch.export.load(str(_export(_bn_model(), tmp_path).path)))
    x = torch.randn(256, 4) * 2 + 3
    parity.recalibrate(x)
    state = parity.state()
    assert torch.allclose(state["0.running_mean"], x.mean(0), atol=1e-5)
    assert torch.allclose(state["0.running_var"], x.var(0), rtol=1e-4)


def test_a_trained_batch_norm_parity_model_exports_with_its_statistics_and_a_dynamic_batch(tmp_path: Path) -> None:
    spec = _export(_bn_model(), tmp_path / "repo")
    runner = load_program(spec).host_runner
    parity, report = trainer.train(spec, runner, _data(), 2, config=trainer.TrainConfig(max_epochs=3))
    assert report.steps > 0 and report.stopped == "budget"
    lifted.export(parity, spec, tmp_path / "parity.pt2")
    served = torch.export.load(str(tmp_path / "parity.pt2")).module()
    parity.eval()
    for batch in (1, 5, 16):
        x = torch.randn(batch, 4) * 3 + 10
        with torch.no_grad():
            assert torch.allclose(served(x), parity(x), atol=1e-5)
    assert float(parity.state()["0.running_mean"].abs().sum()) > 1.0  # learned from sums of inputs near 5


def test_a_seed_makes_a_run_repeatable(tmp_path: Path) -> None:
    spec = _export(_bn_model(), tmp_path)
    runner = load_program(spec).host_runner
    runs = [trainer.train(spec, runner, _data(), 2, config=trainer.TrainConfig(max_epochs=2, seed=s))
            for s in (3, 3, 4)]
    (pa, ra), (pb, rb), (_, rc) = runs
    assert [h["val_loss"] for h in ra.history] == [h["val_loss"] for h in rb.history]
    assert all(torch.equal(v, pb.state()[n]) for n, v in pa.state().items())
    assert [h["val_loss"] for h in ra.history] != [h["val_loss"] for h in rc.history]


def test_training_stops_on_a_plateau_after_lowering_the_rate_and_keeps_the_best_validation_checkpoint(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = _export(nn.Linear(4, 3), tmp_path)
    runner = load_program(spec).host_runner
    cfg = trainer.TrainConfig(patience=1, max_lr_drops=1, lr=1e-9)  # nothing moves: the loss plateaus at once
    _, report = trainer.train(spec, runner, _data(), 2, config=cfg)
    assert report.stopped == "plateau" and len(report.history) == 3
    assert [h["lr"] for h in report.history] == [1e-9, 1e-9, 2.5e-10]
    best = max(report.history, key=lambda h: (h["reconstruction_accuracy"], -h["val_loss"]))
    assert report.best_step == best["step"] and report.val_reconstruction_accuracy == best["reconstruction_accuracy"]


def test_overall_accuracy_weighs_available_and_degraded_by_the_unavailability() -> None:
    report = trainer.TrainReport("m", 2, "sum", 1, 1, 0.98, 0.9, 0.90, 1.0)
    assert report.overall_accuracy(0.1) == pytest.approx(0.9 * 0.98 + 0.1 * 0.90)
    assert report.as_dict()["overall_accuracy"] == {"0.01": pytest.approx(0.9792), "0.05": pytest.approx(0.976),
                                                    "0.1": pytest.approx(0.972)}


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        trainer.TrainConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match="max_epochs"):
        trainer.TrainConfig(max_epochs=0)


@pytest.mark.parametrize("name", list(zoo.ZOO))
def test_every_zoo_architecture_trains_and_exports(tmp_path: Path, name: str) -> None:
    zoo.build(tmp_path / "repo", [name], epochs=1)  # barely trained: this checks the plumbing, not accuracy
    spec = next(m for m in scan(tmp_path / "repo").models if m.name == name)
    full = datasets.load_dataset(spec, None)
    data = datasets.Dataset(full.x_train[:300], full.x_test[:60], full.y_train[:300], full.y_test[:60])  # fast
    parity, report = trainer.train(spec, load_program(spec).host_runner, data, 2,
                                   config=trainer.TrainConfig(max_epochs=1))
    assert report.degraded_accuracy is not None and report.available_accuracy is not None
    lifted.export(parity, spec, tmp_path / "parity.pt2")
    served = torch.export.load(str(tmp_path / "parity.pt2")).module()
    x = torch.from_numpy(data.x_test[:3])
    parity.eval()
    with torch.no_grad():
        assert torch.allclose(served(x + x), parity(x + x), atol=1e-4)


def test_the_decode_loss_ignores_what_decoding_cannot_see_and_mse_does_not() -> None:
    gen = torch.Generator().manual_seed(0)
    members = torch.randn(5, 3, 4, generator=gen) * 3  # 5 groups of k = 3, 4 classes
    exact = members.sum(1)
    shifted = exact + 2.0  # the same shift on every class: every decoded softmax is unchanged
    assert float(trainer.parity_loss(exact, members, "decode")) == pytest.approx(0.0, abs=1e-6)
    assert float(trainer.parity_loss(shifted, members, "decode")) == pytest.approx(0.0, abs=1e-5)
    assert float(trainer.parity_loss(shifted, members, "mse")) == pytest.approx(4.0)
    wrong = exact + torch.randn(5, 4, generator=gen)
    assert float(trainer.parity_loss(wrong, members, "decode")) > 1e-3


def test_patience_and_the_step_budget_grow_with_k(tmp_path: Path) -> None:
    epochs = {k: budget / per_epoch for k in (2, 4) for per_epoch, budget in [trainer.step_budget(4000, k, 32, None)]}
    assert epochs == {2: 1000, 4: 2000}  # 500·k epochs
    per_epoch, budget = trainer.step_budget(4000, 4, 32, 3)
    assert budget == 3 * per_epoch  # max_epochs still caps it
    spec = _export(nn.Linear(4, 3), tmp_path)
    runner = load_program(spec).host_runner
    for k, given, used in ((3, None, 30), (4, None, 40), (4, 7, 7)):
        _, report = trainer.train(spec, runner, _data(), k, config=trainer.TrainConfig(max_epochs=1, patience=given))
        assert report.config["patience"] == used


def test_a_concat_coded_parity_model_of_an_image_model_trains_exports_and_decodes(tmp_path: Path) -> None:
    zoo.build(tmp_path / "repo", ["zoo_rescnn"], epochs=1)  # barely trained: this checks the plumbing
    spec = next(m for m in scan(tmp_path / "repo").models if m.name == "zoo_rescnn")
    full = datasets.load_dataset(spec, None)
    data = datasets.Dataset(full.x_train[:400], full.x_test[:80], full.y_train[:400], full.y_test[:80])
    assert codes.default_encoder(4, spec.inputs[0].sample_shape) == "concat"
    parity, report = trainer.train(spec, load_program(spec).host_runner, data, 4, "concat",
                                   config=trainer.TrainConfig(max_epochs=2))
    assert report.encoder == "concat" and report.reconstruction_accuracy > 0.0
    lifted.export(parity, spec, tmp_path / "parity.pt2")
    served = torch.export.load(str(tmp_path / "parity.pt2")).module()
    xs = [torch.from_numpy(data.x_test[i : i + 5]) for i in range(0, 20, 5)]
    parity.eval()
    with torch.no_grad():
        assert torch.allclose(served(codes.encode_concat(xs)), parity(codes.encode_concat(xs)), atol=1e-4)
