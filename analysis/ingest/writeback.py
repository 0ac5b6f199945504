"""Write a large load's new database pages to disk while it runs, so that its COMMIT does not wait for them all.

DuckDB writes a large insert's blocks to the database file as they fill, where they wait in the OS page cache;
the COMMIT then syncs the file, and waits for all of them at once with the cores idle: 0.24-0.29 s after 40M
token rows (~800 MB), measured alone. Asking the OS to write them every half second, from a thread, while the
insert goes on, left the COMMIT 0.03-0.04 s (benchmarks/RESULTS-scale.md).

The sync goes through DuckDB's own descriptors of the file, found in /proc/self/fd, and never closes one: a
process's POSIX locks on a file go when it closes ANY descriptor of that file, and DuckDB's lock that keeps
other processes from writing the same database is one of them. Without /proc (not Linux) this does nothing.
A descriptor number that DuckDB closed and the OS reused meanwhile is synced too, which does no harm.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

INTERVAL = 0.5  # seconds between syncs


def _descriptors(path: Path) -> list[int]:
    """This process's open descriptors of `path`."""
    want = os.path.realpath(path)
    found = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == want:
                found.append(int(name))
        except (OSError, ValueError):
            continue
    return found


class Writeback:
    """A context: while inside, a thread syncs the database file at `path` every `interval` seconds."""

    def __init__(self, path: Path, interval: float = INTERVAL):
        self.path, self.interval = Path(path), interval
        self.syncs = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Writeback":
        fds = _descriptors(self.path)
        if fds:
            self._thread = threading.Thread(target=self._run, args=(fds[0],), name="ingest-writeback", daemon=True)
            self._thread.start()
        return self

    def _run(self, fd: int) -> None:
        while not self._stop.wait(self.interval):
            try:
                os.fdatasync(fd)  # releases the GIL while the OS writes
            except OSError:
                return
            self.syncs += 1

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
