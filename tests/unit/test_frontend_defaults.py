"""How many frontend worker processes `server.frontend_workers = -1` starts (daemon/frontends.py)."""

from __future__ import annotations

from daemon.frontends import default_workers


def test_one_core_keeps_one_process_and_more_cores_get_a_quarter_at_least_one() -> None:
    assert default_workers(1) == 0  # a worker would only take turns with the loop
    assert default_workers(2) == 1  # HTTP JSON decoding off the loop's GIL (bench/results/peers-gap)
    assert default_workers(4) == 1
    assert default_workers(16) == 4
    assert default_workers(128) == 32
