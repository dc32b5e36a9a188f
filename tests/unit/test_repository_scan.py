"""The repository scan against odd entries: each one costs its version or its model, with one
WARNING line and no traceback, and never the scan (no hang, no exception, the others served)."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from daemon.errors import ModelConfigError, RefusedFile
from daemon.files import read_regular
from daemon.model_config import MAX_CONFIG_BYTES, parse_model_config
from daemon.repository import ScanResult, _version_number, scan
from tests.support import tiny_config

LOGGER = "escapement.repository"


def _model(root: Path, name: str, versions: tuple[str, ...] = ("1",)) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "config.toml").write_text(tiny_config())
    for v in versions:
        (d / v).mkdir()
        (d / v / "model.ts").write_bytes(b"")  # the scan never opens model files
    return d


def _scan(root: Path, caplog: pytest.LogCaptureFixture) -> tuple[ScanResult, list[logging.LogRecord]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = scan(root)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records), records
    return result, records


def _keys(result: ScanResult) -> list[str]:
    return sorted(m.key for m in result.models)


@pytest.mark.parametrize("name", [
    "²",  # str.isdigit() accepts it, int() refuses it
    "٣",  # Arabic-Indic three: int() reads it as 3
    "１",  # a fullwidth one
    "9" * 19,  # past the 18-digit bound
    str(2**63),  # beyond any int64
    "9" * 255,  # as long as a file name may be
])
def test_an_odd_version_name_is_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         name: str) -> None:
    m = _model(tmp_path, "m")
    _model(tmp_path, "other")
    (m / name).mkdir()
    (m / name / "model.ts").write_bytes(b"")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["m:1", "other:1"] and not result.broken
    assert len(records) == 1 and repr(name)[:20] in records[0].getMessage()


def test_a_version_past_pythons_digit_limit_is_refused_without_int() -> None:
    # 5,000 digits cannot be a directory name (255 bytes at most), so ask the parser directly:
    # int() would raise ValueError past 4,300 digits.
    with pytest.raises(ModelConfigError, match="1 to 18 ASCII digits"):
        _version_number("9" * 5000)
    assert _version_number("123456789012345678") == 123456789012345678
    assert _version_number("notes") is None


def test_a_model_whose_only_version_is_odd_is_broken_with_the_reason(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    _model(tmp_path, "m", versions=("²",))
    _model(tmp_path, "other")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["other:1"]
    assert "no version directory" in result.broken["m"] and "'²'" in result.broken["m"]
    assert len(records) == 1


def test_a_second_spelling_of_a_version_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = _model(tmp_path, "m", versions=("1", "01", "2"))
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["m:1", "m:2"] and result.models[0].path == m / "1" / "model.ts"
    assert len(records) == 1 and "'01' is skipped: '1' is version 1 too" in records[0].getMessage()


def test_two_spellings_of_a_version_neither_canonical_are_both_skipped(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    _model(tmp_path, "m", versions=("01", "001", "2"))
    _model(tmp_path, "alone", versions=("007",))  # one spelling only: it is version 7
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["alone:7", "m:2"]
    assert sorted(r.getMessage() for r in records) == [
        "model m: version directory '001' is skipped: '01' is version 1 too",
        "model m: version directory '01' is skipped: '001' is version 1 too",
    ]


def test_a_model_left_with_no_version_is_broken(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _model(tmp_path, "m", versions=("01", "001"))
    result, records = _scan(tmp_path, caplog)
    assert not result.models and "'01' is version 1 too" in result.broken["m"] and len(records) == 1


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _loop(path: Path) -> None:
    path.symlink_to(path.name)  # a link to itself: stat fails with ELOOP


def _directory(path: Path) -> None:
    path.mkdir()


def _dangling(path: Path) -> None:
    path.symlink_to("nowhere")


def _socket(path: Path) -> None:
    # bound by a relative name: a unix socket's path must fit in 108 bytes, tmp_path may not
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)
    finally:
        os.chdir(cwd)


def _both(path: Path) -> None:
    path.write_bytes(b"")
    path.with_name("model.ts").write_bytes(b"")


@pytest.mark.parametrize(("make", "needle"), [
    (_fifo, "model.pt2 is a FIFO, not a regular file"),
    (_socket, "model.pt2 is a socket, not a regular file"),
    (_loop, "model.pt2: Too many levels of symbolic links"),
    (_dangling, "model.pt2 is a symbolic link to nothing"),
    (_directory, "model.pt2 is a directory, not a regular file"),
    (_both, "it holds both model.pt2 and model.ts"),
])
def test_an_odd_model_file_skips_its_version_without_opening_it(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                make: Callable[[Path], None], needle: str) -> None:
    m = _model(tmp_path, "m", versions=("1", "3"))
    _model(tmp_path, "other")
    (m / "2").mkdir()
    make(m / "2" / "model.pt2")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["m:1", "m:3", "other:1"] and not result.broken
    assert len(records) == 1 and "model m: version 2 is skipped" in records[0].getMessage()
    assert needle in records[0].getMessage()


def test_a_model_whose_only_version_has_an_odd_file_is_broken(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    m = _model(tmp_path, "m", versions=())
    _model(tmp_path, "other")
    (m / "1").mkdir()
    _fifo(m / "1" / "model.ts")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["other:1"]
    assert "no version directory" in result.broken["m"] and "model.ts is a FIFO" in result.broken["m"]
    assert len(records) == 1 and "'m' is not served" in records[0].getMessage()


@pytest.mark.parametrize("make", [_loop, _dangling])
def test_a_version_directory_that_cannot_be_looked_at_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 make: Callable[[Path], None]) -> None:
    m = _model(tmp_path, "m")
    make(m / "2")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["m:1"]
    assert len(records) == 1 and "version 2 is skipped" in records[0].getMessage()


@pytest.mark.parametrize(("make", "needle"), [
    (_fifo, "config.toml is a FIFO, not a regular file"),
    (_loop, "symbolic links"),
    (_directory, "config.toml is a directory, not a regular file"),
])
def test_an_odd_config_breaks_only_its_model(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             make: Callable[[Path], None], needle: str) -> None:
    m = _model(tmp_path, "m")
    _model(tmp_path, "other")
    (m / "config.toml").unlink()
    make(m / "config.toml")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["other:1"]
    assert needle in result.broken["m"]
    assert len(records) == 1


def test_a_huge_config_is_not_read_past_its_bound(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = _model(tmp_path, "m")
    _model(tmp_path, "other")
    with (m / "config.toml").open("a") as f:
        f.write("#" * MAX_CONFIG_BYTES + "\n")
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["other:1"]
    assert f"more than the {MAX_CONFIG_BYTES} read" in result.broken["m"] and len(records) == 1


@pytest.mark.parametrize("text", [
    "max_batch_size = " + "9" * 5000,  # int() refuses it: a ValueError, not a TOMLDecodeError
    "a = " + "[" * 5000 + "]" * 5000,  # RecursionError in the parser
    b"\xff\xfe max_batch_size = 8",  # not UTF-8
])
def test_configs_that_break_the_parser_break_only_their_model(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              text: str | bytes) -> None:
    m = _model(tmp_path, "m")
    _model(tmp_path, "other")
    if isinstance(text, bytes):
        (m / "config.toml").write_bytes(text)
    else:
        (m / "config.toml").write_text(text)
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["other:1"]
    assert "not valid TOML" in result.broken["m"] and len(records) == 1


@pytest.mark.parametrize("flush", ["nan", "inf", "-1.0", "1e300"])
def test_a_parity_flush_time_must_be_finite_and_bounded(tmp_path: Path, flush: str) -> None:
    m = _model(tmp_path, "m")
    (m / "config.toml").write_text(tiny_config() + f'[parity]\nk = 2\nfile = "p.pt2"\nflush_ms = {flush}\n')
    with pytest.raises(ModelConfigError, match="flush_ms"):
        parse_model_config(m, 100.0)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_files_cost_their_version_or_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m = _model(tmp_path, "m", versions=("1", "2", "3"))
    (m / "2" / "model.ts").chmod(0)
    (m / "3").chmod(0)  # a version directory that may not be searched
    locked = _model(tmp_path, "locked")
    (locked / "config.toml").chmod(0)
    try:
        result, records = _scan(tmp_path, caplog)
    finally:
        (m / "2" / "model.ts").chmod(0o644)
        (m / "3").chmod(0o755)
        (locked / "config.toml").chmod(0o644)
    assert _keys(result) == ["m:1"]
    assert "cannot read config.toml: Permission denied" in result.broken["locked"]
    messages = sorted(r.getMessage() for r in records)
    assert len(messages) == 3
    assert "model m: version 2 is skipped: model.ts is not readable (permission denied)" in messages
    assert "model m: version 3 is skipped: Permission denied" in messages


def test_odd_entries_at_the_root(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _model(tmp_path, "good")
    os.mkfifo(tmp_path / "pipe")  # not a model: skipped with a warning
    _loop(tmp_path / "loop")  # meant as one, perhaps: reported broken
    (tmp_path / "README.md").write_text("models live here\n")  # passed over in silence
    result, records = _scan(tmp_path, caplog)
    assert _keys(result) == ["good:1"]
    assert set(result.broken) == {"loop"} and "symbolic links" in result.broken["loop"]
    assert len(records) == 2 and any("'pipe'" in r.getMessage() and "FIFO" in r.getMessage() for r in records)


def test_read_regular_refuses_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(RefusedFile, match="FIFO"):
        read_regular(tmp_path / "fifo", 100)  # opening it for reading would wait for a writer
    with pytest.raises(RefusedFile, match="directory"):
        read_regular(tmp_path, 100)
    (tmp_path / "f").write_bytes(b"x" * 101)
    with pytest.raises(RefusedFile, match="101 bytes"):
        read_regular(tmp_path / "f", 100)
    assert read_regular(tmp_path / "f", 101) == b"x" * 101
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 100)


def test_a_bug_in_the_checks_costs_one_model(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from daemon import repository

    real = repository.parse_model_config

    def parse(model_dir: Path, default_slo_ms: float) -> dict[str, object]:
        if model_dir.name == "m":
            raise KeyError("inputs")
        return real(model_dir, default_slo_ms)

    monkeypatch.setattr(repository, "parse_model_config", parse)
    _model(tmp_path, "m")
    _model(tmp_path, "other")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = scan(tmp_path)
    assert _keys(result) == ["other:1"] and "KeyError: 'inputs'" in result.broken["m"]
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.WARNING and record.exc_info is not None  # the traceback, for the bug report
