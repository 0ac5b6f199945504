"""Start writing a database file's new pages to disk while a large load goes on, without waiting for them.

DuckDB writes the row groups of a large INSERT into the database file as they fill, and the kernel holds them as
dirty pages until the COMMIT's fdatasync, which then waits for every one of them on the main thread after the
last row: 0.28 s of the 40M-token benchmark's tokens file and 0.05 s of its routing file
(benchmarks/RESULTS-scale.md). `Writeback.start` asks the kernel to begin writing what is dirty now
(Linux `sync_file_range` with SYNC_FILE_RANGE_WRITE: it queues the writes and returns), so the writes overlap
the load and the COMMIT waits for the last ones only. It writes nothing DuckDB would not write, and what is
durable when stays DuckDB's COMMIT's business. Elsewhere than Linux it does nothing.

The descriptor is our own, opened read-only on the database path, and it must stay open until DuckDB has
closed the file: closing any descriptor of a file drops every POSIX record lock the process holds on it, and
DuckDB's lock on the database file is one (a second process could then open the database for writing). So
`Store` closes it after its connection (tests/test_writeback.py checks the lock).
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

_WRITE = 2  # SYNC_FILE_RANGE_WRITE (linux/fs.h)


def _sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


class Writeback:
    """A read-only descriptor of the file at `path`, for `start`; `close` it only after DuckDB closed the file."""

    def __init__(self, path: Path):
        self._fd: int | None = os.open(path, os.O_RDONLY) if _SYNC_FILE_RANGE is not None else None

    def start(self) -> bool:
        """Ask the kernel to start writing the file's dirty pages (the whole file); returns at once, with whether
        the kernel took the request. A refusal (an odd file system) only means the COMMIT writes them, as it
        would anyway."""
        return self._fd is not None and _SYNC_FILE_RANGE(self._fd, 0, 0, _WRITE) == 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
