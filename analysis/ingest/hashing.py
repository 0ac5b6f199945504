"""Content hashes of the files a load reads: sha256, in a thread where the file is large.

The hash decides only whether a file is skipped as already loaded, so a large file is hashed while it loads
(`HashInThread`). The command line starts that hash even earlier (`hash_ahead`), before it imports the rest
of the ingest code: those imports and the kernels' first load hold one core for ~1 s, and the hash (0.6 s of CPU
per 769 MB) runs on the other one meanwhile, where during the load it took a share of the cores the insert
needs. This module imports only the standard library (and limits.py, which does too), so that it can start
before them.
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path
from typing import Sequence

from analysis.ingest.limits import ALONE_BYTES  # standard library only, as this module

# Bytes read per hash update. The hash and the read release the GIL; each return to Python waits for it, up to
# the interpreter's switch interval (5 ms) while another thread runs Python (the imports): with 1 MiB chunks
# that wait, twice per chunk, would dwarf the hash itself; 16 MiB makes it ~0.3 s per GB at worst.
CHUNK = 16 << 20


def content_hash(paths: Sequence[Path], stop: threading.Event | None = None) -> tuple[str, int]:
    """(sha256 hex digest, bytes) of the files' contents in order; `stop` set: gives up (returns what it has)."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as fp:
            while n := fp.readinto(buf):
                h.update(view[:n])  # releases the GIL on chunks this size
                size += n
                if stop is not None and stop.is_set():
                    return h.hexdigest(), size
    return h.hexdigest(), size


class HashInThread:
    """content_hash of a large file in a thread while the file loads: the hash decides only whether the file is
    skipped, and a file of a byte size that no loaded file has cannot have a loaded file's content, so waiting
    for it first (0.6 s per 769 MB, with a core idle) buys nothing. `after`: another hash to let finish first."""

    def __init__(self, paths: Sequence[Path], after: "HashInThread | None" = None):
        self._stop = threading.Event()
        self._result: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(list(paths), after), name="ingest-hash",
                                        daemon=True)
        self._thread.start()

    def _run(self, paths: list[Path], after: "HashInThread | None") -> None:
        if after is not None:
            after._thread.join()
        try:
            self._result = content_hash(paths, self._stop)
        except BaseException as e:  # re-raised by result()
            self._error = e

    def result(self) -> tuple[str, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def close(self) -> None:
        """Stop early (the load failed: the hash is not needed)."""
        self._stop.set()
        self._thread.join()


# hash_ahead's hashes not taken yet: (real path, size, mtime_ns) -> its hash. Each starts once the one before it
# is done, so that they do not compete with each other for the one free core.
_ahead: dict[tuple[str, int, int], HashInThread] = {}
_ahead_lock = threading.Lock()


def _identity(path: Path | str) -> tuple[str, int, int] | None:
    """(real path, size, mtime_ns) of a regular file; None for anything else."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.realpath(path), st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def hash_ahead(paths: Sequence[str | Path], min_bytes: int = ALONE_BYTES) -> None:
    """Start hashing the regular files among `paths` larger than `min_bytes` (folders are left to the load),
    one after another in threads; the load takes each hash with `take_ahead` instead of hashing again."""
    last = None
    for p in paths:
        key = _identity(p)
        if key is not None and key[1] > min_bytes:
            last = HashInThread([Path(p)], after=last)
            with _ahead_lock:
                _ahead[key] = last


def take_ahead(paths: Sequence[Path]) -> HashInThread | None:
    """The hash that hash_ahead started for this one file, if any and if the file has kept its size and time
    since (else None: the caller hashes it)."""
    with _ahead_lock:
        if not _ahead or len(paths) != 1:
            return None
    key = _identity(paths[0])
    with _ahead_lock:
        return _ahead.pop(key, None) if key is not None else None


def cancel_ahead() -> None:
    """Stop the hashes nobody took (files refused before their load began)."""
    with _ahead_lock:
        left = list(_ahead.values())
        _ahead.clear()
    for hasher in left:
        hasher.close()
