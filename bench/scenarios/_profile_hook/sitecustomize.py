"""Loaded by every Python process started with this folder on PYTHONPATH (bench/scenarios/ingest_profile.py):
with ESCAPEMENT_CPROFILE=DIR, SIGUSR1 starts a cProfile of the main thread timed by its CPU clock
(time.thread_time: a preempted thread accrues nothing) and SIGUSR2 stops it and writes DIR/PID.prof."""

import os

_dir = os.environ.get("ESCAPEMENT_CPROFILE")
if _dir:
    import cProfile
    import signal
    import time

    _prof = cProfile.Profile(time.thread_time)

    def _start(*_: object) -> None:
        _prof.enable()

    def _stop(*_: object) -> None:
        _prof.disable()
        _prof.dump_stats(os.path.join(_dir, f"{os.getpid()}.prof"))

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)

# With ESCAPEMENT_TIMERS=DIR and ESCAPEMENT_TIMED="module:Class.method,module:function,...": each
# named function is wrapped (on first import of its module, by a hook on the daemon's start) with an
# inclusive timer (perf_counter_ns: the loop's synchronous calls, so wall time is its CPU time);
# SIGUSR1 zeroes the counts, SIGUSR2 writes DIR/PID.timers.json (calls and ns per function).
_tdir = os.environ.get("ESCAPEMENT_TIMERS")
if _tdir:
    import functools
    import importlib
    import json
    import signal
    import time

    _counts: dict[str, list[int]] = {}

    from collections.abc import Callable
    from typing import Any

    def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        cell = _counts.setdefault(name, [0, 0])
        clock = time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cell[0] += 1
                cell[1] += clock() - t0
        return timed

    def _install() -> None:
        for target in os.environ.get("ESCAPEMENT_TIMED", "").split(","):
            mod_name, _, attr = target.strip().partition(":")
            if not attr:
                continue
            owner = importlib.import_module(mod_name)
            *path, last = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, last, _wrap(target.strip(), getattr(owner, last)))

    def _zero(*_: object) -> None:
        for cell in _counts.values():
            cell[0] = cell[1] = 0

    def _dump(*_: object) -> None:
        with open(os.path.join(_tdir, f"{os.getpid()}.timers.json"), "w") as f:
            json.dump({k: {"calls": c, "ns": ns} for k, (c, ns) in _counts.items()}, f)

    signal.signal(signal.SIGUSR1, _zero)
    signal.signal(signal.SIGUSR2, _dump)
    _install()  # (the tree is on PYTHONPATH beside this folder: the daemon's modules import here)
