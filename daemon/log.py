"""Logging: one line per event to stderr (journald adds its own timestamps under systemd).

Named loggers per subsystem, all under `escapement` (`server.log_level` sets the level of all):
- frontends: .http, .grpc, .socket, .gateway, .workers (frontend worker processes)
- the daemon: .server (lifecycle, model versions), .notify (systemd), .repository (the scan)
- the controller and runtime: .controller, .executor, .runtime, .devices, .cuda, .profile
- applications: .apps, .appdb, .personal, .userdb
- tools: .parity (train-parity), .demo (the demo repository builder)
"""

from __future__ import annotations

import logging
import os
import sys


def setup(level: str = "info") -> None:
    under_journald = bool(os.environ.get("JOURNAL_STREAM"))
    fmt = "%(levelname)s %(name)s: %(message)s" if under_journald else \
        "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    root = logging.getLogger("escapement")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
