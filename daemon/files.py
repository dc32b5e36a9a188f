"""Reading files a user put in the model repository without being fooled by them.

A model repository is written by people and storage initializers: an entry named like a file
may be a FIFO (opening it would block the scan forever), a socket, a dangling link or a file
growing while it is read. These helpers look at the type first and read at most a limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from daemon.errors import RefusedFile


def file_type(mode: int) -> str:
    """What a stat mode is, in words (for messages)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "of an unknown type"


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file (symlinks followed) of at most `limit` bytes.

    RefusedFile for anything else, OSError when it cannot be opened (missing, permission, a
    symlink loop). O_NONBLOCK keeps the open of a FIFO from waiting for a writer forever, and
    the type is checked on the open descriptor, so a swap after a check cannot slip through.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"{path.name} is {file_type(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise RefusedFile(f"{path.name} is {st.st_size} bytes, more than the {limit} read")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:  # the file may grow while it is read: never take more than limit + 1
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise RefusedFile(f"{path.name} is more than the {limit} bytes read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def file_problem(path: Path) -> str | None:
    """Why `path` cannot be served as a model file (None: it can); stats it, never opens it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"{path.name} is a symbolic link to nothing" if path.is_symlink() else f"{path.name} is missing"
    except OSError as e:  # a symlink loop, a directory we may not enter
        return f"{path.name}: {e.strerror or e}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is {file_type(st.st_mode)}, not a regular file"
    if not os.access(path, os.R_OK):
        return f"{path.name} is not readable (permission denied)"
    return None
