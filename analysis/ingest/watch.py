"""Follow log folders while a trainer writes them: load each file once it is complete, one Outcome per file.

    w = FolderWatcher(store, ["drift_logs"])
    w.run(stop_event, report=lambda o: print(o.line()))   # or call w.poll() on your own timer

Polling, not inotify (watchdog): training logs mostly live on NFS or Lustre, where a file written by another
machine raises no inotify event on this one, so an event-based watcher silently sees nothing. A `stat` of each
file per poll works on every filesystem and costs 19–55 µs a file (benchmarks/RESULTS-live.md).

A file is complete when it has looked the same (size and modification time) on polls at least `settle` seconds
apart. Hidden names (`.name.tmp`, which DriftLogger writes before renaming into place) are never read. A file
refused once is not tried again until it changes, with one exception: a routing file refused because its tokens are
not loaded yet (the writer may finish it first) is tried again, unreported, after each poll that loads a file, until
it loads or changes. A file that looks like no log at all is passed over, as a folder ingest does. Restarting loses nothing: every file is considered again and the content hash already in the
database skips what was loaded.
"""
from __future__ import annotations

import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from analysis.ingest import Outcome, ingest_paths, open_store
from analysis.ingest.errors import NotALogFile, OrphanRouting
from analysis.ingest.load import internal_error
from analysis.store import Store, StoreError

if TYPE_CHECKING:
    import polars as pl

# Files in a log folder that are never log files: the run's own config (read with each file), notes, and a
# database kept next to the logs with its write-ahead log. Names that editors and copy tools use while writing
# are skipped too: they are renamed once complete.
SKIP_NAMES = {"run.json", "README.md", "STABLE"}
SKIP_SUFFIXES = (".duckdb", ".wal", ".tmp", ".part", ".partial", ".crdownload", ".swp", "~")

Signature = tuple[int, int]  # (size, mtime_ns): a file that keeps both for `settle` seconds is complete


def followable(name: str) -> bool:
    """Whether a file (or folder) with this name may be read: not hidden, not temporary, not the database."""
    return not name.startswith(".") and name not in SKIP_NAMES and not name.endswith(SKIP_SUFFIXES)


def scan(folders: Iterable[Path]) -> dict[str, Signature]:
    """Every followable regular file under `folders` (its path as a string: a Path per file per poll would cost
    more than its stat) with its signature. Hidden folders are not entered, nor symlinked ones (no cycles); a
    file that vanishes between listing and stat is left out."""
    found: dict[str, Signature] = {}
    stack = [str(f) for f in folders]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # not there (yet), or not a folder
            continue
        for entry in entries:
            if not followable(entry.name):
                continue
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                st = entry.stat()
            except OSError:
                continue
            if st.st_size and stat.S_ISREG(st.st_mode):
                found[entry.path] = (st.st_size, st.st_mtime_ns)
    return found


@dataclass
class _Pending:
    signature: Signature
    since: float  # monotonic time this signature was first seen


class FolderWatcher:
    """Loads complete new files from `folders` into `store`, each through `ingest_paths` (one transaction each).

    Not thread-safe: one thread polls. `store` may be shared with readers (Store serialises its writes)."""

    def __init__(self, store: Store, folders: Sequence[str | Path], run: str | None = None, settle: float = 1.0,
                 ingest: Callable[..., list[Outcome]] = ingest_paths, clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.folders = [Path(f) for f in folders]
        self.run = run
        self.settle = settle
        self.ingest = ingest
        self.clock = clock
        self._pending: dict[str, _Pending] = {}
        self._done: dict[str, Signature] = {}  # loaded, skipped, refused or not a log: until it changes
        self._early: set[str] = set()  # of those, routing refused for tokens not loaded yet: retried after loads
        self.runs: set[str] = set()  # runs that got rows from a file this watcher loaded

    def missing_folders(self) -> list[Path]:
        return [f for f in self.folders if not f.is_dir()]

    def ready(self) -> list[Path]:
        """Files that have kept their signature for `settle` seconds and were not handled in that state, oldest
        first (a trainer's tokens shard is written before the routing shard that refers to it)."""
        now = self.clock()
        seen = scan(self.folders)
        ready = []
        for path, sig in seen.items():
            if self._done.get(path) == sig:
                continue
            pending = self._pending.get(path)
            if pending is None or pending.signature != sig:
                self._pending[path] = _Pending(sig, now)
            elif now - pending.since >= self.settle:
                ready.append(path)
        for path in set(self._pending) - set(seen):  # deleted or renamed away before it settled
            del self._pending[path]
        for path in set(self._done) - set(seen):  # gone: memory stays bounded by the files present
            del self._done[path]
        self._early &= {p for p, sig in self._done.items() if seen.get(p) == sig}  # changed files start afresh
        return [Path(p) for p in sorted(ready, key=lambda p: (seen[p][1], p))]

    def poll(self, report: Callable[[Outcome], None] | None = None,
             stop: threading.Event | None = None) -> list[Outcome]:
        """Load what is ready now, one file at a time; each Outcome goes to `report` as soon as it is known, and
        all are returned (files that are no log at all are passed over silently)."""
        outcomes = []
        ready = self.ready()
        for path in ready:
            if stop is not None and stop.is_set():
                return outcomes  # the rest stays pending; a restart finds it again
            self._done[str(path)] = self._pending.pop(str(path)).signature
            outcomes += self._handle(path, report, retry=False)
        if any(o.status == "loaded" for o in outcomes):  # tokens may have come for routing refused earlier
            for path in sorted(self._early):
                if stop is not None and stop.is_set():
                    break
                outcomes += self._handle(Path(path), report, retry=True)
        return outcomes

    def _handle(self, path: Path, report: Callable[[Outcome], None] | None, retry: bool) -> list[Outcome]:
        """Load one file; its outcomes, reported unless a retry of early routing is refused again."""
        out = []
        for outcome in self._load(path):
            early = outcome.status == "refused" and outcome.rule == OrphanRouting.rule
            if early:
                self._early.add(str(path))
                if retry:
                    continue  # said once already
                outcome.message += "; it will be tried again as more files load"
            else:
                self._early.discard(str(path))
            if outcome.status == "loaded":
                self.runs = self.runs | set(outcome.runs)  # a new set: the app's pages read it meanwhile
            out.append(outcome)
            if report is not None:
                report(outcome)
        return out

    def _load(self, path: Path) -> list[Outcome]:
        try:
            outcomes = self.ingest(self.store, [path], run=self.run)
        except Exception as e:  # a bug outside the per-file guard of ingest: reported as one, and the watcher goes on
            return [internal_error(path.name, e)]
        # A file that is no log at all (a checkpoint's notes, a plot) is passed over as a folder ingest does.
        return [o for o in outcomes if o.rule != NotALogFile.rule]

    def run_forever(self, stop: threading.Event, interval: float = 1.0,
                    report: Callable[[Outcome], None] = lambda o: None) -> None:
        """Poll every `interval` seconds until `stop` is set; each Outcome goes to `report` as it comes."""
        while True:
            self.poll(report, stop)
            if stop.wait(interval):
                return


def follow(db: str | Path, folders: Sequence[str | Path], run: str | None = None, interval: float = 1.0,
           settle: float | None = None, out=None, err=None) -> int:
    """The `python -m analysis watch` command: load what is in `folders`, then each new complete file, printing
    one line per file as `ingest` does, until SIGINT (Ctrl-C) or SIGTERM; the database is closed on the way out."""
    import signal
    import sys
    out = out or sys.stdout
    err = err or sys.stderr
    files = [str(f) for f in folders if Path(f).is_file()]
    if files:
        print(f"error: {', '.join(files)}: watch follows folders; load single files with `ingest`", file=err)
        return 2
    interval = max(0.05, interval)
    stop = threading.Event()

    def on_signal(signum, frame):
        if stop.is_set():  # a second Ctrl-C: stop now (the file being loaded rolls back, a restart redoes it)
            raise KeyboardInterrupt
        stop.set()

    try:  # before the handlers: a database held by another process is an error, not a wait
        store = open_store(db)
    except StoreError as e:
        raise StoreError(f"{e}\n(one process at a time may write a DuckDB file: if the app has it open, let the "
                         f"app follow the folders instead, with DRIFT_WATCH_DIRS; see README, Live runs)") from None
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        watcher = FolderWatcher(store, folders, run=run, settle=interval if settle is None else max(0.0, settle))
        for folder in watcher.missing_folders():
            print(f"waiting for {folder} to appear", file=err, flush=True)
        print(f"watching {', '.join(map(str, watcher.folders))} every {interval:g} s into {store.path} "
              "(Ctrl-C stops)", file=err, flush=True)

        def report(outcome: Outcome) -> None:
            print(outcome.line(), file=err if outcome.status == "refused" else out, flush=True)

        watcher.run_forever(stop, interval, report)
    except KeyboardInterrupt:
        pass
    finally:
        store.close()
        for s, handler in old.items():
            signal.signal(s, handler)
    print("stopped", file=err, flush=True)
    return 0


def last_files(store: Store, runs: Sequence[str]) -> "pl.DataFrame":
    """[run, last_step, last_file_at]: each run's highest step and when its most recent file was loaded, in
    UNIX seconds. `files.loaded_at` is a local time without zone; its distance to the database's local now,
    taken from the database's UTC now, gives a time that compares with `time.time()` in any time zone.

    Read from summary_step, which every token, routing and DriftLogger summary file adds rows to: a step whose
    summary file landed before its token rows (or a logger at token_sample=0, which writes no token rows) counts,
    as it does in the charts, and the query reads a row per (step, file) rather than every token."""
    return store.sql("""
        SELECT t.run, max(t.step) AS last_step,
               epoch_ms(now()) / 1000.0
                 - date_diff('millisecond', max(f.loaded_at), current_localtimestamp()) / 1000.0 AS last_file_at
        FROM summary_step t JOIN files f USING (file_id)
        WHERE t.run IN (SELECT unnest(?::VARCHAR[]))
        GROUP BY t.run ORDER BY t.run""", [list(runs)])
