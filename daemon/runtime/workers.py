"""The event loop's pool of worker threads for blocking jobs (reading models, warm-ups, profiles).

Python's own ThreadPoolExecutor joins its threads without a time limit twice at exit (the
loop's `shutdown_default_executor` and the interpreter's exit hook), so one job stuck on a hung
device or a dead disk would keep the daemon from ever exiting, past systemd's stop timeout. This
pool's threads are daemon threads, and its shutdown waits a bounded time; what is still stuck
then is reported (`stuck`) and left behind for the process exit to end.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("escapement.workers")

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class WorkerPool(ThreadPoolExecutor):
    """Up to `max_workers` daemon threads, started as jobs come; `shutdown` waits `timeout_s` at most.

    A ThreadPoolExecutor by type only, for asyncio's `set_default_executor` (which takes nothing
    else; uvloop's takes any Executor): `submit` and `shutdown` are its own, the parent's threads
    never start."""

    def __init__(self, max_workers: int = 8, name: str = "worker", timeout_s: float = 5.0) -> None:
        super().__init__(max_workers, thread_name_prefix=name)
        self.max_workers = max_workers
        self.name = name
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is shut down")
            self._jobs.put((fut, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1  # a waiting thread takes it
            elif len(self._workers) < self.max_workers:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._workers)}", daemon=True)
                self._workers.append(t)
                t.start()
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args, kwargs = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as e:  # the caller sees it through the future
                    fut.set_exception(e)
            del job, fut, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the threads of a shut-down pool to end."""
        deadline = time.monotonic() + timeout_s
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))

    @property
    def stuck(self) -> list[str]:
        """Threads still running after shutdown (inside a job that never returned)."""
        return [t.name for t in self._workers if t.is_alive()] if self._closed else []

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._workers:
            self._jobs.put(None)
        if not wait:
            return
        deadline = time.monotonic() + self.timeout_s
        for t in self._workers:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.stuck:
            log.warning("worker threads still inside a job after %.1f s, left behind: %s", self.timeout_s,
                        ", ".join(self.stuck))
