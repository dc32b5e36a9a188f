"""A lane's wake-up (daemon/runtime/executor.py `_Wakeup`): a condition with one waiter over C
locks. A notify wakes the waiting lane thread; a wait that timed out leaves no stale signal behind,
even when a notify comes between its timeout and its taking the lock back (the next wait would
then return at once and the lane spin)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from daemon.runtime.executor import _Wakeup


def _notify_once_waiting(w: _Wakeup, ready: threading.Event, lane: Callable[[], None]) -> threading.Thread:
    """Run `lane` on a thread; once it says it holds the lock and is about to wait, notify under
    the lock (taken only once its wait released it); its thread, joined."""
    t = threading.Thread(target=lane)
    t.start()
    ready.wait()
    with w.lock:
        w.notify()
    t.join(10.0)
    return t


def test_a_timed_wait_without_notify_returns_holding_the_lock() -> None:
    w = _Wakeup()
    with w.lock:
        w.wait(0.001)
        assert w.lock.locked()
    assert w._signal.locked()  # noqa: SLF001  (no signal pending)


def test_a_notify_wakes_the_waiting_thread() -> None:
    w = _Wakeup()
    ready = threading.Event()
    woke: list[bool] = []

    def lane() -> None:
        with w.lock:
            ready.set()  # (set holding the lock: the notifier gets it only once the wait released it)
            w.wait()  # no timeout: only a notify ends it
            woke.append(True)

    assert not _notify_once_waiting(w, ready, lane).is_alive()
    assert woke == [True]
    assert w._signal.locked()  # noqa: SLF001


def test_a_notify_between_a_timeout_and_the_lock_leaves_no_stale_signal() -> None:
    """The window no thread timing can force: a wait timed out, a notify came before the wait
    took the lock back. Played in order on one thread."""
    w = _Wakeup()
    with w.lock:
        w._waiting = True  # noqa: SLF001  (a wait began and released the lock)
        w.notify()  # its timeout passed; a notifier took the lock and released the signal
        w._settle()  # noqa: SLF001  (the wait takes the lock back)
        assert w._signal.locked() and not w._waiting  # noqa: SLF001  (nothing left for the next wait)
        w.notify()  # nobody waits now: not kept either
        assert w._signal.locked()  # noqa: SLF001


def test_a_notify_with_no_waiter_is_not_kept() -> None:
    w = _Wakeup()
    with w.lock:
        w.notify()  # nobody waits: a lane checks its state under the lock before it waits
    assert w._signal.locked()  # noqa: SLF001
