"""systemd's notify protocol (sd_notify), without libsystemd.

Under `Type=notify` systemd passes the path of an AF_UNIX datagram socket in $NOTIFY_SOCKET
(a file path, or an abstract name written with a leading '@'); the service sends it
newline-separated `KEY=value` assignments: READY=1 once it serves, STATUS=... for
`systemctl status`, RELOADING=1 (with MONOTONIC_USEC) and READY=1 around a reload,
STOPPING=1 on shutdown, and WATCHDOG=1 keep-alives when $WATCHDOG_USEC is set.

Outside systemd (no $NOTIFY_SOCKET) every call does nothing. Sending never blocks the event
loop and never raises: the socket is non-blocking, and a message systemd cannot take (its
queue full, the socket gone) is dropped with one warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger("escapement.notify")


def _address(raw: str) -> str | None:
    """The socket address for $NOTIFY_SOCKET, or None if it is not one we can use."""
    if raw.startswith("@"):
        return "\0" + raw[1:]  # Linux abstract namespace
    if raw.startswith("/"):
        return raw
    return None  # systemd >= 254 also offers vsock: addresses, for VMs; not ours to serve


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings, half of $WATCHDOG_USEC as systemd recommends; None when
    the watchdog is off or meant for another process ($WATCHDOG_PID)."""
    env = os.environ if environ is None else environ
    usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
    if not usec:
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer: watchdog off", usec)
        return None
    if value <= 0:
        return None
    if pid:
        try:
            if int(pid) != os.getpid():
                return None  # set for our parent (a wrapper), not for us
        except ValueError:
            log.warning("WATCHDOG_PID=%r is not an integer: watchdog off", pid)
            return None
    return value / 2e6


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in µs, the clock systemd compares MONOTONIC_USEC against."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends notify messages to one socket; a no-op without one."""

    def __init__(self, notify_socket: str | None, watchdog_s: float | None = None) -> None:
        self.address = _address(notify_socket) if notify_socket else None
        # seconds between keep-alives; only with a socket to send them to
        self.watchdog_s = watchdog_s if self.address is not None else None
        if notify_socket and self.address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path or '@' name: not notifying systemd",
                        notify_socket)
        self._sock: socket.socket | None = None
        self._warned = False
        self.sent = 0  # messages delivered, for tests and statistics

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET") or None, watchdog_interval(env))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=value` assignments as one datagram; True if systemd got it."""
        if self.address is None:
            return False
        data = "\n".join(a.replace("\n", " ") for a in assignments).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)  # on the event loop: drop rather than wait
            self._sock.sendto(data, self.address)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot notify systemd at %s: %s (further failures are not logged)",
                            self.address.replace("\0", "@"), e)
            return False
        self.sent += 1
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def reloading(self, status: str | None = None) -> bool:
        # MONOTONIC_USEC tells systemd which reload this is (it needs it to match a later READY=1)
        return self.send("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}",
                         *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def keep_alive(notifier: Notifier, interval_s: float,
                     trouble: Callable[[], str | None] | None = None) -> None:
    """Ping the watchdog every `interval_s` until cancelled, or until `trouble()` names a reason.

    It runs as a task on the event loop itself, not on a thread: a loop that stalls (a blocking
    call, a livelock) stops the pings, and systemd then restarts the daemon. A daemon whose loop
    runs but which cannot recover by itself (a device hung in a thread that never returns) stops
    them on purpose, for the same restart; the reason goes to the log and to STATUS=.
    """
    while True:
        why = trouble() if trouble is not None else None
        if why is not None:
            log.critical("stopping the systemd watchdog keep-alives so that the service is restarted: %s", why)
            notifier.status(f"restart wanted: {why}")
            return
        notifier.watchdog()
        await asyncio.sleep(interval_s)
