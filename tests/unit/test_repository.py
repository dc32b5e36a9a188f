from __future__ import annotations

from pathlib import Path

import pytest

from daemon.errors import ModelConfigError
from daemon.model_config import parse_model_config
from daemon.repository import scan
from tests.support import tiny_config


def test_scan_serves_good_entries_and_reports_broken_ones(test_repo: Path) -> None:
    result = scan(test_repo)
    keys = sorted(m.key for m in result.models)
    # garbage and wrong_shape parse fine here; their files are checked when loaded.
    assert keys == ["all_types:1", "garbage:1", "tiny_pt2:1", "tiny_ts:1", "tiny_ts:2", "wrong_shape:1"]
    assert set(result.broken) == {"no_config", "bad_toml"}
    assert "no config.toml" in result.broken["no_config"]
    assert "not valid TOML" in result.broken["bad_toml"]


def test_model_spec_fields(test_repo: Path) -> None:
    spec = next(m for m in scan(test_repo).models if m.key == "tiny_ts:2")
    assert spec.format == "ts"
    assert spec.batch_sizes == (1, 2, 4, 8)
    assert spec.batch_size_for(3) == 4
    assert spec.inputs[0].sample_shape == (4,)
    assert spec.inputs[0].sample_bytes == 16
    assert spec.slo_s == 1.0


def _write(tmp_path: Path, text: str) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.toml").write_text(text)
    return d


@pytest.mark.parametrize(("text", "needle"), [
    (tiny_config().replace("max_batch_size = 8", "max_batch_size = 0"), "max_batch_size = 0"),
    (tiny_config().replace("shape = [-1, 4]", "shape = [4, -1]"), "must start with -1"),
    (tiny_config().replace("shape = [-1, 4]", "shape = [-1, -1]"), "only the batch dimension"),
    (tiny_config().replace('datatype = "FP32"', 'datatype = "UINT16"', 1), "not supported by torch models"),
    (tiny_config().replace('datatype = "FP32"', 'datatype = "BYTES"', 1), "models cannot take or give it yet"),
    (tiny_config().replace('datatype = "FP32"', 'datatype = "BF16"', 1), "models cannot take or give it yet"),
    (tiny_config().replace('datatype = "FP32"', 'datatype = "FLOAT"', 1), "datatype 'FLOAT' is not supported"),
    (tiny_config() + "\ncolour = 1\n", "unknown keys"),
    (tiny_config().replace("slo_ms = 1000.0", "slo_ms = -3"), "slo_ms = -3"),
    ('name = "other"\n' + tiny_config(), "names the model 'other'"),
    (tiny_config().split("[[outputs]]")[0], "at least one [[outputs]]"),
])
def test_bad_model_configs(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ModelConfigError) as exc:
        parse_model_config(_write(tmp_path, text), 100.0)
    assert needle in str(exc.value)


def test_batch_sizes_include_a_max_that_is_not_a_power_of_two(tmp_path: Path) -> None:
    d = _write(tmp_path, tiny_config(max_batch=12))
    (d / "1").mkdir()
    (d / "1" / "model.ts").write_bytes(b"")
    (spec,) = scan(tmp_path).models
    assert spec.batch_sizes == (1, 2, 4, 8, 12)


def test_both_files_in_one_version_is_an_error(tmp_path: Path) -> None:
    d = _write(tmp_path, tiny_config())
    (d / "1").mkdir()
    (d / "1" / "model.ts").write_bytes(b"")
    (d / "1" / "model.pt2").write_bytes(b"")
    result = scan(tmp_path)
    assert not result.models
    assert "both model.pt2 and model.ts" in result.broken["m"]
