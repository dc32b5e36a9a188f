from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from daemon.config import (
    Settings,
    default_config_text,
    describe,
    load_settings,
    parse_size,
    settings_from_dict,
    with_overrides,
)
from daemon.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_default_is_config_file_and_equals_builtin_defaults() -> None:
    assert default_config_text() == (ROOT / "config" / "escapement.toml").read_text()
    assert load_settings() == Settings()


def test_default_file_states_every_setting() -> None:
    def keys(table: dict[str, Any], prefix: str) -> set[str]:
        out: set[str] = set()
        for k, v in table.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out

    stated = keys(tomllib.loads(default_config_text()), "")
    assert stated == {key for key, _, _ in describe()}


def test_every_setting_is_documented() -> None:
    for key, _default, doc in describe():
        assert doc and len(doc) > 10, key


@pytest.mark.parametrize(("data", "needle"), [
    ({"server": {"htp": "x"}}, "unknown setting server.htp"),
    ({"bogus": {}}, "unknown setting bogus"),
    ({"server": {"max_connections": "many"}}, "server.max_connections = 'many': expected an integer"),
    ({"server": {"max_connections": 0}}, "server.max_connections = 0"),
    ({"server": {"http": "localhost"}}, "server.http = 'localhost': expected HOST:PORT"),
    ({"server": {"log_level": "loud"}}, "server.log_level = 'loud': expected one of"),
    ({"server": {"socket_mode": "999"}}, "server.socket_mode = '999'"),
    ({"runtime": {"devices": ["gpu0"]}}, "runtime.devices = 'gpu0'"),
    ({"runtime": {"devices": "cpu:0"}}, "runtime.devices = 'cpu:0': expected a list"),
    ({"runtime": {"devices": ["cpu:0", "cpu:0"]}}, "listed twice"),
    ({"runtime": {"weight_budget": "lots"}}, "runtime.weight_budget: cannot read 'lots' as a size"),
    ({"runtime": {"cpu_threads": True}}, "runtime.cpu_threads = True: expected an integer"),
    ({"controller": {"policy": "fifo"}}, "controller.policy = 'fifo'"),
    ({"controller": {"max_queue_delay_ms": -1}}, "controller.max_queue_delay_ms = -1.0"),
    ({"models": {"default_slo_ms": 0}}, "models.default_slo_ms = 0.0"),
    ({"server": "x"}, "server: expected a table"),
    ({"server": {"drain_timeout_s": -1}}, "server.drain_timeout_s = -1.0"),
    ({"server": {"shed_lag_ms": -5}}, "server.shed_lag_ms = -5.0"),
    ({"server": {"max_request_id_bytes": 8}}, "server.max_request_id_bytes = 8"),
    ({"server": {"max_inflight_per_connection": 0}}, "server.max_inflight_per_connection = 0"),
    ({"server": {"idle_timeout_s": 0}}, "server.idle_timeout_s / write_timeout_s"),
    ({"server": {"write_timeout_s": -1}}, "server.idle_timeout_s / write_timeout_s"),
    ({"server": {"request_memory_bytes": "1MiB"}}, "server.request_memory_bytes"),
    ({"server": {"max_json_bytes": 100}}, "server.max_json_bytes = 100"),
    ({"runtime": {"hung_action_s": 0}}, "runtime.hung_action_s = 0.0"),
    ({"runtime": {"warmup_timeout_s": 0.5}}, "runtime.warmup_timeout_s = 0.5"),
    ({"faults": [{"device": "cpu:0", "add_ms": float("nan")}]}, "faults for cpu:0: add_ms = nan"),
])
def test_bad_settings_name_key_and_value(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict(data)
    assert needle in str(exc.value)


def test_sizes() -> None:
    assert parse_size("64MiB", "k") == 64 * 2**20
    assert parse_size("2GB", "k") == 2 * 10**9
    assert parse_size(1234, "k") == 1234
    assert parse_size("1.5KiB", "k") == 1536
    with pytest.raises(ConfigError):
        parse_size(-1, "k")


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text("[server]\nhttp = \n")
    with pytest.raises(ConfigError, match=r"x.toml: not valid TOML"):
        load_settings(bad)
    bad.write_text("[server]\nnope = 1\n")
    with pytest.raises(ConfigError, match=r"x.toml: unknown setting server.nope"):
        load_settings(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.toml")


def test_cli_overrides_are_validated_and_applied() -> None:
    s = with_overrides(Settings(), http="0.0.0.0:9000", socket="", models="/srv/m", devices=["cpu:0,cpu:1"])
    assert s.server.http == "0.0.0.0:9000"
    assert s.server.socket == ""
    assert s.models.repository == "/srv/m"
    assert s.runtime.devices == ("cpu:0", "cpu:1")
    with pytest.raises(ConfigError, match=r"server\.http"):
        with_overrides(Settings(), http="nope")


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().server.http = "x"  # type: ignore[misc]


def test_lag_tracker_flags_overload_and_recovers() -> None:
    from daemon.overload import LagTracker

    t = LagTracker(0.025, alpha=0.5)
    t.observe(1.000, 1.001)
    assert not t.overloaded
    t.observe(1.010, 1.050)  # one tick 40 ms late: a stall, not yet overload
    assert not t.overloaded and t.max_s == pytest.approx(0.04)
    t.observe(1.060, 1.100)  # and another: the smoothed lag is over the threshold
    assert t.overloaded
    for i in range(8):  # on time again: the smoothed lag decays and the flag clears
        t.observe(2.0 + i, 2.0 + i)
    assert not t.overloaded
    t.observe(3.0, 3.150)  # one stall of 150 ms (over 4x the threshold): overloaded at once
    assert t.overloaded
    assert not LagTracker(0.0).overloaded  # 0 disables
