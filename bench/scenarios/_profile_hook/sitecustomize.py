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
