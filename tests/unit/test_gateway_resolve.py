"""Gateway.resolve remembers specs per catalog object and generation, never an error, and is bounded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from daemon.catalog import ModelCatalog, ModelState
from daemon.config import settings_from_dict
from daemon.datatypes import BY_NAME
from daemon.errors import NotFound, Unavailable
from daemon.gateway import RESOLVED_MAX, Gateway
from daemon.model import ModelSpec, TensorSpec

FP32 = BY_NAME["FP32"]


def spec_of(version: int = 1) -> ModelSpec:
    return ModelSpec("m", version, Path("/nowhere/m"), "pt2", (TensorSpec("x", FP32, (-1, 2)),),
                     (TensorSpec("y", FP32, (-1, 2)),), 8, 1.0)


class NoController:
    def submit(self, req: object) -> None:
        raise AssertionError("not used")

    def cancel(self, req: object) -> None:
        raise AssertionError("not used")


def gateway(catalog: ModelCatalog) -> Gateway:
    return Gateway(settings_from_dict({}), catalog, NoController())  # type: ignore[arg-type]


def test_follows_every_catalog_change() -> None:
    catalog = ModelCatalog()
    v1 = spec_of(1)
    catalog.add(v1, ModelState.READY)
    gw = gateway(catalog)
    assert gw.resolve("m", None) is v1
    assert gw.admit("m", "1") is v1
    catalog.set_state(v1, ModelState.UNAVAILABLE)
    with pytest.raises(Unavailable):
        gw.resolve("m", None)
    reloaded = dataclasses.replace(v1)
    catalog.add(reloaded, ModelState.READY)  # reloaded under the same number
    assert gw.resolve("m", 1) is reloaded


def test_a_replaced_catalog_at_the_same_generation_is_read_afresh() -> None:
    # a frontend worker swaps its replica whole; the new one may have the same generation number
    first, second = ModelCatalog(), ModelCatalog()
    a, b = spec_of(1), spec_of(1)
    first.add(a, ModelState.READY)
    second.add(b, ModelState.READY)
    assert first.generation == second.generation
    gw = gateway(first)
    assert gw.resolve("m", None) is a
    gw.catalog = second
    assert gw.resolve("m", None) is b


def test_errors_are_not_remembered_and_spellings_are_bounded() -> None:
    catalog = ModelCatalog()
    v1 = spec_of(1)
    gw = gateway(catalog)
    with pytest.raises(NotFound):
        gw.resolve("m", None)
    catalog.add(v1, ModelState.READY)
    assert gw.resolve("m", None) is v1
    for i in range(RESOLVED_MAX + 50):
        assert gw.resolve("m", "0" * i + "1") is v1
    assert len(gw._resolved) == RESOLVED_MAX  # noqa: SLF001 (the bound is what is tested)
