"""The prediction cache: its key, its bounds, version invalidation, and the gateway's hit path."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from daemon.apps.cache import ENTRY_OVERHEAD, PredictionCache
from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.errors import ConfigError, ModelConfigError
from daemon.gateway import Gateway
from daemon.model import ModelSpec, TensorSpec
from daemon.model_config import parse_model_config
from daemon.request import InferenceRequest, RequestStatus
from tests.support import tiny_config

FP32 = BY_NAME["FP32"]


def spec_of(name: str = "m", version: int = 1, cache: bool = True) -> ModelSpec:
    return ModelSpec(name, version, Path(f"/nowhere/{name}"), "pt2", (TensorSpec("x", FP32, (-1, 2)),),
                     (TensorSpec("a", FP32, (-1, 2)), TensorSpec("b", FP32, (-1, 1))), 8, 1.0,
                     response_cache=cache)


def answer(n: int, value: float = 1.0) -> tuple[np.ndarray, ...]:
    """Outputs of `n` floats in all (two arrays)."""
    return (np.full((1, n - 1), value, np.float32), np.full((1, 1), value, np.float32))


def x(*values: float) -> tuple[np.ndarray, ...]:
    return (np.array([values], np.float32),)


# ------------------------------------------------------------------ the key


def test_key_covers_shape_and_bytes_not_the_array_object() -> None:
    s = spec_of()
    k = PredictionCache.key(s, x(1, 2))
    assert k == PredictionCache.key(s, (np.array([[1, 2]], np.float32)[:, ::1],))
    assert k == PredictionCache.key(s, (np.asfortranarray(np.array([[1, 2]], np.float32)),))
    assert k != PredictionCache.key(s, x(1, 3))
    # the same 16 bytes as two samples of one float pair each vs one sample of four floats
    four = ModelSpec("m", 1, Path("/nowhere/m"), "pt2", (TensorSpec("x", FP32, (-1, 4)),), (), 8, 1.0)
    assert PredictionCache.key(s, (np.array([[1, 2], [3, 4]], np.float32),)) != PredictionCache.key(
        four, (np.array([[1, 2, 3, 4]], np.float32),))
    # the input's name and datatype are part of it
    renamed = dataclasses.replace(s, inputs=(TensorSpec("z", FP32, (-1, 2)),))
    assert PredictionCache.key(renamed, x(1, 2)) != k


def test_bytes_inputs_keep_their_element_boundaries() -> None:
    s = ModelSpec("t", 1, Path("/nowhere/t"), "pt2", (TensorSpec("s", BY_NAME["BYTES"], (-1, 2)),), (), 8, 1.0)
    ab_c = np.array([[b"ab", b"c"]], dtype=object)
    a_bc = np.array([[b"a", b"bc"]], dtype=object)
    assert PredictionCache.key(s, (ab_c,)) != PredictionCache.key(s, (a_bc,))


# ------------------------------------------------------------------ bounds and eviction


def test_bounded_in_bytes_least_recently_used_goes_first() -> None:
    s = spec_of()
    size = ENTRY_OVERHEAD + 100 * 4  # one entry: 100 floats
    cache = PredictionCache(max_bytes=3 * size, max_entries=100, max_entry_bytes=1 << 20)
    keys = [cache.key(s, x(i, i)) for i in range(5)]
    for k in keys[:3]:
        assert cache.get(s, k, 0) is None
        assert cache.put(s, k, answer(100))
    assert cache.bytes == 3 * size
    assert cache.get(s, keys[0], 0) is not None  # 0 is now the most recently used
    assert cache.get(s, keys[3], 0) is None
    cache.put(s, keys[3], answer(100))  # pushes out 1, the least recently used
    assert cache.bytes == 3 * size and cache.evictions == 1
    assert cache.get(s, keys[1], 0) is None
    assert cache.get(s, keys[0], 0) is not None and cache.get(s, keys[2], 0) is not None
    # a larger answer pushes out as many as it needs, and never past the budget
    cache.put(s, keys[4], answer(250))
    assert cache.bytes <= cache.max_bytes
    assert cache.stats().entries == 2 and cache.evictions == 3  # 3 and 0 went; 2, used last, stays
    assert cache.get(s, keys[2], 0) is not None and cache.get(s, keys[0], 0) is None


def test_bounded_in_count_and_oversized_answers_are_not_kept() -> None:
    s = spec_of()
    cache = PredictionCache(max_bytes=1 << 20, max_entries=2, max_entry_bytes=ENTRY_OVERHEAD + 4000)
    for i in range(4):
        k = cache.key(s, x(i, i))
        assert cache.get(s, k, 0) is None
        assert cache.put(s, k, answer(10))
    assert cache.stats().entries == 2 and cache.evictions == 2
    assert not cache.put(s, cache.key(s, x(9, 9)), answer(1001))  # 4,004 bytes of outputs: over max_entry_bytes
    assert cache.stats().entries == 2


def test_stored_answers_are_copies_and_read_only() -> None:
    s = spec_of()
    cache = PredictionCache(1 << 20, 10, 1 << 20)
    k = cache.key(s, x(1, 2))
    cache.get(s, k, 0)
    out = answer(3, 7.0)
    cache.put(s, k, out)
    out[0][...] = 0  # the executor reuses its buffers
    hit = cache.get(s, k, 0)
    assert hit is not None and float(hit[0][0, 0]) == 7.0
    with pytest.raises(ValueError, match="read-only"):
        hit[0][...] = 1


# ------------------------------------------------------------------ versions


def test_a_retired_version_is_dropped_and_cannot_be_stored_again() -> None:
    v1, v2 = spec_of(version=1), spec_of(version=2)
    cache = PredictionCache(1 << 20, 100, 1 << 20)
    k = cache.key(v1, x(1, 2))
    for s in (v1, v2):
        assert cache.get(s, k, 0) is None
        cache.put(s, k, answer(3, float(s.version)))
    assert cache.drop(v1) == 1
    assert cache.stats().entries == 1 and cache.bytes == ENTRY_OVERHEAD + 12
    assert not cache.put(v1, k, answer(3))  # a request of v1 finishing after it was retired
    hit = cache.get(v2, k, 0)
    assert hit is not None and float(hit[0][0, 0]) == 2.0
    assert cache.evictions == 0  # invalidation is not eviction


def test_a_version_reloaded_under_the_same_number_starts_empty() -> None:
    old = spec_of()
    new = dataclasses.replace(old)  # the same name and version, read again from changed files
    cache = PredictionCache(1 << 20, 100, 1 << 20)
    k = cache.key(old, x(1, 2))
    cache.get(old, k, 0)
    cache.put(old, k, answer(3))
    assert cache.get(new, k, 0) is None
    assert cache.stats().entries == 0 and cache.bytes == 0
    assert not cache.put(old, k, answer(3))


# ------------------------------------------------------------------ config


def test_model_config_opt_in(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.toml").write_text(tiny_config())
    assert parse_model_config(d, 100.0)["response_cache"] is False
    (d / "config.toml").write_text(tiny_config() + "[response_cache]\nenabled = true\n")
    assert parse_model_config(d, 100.0)["response_cache"] is True
    for bad, needle in [("response_cache = true\n", "must be a table"),
                        ("[response_cache]\nenable = true\n", "unknown keys in \\[response_cache\\]"),
                        ("[response_cache]\nenabled = 1\n", "expected true or false")]:
        (d / "config.toml").write_text(bad + tiny_config() if "[" not in bad else tiny_config() + bad)
        with pytest.raises(ModelConfigError, match=needle):
            parse_model_config(d, 100.0)


def test_daemon_cache_settings() -> None:
    assert settings_from_dict({"cache": {"bytes": "1MiB"}}).cache.bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"cache\.bytes"):
        settings_from_dict({"cache": {"bytes": "lots"}})
    with pytest.raises(ConfigError, match=r"cache\.entries"):
        settings_from_dict({"cache": {"entries": -1}})


# ------------------------------------------------------------------ the gateway's path


class CountingController:
    """Answers every request with outputs derived from its input (x + the run count), at once."""

    def __init__(self) -> None:
        self.runs = 0
        self.reconstruct = False

    def submit(self, req: InferenceRequest) -> None:
        self.runs += 1
        a = req.inputs[0] + self.runs
        req.outputs = (a, a[:, :1].copy())
        req.reconstructed = self.reconstruct
        req.status = RequestStatus.SUCCEEDED
        assert req.on_finish is not None
        req.on_finish(req)

    def cancel(self, req: InferenceRequest) -> None:
        raise AssertionError("nothing to cancel")


def gateway(spec: ModelSpec, ctl: CountingController, cache_bytes: str = "1MiB") -> Gateway:
    catalog = ModelCatalog()
    catalog.add(spec, ModelState.READY)
    return Gateway(settings_from_dict({"cache": {"bytes": cache_bytes}}), catalog, ctl)


def ask(gw: Gateway, spec: ModelSpec, *values: float) -> InferenceRequest:
    got: list[InferenceRequest] = []
    req = gw.new_request(spec, x(*values), 1, None, None, "")
    req.on_finish = got.append
    gw.submit(req)
    (done,) = got
    return done


def test_a_repeat_is_answered_without_the_controller_and_flagged() -> None:
    spec, ctl = spec_of(), CountingController()
    gw = gateway(spec, ctl)
    first = ask(gw, spec, 1, 2)
    again = ask(gw, spec, 1, 2)
    assert ctl.runs == 1 and not first.cached and again.cached and again.ok
    assert [a.tobytes() for a in again.outputs or ()] == [a.tobytes() for a in first.outputs or ()]
    assert not ask(gw, spec, 1, 3).cached and ctl.runs == 2
    v = gw.cache.version_stats(spec)  # what Triton's statistics report as cache_hit / cache_miss
    assert v is not None and (v.hits, v.misses) == (1, 2) and v.hit_ns > 0 and v.miss_ns > 0


def test_without_the_opt_in_or_the_budget_nothing_is_cached() -> None:
    ctl = CountingController()
    off = spec_of(cache=False)
    gw = gateway(off, ctl)
    assert not ask(gw, off, 1, 2).cached and not ask(gw, off, 1, 2).cached and ctl.runs == 2
    assert gw.cache.stats().misses == 0  # not even looked up
    on = spec_of()
    gw = gateway(on, ctl, cache_bytes="0")
    assert not ask(gw, on, 1, 2).cached and not ask(gw, on, 1, 2).cached


def test_reconstructed_answers_are_not_kept() -> None:
    spec, ctl = spec_of(), CountingController()
    ctl.reconstruct = True
    gw = gateway(spec, ctl)
    ask(gw, spec, 1, 2)
    assert not ask(gw, spec, 1, 2).cached and ctl.runs == 2


def test_requests_over_max_entry_bytes_are_not_hashed() -> None:
    spec, ctl = spec_of(), CountingController()
    catalog = ModelCatalog()
    catalog.add(spec, ModelState.READY)
    gw = Gateway(settings_from_dict({"cache": {"max_entry_bytes": 1024}}), catalog, ctl)
    big = (np.ones((129, 2), np.float32),)  # 1,032 input bytes
    for _ in range(2):
        req = gw.new_request(spec, big, 129, None, None, "")
        req.on_finish = lambda r: None
        gw.submit(req)
        assert not req.cached
    assert ctl.runs == 2 and gw.cache.stats().misses == 0
