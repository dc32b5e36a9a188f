"""Stored latency profiles: checked on load (a bad one is measured again, with one WARNING),
bounded in bytes, and keyed by device kind and model."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from daemon.model import ModelSpec
from daemon.repository import scan
from daemon.runtime import devices, torchcuda
from daemon.runtime.devices import (
    EMUCUDA_MODEL,
    SIM_MODEL,
    Device,
    cpu_model,
    device_model,
    host_model,
    resolve_devices,
)
from daemon.runtime.profiler import (
    MAX_PROFILE_BYTES,
    PROFILE_FORMAT,
    profile_key,
    profile_path,
    read_profile,
    seeds,
    write_profile,
)
from tests.support import tiny_config

LOGGER = "escapement.profile"
A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


def _entry(**changes: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"device": "cuda:0", "model": A100, "measured": "2026-11-21T00:00:00+00:00", "reps": 3,
                             "percentile": 99, "load_ms": 1.5, "load_first_ms": 9.0,
                             "infer_ms": {"1": 0.3, "2": 0.4, "4": 0.6},
                             "infer_median_ms": {"1": 0.2, "2": 0.3, "4": 0.5}, "device_bytes": 4096}
    entry.update(changes)
    return {k: v for k, v in entry.items() if v is not None}


@pytest.fixture(autouse=True)
def _no_cuda_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA models found by earlier tests in this process do not leak into these."""
    monkeypatch.setattr(devices, "_cuda_models", {})


@pytest.fixture
def spec(tmp_path: Path) -> ModelSpec:
    d = tmp_path / "m"
    (d / "1").mkdir(parents=True)
    (d / "config.toml").write_text(tiny_config(max_batch=4))
    (d / "1" / "model.ts").write_bytes(b"")
    (s,) = scan(tmp_path).models
    assert s.batch_sizes == (1, 2, 4)
    return s


def _read(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> tuple[dict[str, Any], list[str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = read_profile(spec)
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert all(r.exc_info is None for r in caplog.records)
    return got, warnings


def test_round_trip_under_kind_and_model(spec: ModelSpec) -> None:
    assert read_profile(spec) == {}
    assert write_profile(spec, f"cuda:{A100}", _entry())
    stored = json.loads(profile_path(spec).read_text())
    assert stored["format"] == PROFILE_FORMAT and set(stored) == {"format", f"cuda:{A100}"}
    infer, load, _ = seeds(read_profile(spec)[f"cuda:{A100}"])
    assert infer == pytest.approx({1: 0.3e-3, 2: 0.4e-3, 4: 0.6e-3}) and load == pytest.approx(1.5e-3)


def test_a_profile_measured_on_one_gpu_model_does_not_seed_another(spec: ModelSpec) -> None:
    a100 = Device("cuda:0", "cuda", 0, 1 << 30, model=A100)
    h100 = Device("cuda:1", "cuda", 1, 1 << 30, model=H100)
    key = profile_key(a100)
    assert key == f"cuda:{A100}" and profile_key(h100) == f"cuda:{H100}"
    assert key is not None and write_profile(spec, key, _entry())
    stored = read_profile(spec)
    assert stored.get(f"cuda:{H100}") is None and stored[f"cuda:{A100}"]["model"] == A100
    # both models' entries live side by side in one file
    assert write_profile(spec, f"cuda:{H100}", _entry(model=H100, load_ms=0.9))
    assert set(read_profile(spec)) == {f"cuda:{A100}", f"cuda:{H100}"}


def test_a_device_of_unknown_model_has_no_profile_key() -> None:
    assert profile_key(Device("cuda:0", "cuda", 0, 1)) is None


def test_a_bare_kind_reads_and_writes_this_hosts_model(spec: ModelSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon's warm-up asks by device kind: it gets the entry of the model its devices are.
    assert write_profile(spec, "cuda", _entry())  # stored by the model the entry was measured on
    assert write_profile(spec, "cuda", _entry(model=H100, load_ms=0.9))
    assert set(json.loads(profile_path(spec).read_text())) == {"format", f"cuda:{A100}", f"cuda:{H100}"}
    assert "cuda" not in read_profile(spec)  # no CUDA device resolved here: its model is unknown
    monkeypatch.setattr(devices, "_cuda_models", {0: H100, 1: H100})
    assert host_model("cuda") == H100 and read_profile(spec)["cuda"]["load_ms"] == 0.9
    monkeypatch.setattr(devices, "_cuda_models", {0: A100, 1: H100})  # two models in one host
    assert host_model("cuda") == "" and "cuda" not in read_profile(spec)


def test_a_cpu_profile_of_another_cpu_model_is_not_used(spec: ModelSpec) -> None:
    assert write_profile(spec, "cpu:Some Other CPU", _entry(device="cpu:0", model="Some Other CPU"))
    assert "cpu" not in read_profile(spec)
    entry = _entry(device="cpu:0", model=None)  # a device built without its model: this host's
    assert write_profile(spec, "cpu", entry)
    stored = read_profile(spec)
    assert stored["cpu"] is stored[f"cpu:{cpu_model()}"] and stored["cpu"]["model"] == cpu_model()
    assert stored["cpu:Some Other CPU"]["model"] == "Some Other CPU"


def test_an_entry_of_unknown_model_is_not_stored(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not write_profile(spec, "cuda", _entry(model=None))
    assert "model of the cuda device it was measured on is unknown" in caplog.text
    assert not profile_path(spec).exists()


def test_old_kind_only_files_are_measured_again_not_used(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> None:
    profile_path(spec).write_text(json.dumps({"cuda": _entry(), "cpu": _entry(device="cpu:0")}))
    got, warnings = _read(spec, caplog)
    assert got == {} and warnings == []  # outdated, not broken: an INFO line
    assert any("format 1" in r.getMessage() for r in caplog.records)
    assert write_profile(spec, f"cuda:{A100}", _entry())  # the old entries go
    assert set(json.loads(profile_path(spec).read_text())) == {"format", f"cuda:{A100}"}


@pytest.mark.parametrize("fmt", [3, "2", True, None, 1.5])
def test_an_unknown_format_is_ignored(spec: ModelSpec, caplog: pytest.LogCaptureFixture, fmt: Any) -> None:
    profile_path(spec).write_text(json.dumps({"format": fmt, f"cuda:{A100}": _entry()}))
    got, warnings = _read(spec, caplog)
    assert got == {}
    assert len(warnings) == (0 if fmt is None else 1)


NAN = float("nan")


@pytest.mark.parametrize(("bad", "needle"), [
    (_entry(load_ms=NAN), "load_ms = nan"),
    (_entry(load_ms=float("inf")), "load_ms = inf"),
    (_entry(load_ms=-1.0), "load_ms = -1.0"),
    (_entry(load_ms=0), "load_ms = 0"),
    (_entry(load_ms=1e300), "load_ms = 1e+300"),
    (_entry(load_ms="1.5"), "load_ms = '1.5'"),
    (_entry(load_ms=True), "load_ms = True"),
    (_entry(load_ms=None), "load_ms is missing"),
    (_entry(infer_ms={"1": 0.3, "2": NAN, "4": 0.6}), "infer_ms[2] = nan"),
    (_entry(infer_ms={"1": 0.3, "2": -0.4, "4": 0.6}), "infer_ms[2] = -0.4"),
    (_entry(infer_ms={"1": 0.3, "2": "0.4", "4": 0.6}), "infer_ms[2] = '0.4'"),
    (_entry(infer_ms={"1": 0.3, "2": {"p99": 0.4}, "4": 0.6}), "infer_ms[2] = {'p99': 0.4}"),
    (_entry(infer_ms=[0.3, 0.4, 0.6]), "infer_ms = [0.3, 0.4, 0.6]"),
    (_entry(infer_ms={}), "infer_ms = {}"),
    (_entry(infer_ms={"1": 0.3, "02": 0.4, "4": 0.6}), "batch size '02'"),
    (_entry(infer_ms={"1": 0.3, "2": 0.4, "4": 0.6, "99999": 1.0}), "batch size '99999'"),
    (_entry(infer_ms={"1": 0.3, "2": 0.4, "٤": 0.6}), "batch size '٤'"),
    (_entry(infer_ms={"1": 0.3, "2": 0.4}), "no time for batch sizes [4]"),
    (_entry(reps=-3), "reps = -3"),
    (_entry(reps=2.5), "reps = 2.5"),
    (_entry(percentile=250), "percentile = 250"),
    (_entry(device=7), "device = 7"),
    (_entry(device_bytes=-1), "device_bytes = -1"),
    (_entry(notes=["x"]), "notes = ['x']"),
    (_entry(model=H100), f"model = '{H100}', but it is stored for '{A100}'"),
    (_entry(model=7), "model = 7"),
    ([_entry()], "expected an object, not list"),
    ("fast", "expected an object, not str"),
])
def test_an_invalid_entry_is_ignored_with_one_warning(spec: ModelSpec, caplog: pytest.LogCaptureFixture,
                                                      bad: Any, needle: str) -> None:
    good = _entry(model=H100)
    text = json.dumps({"format": PROFILE_FORMAT, f"cuda:{A100}": bad, f"cuda:{H100}": good})  # NaN as JSON's NaN
    profile_path(spec).write_text(text)
    got, warnings = _read(spec, caplog)
    assert set(got) == {f"cuda:{H100}"}  # the sibling entry still counts
    assert len(warnings) == 1 and needle in warnings[0] and A100 in warnings[0]
    assert not write_profile(spec, f"cuda:{A100}", bad)  # nor is such an entry ever written
    assert json.loads(profile_path(spec).read_text(), parse_constant=str) == json.loads(text, parse_constant=str)


@pytest.mark.parametrize("key", ["gpu:x", "cuda:", "cuda:a\nb", "cuda:" + "x" * 200, "x" * 300, ""])
def test_a_key_that_is_not_kind_and_model_is_ignored(spec: ModelSpec, caplog: pytest.LogCaptureFixture,
                                                     key: str) -> None:
    profile_path(spec).write_text(json.dumps({"format": PROFILE_FORMAT, key: _entry()}))
    got, warnings = _read(spec, caplog)
    assert got == {} and len(warnings) == 1
    assert not write_profile(spec, key, _entry())


def test_a_bare_kind_key_in_the_file_is_ignored(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> None:
    # a format-2 file names the model of every entry: "cpu" alone would match any CPU
    profile_path(spec).write_text(json.dumps({"format": PROFILE_FORMAT, "cpu": _entry(model=cpu_model())}))
    got, warnings = _read(spec, caplog)
    assert got == {} and len(warnings) == 1 and "'kind:model'" in warnings[0]


def test_unknown_fields_are_dropped_not_refused(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> None:
    profile_path(spec).write_text(json.dumps({"format": PROFILE_FORMAT, "comment": "ignored",
                                              f"cuda:{A100}": _entry(clock_mhz=float("nan"))}))
    got, warnings = _read(spec, caplog)
    assert "clock_mhz" not in got[f"cuda:{A100}"] and len(warnings) == 1 and "'comment'" in warnings[0]
    assert write_profile(spec, f"cuda:{H100}", _entry(model=H100))  # no NaN reaches the file again
    assert "clock_mhz" not in profile_path(spec).read_text()


def _huge(p: Path) -> None:
    with p.open("w") as f:
        f.write('{"format": 2, "pad": "')
        f.write("x" * MAX_PROFILE_BYTES)
        f.write('"}')


@pytest.mark.parametrize(("make", "needle"), [
    (lambda p: p.write_text("{not json"), "not valid JSON"),
    (lambda p: p.write_bytes(b'{"format": 2, "\xff": 1}'), "not valid JSON"),
    (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "not valid JSON"),  # RecursionError
    (lambda p: p.write_text('{"format": ' + "9" * 5000 + "}"), "not valid JSON"),  # past int()'s digit limit
    (lambda p: p.write_text(json.dumps([_entry()])), "expected an object, not list"),
    (_huge, f"more than the {MAX_PROFILE_BYTES} read"),
    (lambda p: os.mkfifo(p), "a FIFO, not a regular file"),  # never opened for a blocking read
    (lambda p: p.mkdir(), "a directory, not a regular file"),
    (lambda p: p.symlink_to(p.name), "symbolic links"),
])
def test_an_unusable_file_is_ignored_with_one_warning(spec: ModelSpec, caplog: pytest.LogCaptureFixture,
                                                      make: Any, needle: str) -> None:
    make(profile_path(spec))
    got, warnings = _read(spec, caplog)
    assert got == {} and len(warnings) == 1 and needle in warnings[0]


def test_a_corrupt_file_is_replaced_by_the_next_measurement(spec: ModelSpec) -> None:
    profile_path(spec).write_text("{not json")
    assert write_profile(spec, f"cuda:{A100}", _entry())
    assert set(read_profile(spec)) == {f"cuda:{A100}"}


def test_a_write_goes_through_a_fresh_temporary_file(spec: ModelSpec) -> None:
    stale = profile_path(spec).with_name(f".{profile_path(spec).name}.tmp")
    os.mkfifo(stale)  # left under a temporary name: opening it to write would wait for a reader
    assert write_profile(spec, f"cuda:{A100}", _entry())
    assert write_profile(spec, f"cuda:{H100}", _entry(model=H100))
    assert set(read_profile(spec)) == {f"cuda:{A100}", f"cuda:{H100}"}
    assert sorted(p.name for p in spec.path.parent.iterdir()) == [stale.name, "model.ts", "profile.json"]
    assert profile_path(spec).stat().st_mode & 0o777 == 0o644


def test_a_profile_that_cannot_be_replaced_is_not_stored(spec: ModelSpec, caplog: pytest.LogCaptureFixture) -> None:
    profile_path(spec).mkdir()
    assert not write_profile(spec, f"cuda:{A100}", _entry())
    assert sorted(p.name for p in profile_path(spec).parent.iterdir()) == ["model.ts", "profile.json"]


# ---------------------------------------------------------------- device models


def test_cpu_model_comes_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: Example\nmodel name\t:  Example   CPU @ 3.0GHz\x07\n\n"
                    "processor\t: 1\nmodel name\t: Other\n")
    assert cpu_model(info) == "Example CPU @ 3.0GHz"


def test_cpu_model_falls_back_without_cpuinfo(tmp_path: Path) -> None:
    import platform

    (tmp_path / "arm").write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")
    want = " ".join((platform.processor() or platform.machine()).split())
    assert cpu_model(tmp_path / "arm") == cpu_model(tmp_path / "missing") == want


def test_cpu_model_on_arm_names_the_design(tmp_path: Path) -> None:
    import platform

    (tmp_path / "arm").write_text("processor\t: 0\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n\n"
                                  "processor\t: 1\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\n")
    assert cpu_model(tmp_path / "arm") == f"{platform.machine() or platform.processor()} 0x41:0xd0c"


def test_device_models_by_kind(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    assert device_model("emucuda", 0) == EMUCUDA_MODEL and device_model("sim", 3) == SIM_MODEL
    assert device_model("cpu", 0) == cpu_model() != ""
    monkeypatch.setattr(torchcuda, "device_name", lambda index: f"  {H100}\n")
    assert device_model("cuda", 0) == H100 and host_model("cuda") == H100

    def fails(index: int) -> str:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torchcuda, "device_name", fails)
    with caplog.at_level(logging.WARNING, logger="escapement.devices"):
        assert device_model("cuda", 1) == ""  # unknown: never shared, measured at every start
    assert "cuda:1: its model is unknown" in caplog.text
    assert host_model("cuda") == ""  # cuda:0 and cuda:1 are not known to be one model


def test_the_stand_in_and_the_simulator_have_fixed_models() -> None:
    assert Device("sim:0", "sim", 0, 1).model == SIM_MODEL  # as the simulator builds them
    assert Device("emucuda:0", "emucuda", 0, 1).model == EMUCUDA_MODEL
    assert Device("cpu:0", "cpu", 0, 1, model="X").model == "X"
    assert Device("cuda:0", "cuda", 0, 1).model == ""


def test_resolved_devices_name_their_model() -> None:
    (cpu,) = resolve_devices(["cpu:0"])
    assert cpu.model == cpu_model() and profile_key(cpu) == f"cpu:{cpu.model}"
