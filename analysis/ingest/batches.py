"""Several small files per transaction, with the all-or-nothing guarantee of one transaction per file.

A run logged by DriftLogger is two small files per step (1,000 steps: 2,000 files of ~0.5 MB). Loaded one
transaction each, the fixed costs of a file dominate: the COMMIT (a WAL fsync), the catalog look-ups and one
INSERT per summary table. So files up to ALONE_BYTES share a transaction, up to BATCH_FILES files or BATCH_BYTES
of input, and the summary rows of the files of a transaction are inserted together at its end.

DuckDB has no savepoints, so a file refused inside a shared transaction cannot be undone alone: the whole
transaction rolls back and the files loaded before it in that transaction are loaded again, without it, in a new
one. They were loaded once on the same database state, so they load again the same way; the database ends as
one transaction per file would have left it, and a refusal costs at most BATCH_BYTES of re-reading. A failure
of the COMMIT itself (or of the final summary INSERT) cannot be pinned on one file: then each file of the
transaction is loaded again in a transaction of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa

from analysis.ingest.limits import ALONE_BYTES
from analysis.ingest.units import Outcome, Unit
from analysis.store import Store, Writer

# Caps of one shared transaction: input bytes (bounds the work a refusal repeats) and files.
BATCH_BYTES = 64 << 20
BATCH_FILES = 256
# Summary rows held in Python before they are inserted (a few tens of MB; flushed earlier when reached).
PENDING_ROWS = 100_000
PENDING_HASH = "(hashing)"  # files.sha256 of a file whose hash is computed while it loads (set before COMMIT)


class FailedAtEnd(Exception):
    """The transaction's final work (the summary INSERTs, the COMMIT) failed: no single file is to blame."""


@dataclass
class Transaction:
    """One open transaction shared by several files, and what it saves them from asking again."""
    store: Store
    w: Writer
    loaded: set[tuple[str, str | None]] = field(default_factory=set)  # (sha256, run override) in `files`
    runs: set[str] = field(default_factory=set)  # runs in `runs`
    sizes: set[int] = field(default_factory=set)  # byte sizes of the files in `files`
    new_run: bool = False  # a file of this transaction created a run
    _runs: set[tuple[str, str]] = field(default_factory=set)  # (run, config JSON) ensured in this transaction
    _pending: dict[tuple[str, tuple[str, ...]], list[pa.Table]] = field(default_factory=dict)
    _pending_rows: int = 0

    @classmethod
    def open(cls, store: Store, w: Writer) -> "Transaction":
        # read inside the transaction (same cursor): committed files plus none of ours yet
        rows = store.rows("SELECT sha256, run_override, size FROM files")
        return cls(store, w, {(sha, run) for sha, run, _ in rows}, set(store.run_names()),
                   sizes={size for _, _, size in rows})

    def is_loaded(self, sha256: str, run_override: str | None) -> bool:
        return (sha256, run_override) in self.loaded

    def may_be_loaded(self, size: int) -> bool:
        """Whether a file of this many bytes is loaded: if not, no loaded file has its content."""
        return size in self.sizes

    def new_file(self, sha256: str | None, name: str, size: int, fmt: str, run_override: str | None) -> int:
        """A row in `files` for the file being loaded; sha256 None: still being hashed (`hashed` gives it)."""
        fid = self.w.new_file(sha256 or PENDING_HASH, name, size, fmt, run_override)
        if sha256 is not None:
            self.loaded.add((sha256, run_override))
        self.sizes.add(size)
        return fid

    def hashed(self, file_id: int, sha256: str, run_override: str | None) -> None:
        """The content hash of a file `new_file` took without one."""
        self.w.set_file_hash(file_id, sha256)
        self.loaded.add((sha256, run_override))

    def ensure_runs(self, runs: Sequence[str], config: dict | None) -> None:
        """Writer.ensure_runs for the runs not yet ensured with this config in this transaction (the statement
        is idempotent, so repeating it for the next file of the same run changes nothing)."""
        key = json.dumps(config or {}, sort_keys=True)
        new = [r for r in runs if (r, key) not in self._runs]
        if new:
            self.w.ensure_runs(new, config)
            self._runs.update((r, key) for r in new)
            self.new_run |= not self.runs.issuperset(runs)
            self.runs.update(runs)

    def append(self, table: str, data: pa.Table) -> None:
        """Rows for a summary table (or expert_load), inserted with the other files' rows of the same table at
        the end of the transaction: one INSERT per table instead of one per table and file."""
        self._pending.setdefault((table, tuple(data.column_names)), []).append(data)
        self._pending_rows += data.num_rows
        if self._pending_rows >= PENDING_ROWS:
            self.flush()

    def flush(self) -> None:
        try:
            for (table, _), parts in self._pending.items():
                self.w.insert_arrow(table, pa.concat_tables(parts))
        except Exception as e:
            raise FailedAtEnd(f"inserting summary rows failed ({e})") from e
        self._pending.clear()
        self._pending_rows = 0


# load_one(transaction, unit, report) -> Outcome; raises for a refusal, which the caller turns into an Outcome.
LoadOne = Callable[[Transaction, Unit, bool], Outcome]
Failure = Callable[[Unit, BaseException], Outcome]


def unit_bytes(unit: Unit) -> int:
    try:
        return sum(Path(p).stat().st_size for p in unit.paths)
    except OSError:
        return ALONE_BYTES + 1  # its load will say what is wrong; alone, it cannot make others load twice


def plan(units: Sequence[Unit]) -> list[list[int]]:
    """Indices of `units`, in order, cut into the groups that share a transaction."""
    groups: list[list[int]] = []
    size = 0
    for i, unit in enumerate(units):
        n = unit_bytes(unit)
        if n > ALONE_BYTES:
            groups.append([i])
            size = BATCH_BYTES  # the next file starts a new group
            continue
        if not groups or size + n > BATCH_BYTES or len(groups[-1]) >= BATCH_FILES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def load_groups(store: Store, units: Sequence[Unit], load_one: LoadOne, failure: Failure,
                progress: Callable[[int, int, str], None] | None = None) -> list[Outcome]:
    """Load `units` in order, several per transaction (see the module's docstring); one Outcome each.

    `failure(unit, exception)` makes the Outcome of a unit whose load raised (a refusal or a bug);
    `progress(i, n, name)` is told when unit i first starts (not when it is loaded again after a refusal)."""
    outcomes: list[Outcome | None] = [None] * len(units)
    started: set[int] = set()
    queue = plan(units)
    while queue:
        group = queue.pop(0)
        done, failed = _transaction(store, units, group, load_one, failure, progress, started)
        if failed is None:
            for i, outcome in done:
                outcomes[i] = outcome
            if len(done) < len(group):  # cut after a new run: the rest in the next transaction
                queue.insert(0, group[len(done):])
        elif failed[0] is None:  # the end of the transaction failed: each file again, alone, to find which
            queue[:0] = [[i] for i in group]
        else:
            at, outcomes[at] = failed
            redo, rest = [i for i, _ in done if i != at], group[group.index(at) + 1:]
            queue[:0] = [g for g in (redo, rest) if g]
    if progress:
        progress(len(units), len(units), "")
    return outcomes  # type: ignore[return-value]


def _transaction(store: Store, units: Sequence[Unit], group: list[int], load_one: LoadOne, failure: Failure,
                 progress, started: set[int]) -> tuple[list[tuple[int, Outcome]], tuple[int | None, Outcome] | None]:
    """Load the units of `group` in one transaction. Returns (their outcomes, None) once committed, or (the
    outcomes of those loaded before it, (the failed unit's index, its outcome)) after a rollback; the index is
    None when the end of a transaction of several units failed."""
    done: list[tuple[int, Outcome]] = []
    current: int | None = group[0]
    try:
        with store.transaction() as w:
            tx = Transaction.open(store, w)
            for current in group:
                first = current not in started
                if first:
                    started.add(current)
                    if progress:
                        progress(current, len(units), units[current].name)
                done.append((current, load_one(tx, units[current], first)))
                if tx.new_run:
                    # runs are listed in creation order, and a run's `created` is its transaction's start time:
                    # the next run's files start a transaction of their own, as they did one file per transaction
                    break
            current = None
            tx.flush()
    except Exception as e:  # the transaction has rolled back
        if isinstance(e, FailedAtEnd):
            current, e = None, e.__cause__ or e
        if current is None and len(group) == 1:
            current = group[0]
        # current None: the end of the transaction (the summary INSERTs, the COMMIT) failed, no file to blame
        return done, (current, failure(units[group[0] if current is None else current], e))
    return done, None
