"""Load files and folders into the store: all-or-nothing per file, idempotent by content hash.

Files given together may come in any order: token-bearing files load before routing-only ones, so a
routing file finds its tokens. A refused file leaves the database exactly as it was.
"""
from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.ingest import frameworks, long, sequences, summary_files, tensors
from analysis.ingest import summarise as summaries
from analysis.ingest import summary_stream as stream_summaries
from analysis.ingest.batches import ALONE_BYTES, Transaction, load_groups, unit_bytes
from analysis.ingest.detect import detect
from analysis.ingest.errors import (
    BadExperts,
    CorruptFile,
    DuplicateKey,
    IngestError,
    NotALogFile,
    OrphanRouting,
    TooLarge,
)
from analysis.ingest.hashing import HashInThread, content_hash, take_ahead
from analysis.ingest.keys import StepCounts, TableKeys, TokenFlips, expert_load, routing_tokens
from analysis.ingest.limits import Limits
from analysis.ingest.progress import RowsCallback, expected_rows
from analysis.ingest.stream import insert_items
from analysis.ingest.units import Outcome, Unit
from analysis.ingest.validate import Batch, normalise
from analysis.ingest.writeback import Writeback
from analysis.store import Store, StoreError

log = logging.getLogger(__name__)


def refused(name: str, e: IngestError, fmt: str | None = None) -> Outcome:
    return Outcome(name, "refused", fmt, message=str(e), rule=e.rule)


def internal_error(name: str, e: Exception, fmt: str | None = None) -> Outcome:
    """An unexpected exception while reading `name`: logged with its traceback, reported apart from refusals
    (the file may be fine; the reader is not)."""
    log.error("internal error while reading %s", name, exc_info=e)
    return Outcome(name, "error", fmt, message=f"{name}: internal error while reading this file "
                   f"({type(e).__name__}); nothing of it was loaded. This is a bug in Driftscope, not a fault "
                   "found in the file: please report it with the traceback from the log (the command line "
                   "prints it with DRIFT_DEBUG=1)")


def _single(fn):
    def read(unit: Unit, limits: Limits) -> Iterator[Batch]:
        with open(unit.paths[0], "rb") as fp:
            yield from fn(fp, unit.name, limits, unit.detected)
    return read


def _read_text(fn):
    from analysis.ingest.textio import open_text

    def inner(fp, name, limits, det):
        return fn(open_text(fp, name, limits, det.gz), name, limits, det)
    return inner


def _tensor_dump(unit: Unit, limits: Limits, fmt: str) -> Iterator[Batch]:
    return tensors.read_tensor_dump(unit.paths[0], unit.name, limits, fmt, frameworks.TENSOR_LAYOUTS)


READERS: dict[str, Callable[[Unit, Limits], Iterator[Batch]]] = {
    "parquet": _single(lambda fp, n, lim, det: long.read_parquet(fp, n, lim)),
    "csv": _single(lambda fp, n, lim, det: long.read_csv(fp, n, lim)),
    "jsonl": _single(_read_text(lambda fp, n, lim, det: long.read_jsonl_long(fp, n, lim, det.kind))),
    "sequence-jsonl": _single(_read_text(lambda fp, n, lim, det: sequences.read_sequence_jsonl(fp, n, lim))),
    "pt": partial(_tensor_dump, fmt="pt"),
    "safetensors": partial(_tensor_dump, fmt="safetensors"),
    "prime-rl": frameworks.primerl.read_unit,
    "summary": lambda unit, limits: iter(()),  # loaded by _load_summary: its rows go to the summary tables
}

# Folder adapters claim framework layouts (e.g. slime's rollout_data/ + train_data/) before the
# file-by-file scan: each takes a folder and returns (units, paths it claimed).
FOLDER_ADAPTERS: list[Callable[[Path, Limits], tuple[list[Unit], set[Path]]]] = list(frameworks.FOLDER_ADAPTERS)


def file_unit(path: Path, name: str | None = None) -> Unit:
    name = name or path.name
    with open(path, "rb") as fp:
        det = detect(fp, name)
    reader = READERS.get(det.format)
    if reader is None:
        raise IngestError(name, None, f"format '{det.format}' is not supported here",
                          "upload the files inside the archive, or a folder")
    return Unit(name, [path], det, reader)


# DuckDB's own files (a database kept next to the logs, and its write-ahead log, which changes while a load
# runs) are never logs: a folder scan passes over them.
DATABASE_SUFFIXES = (".duckdb", ".wal")


def _run_json_config(folder: Path) -> dict | None:
    f = folder / "run.json"
    if f.is_file():
        try:
            meta = json.loads(f.read_text())
            return meta.get("config") if isinstance(meta, dict) else None
        except (ValueError, OSError):
            return None
    return None


def expand(paths: Sequence[Path], limits: Limits) -> tuple[list[Unit], list[Outcome]]:
    """Units for files and folders (recursively), plus outcomes for files that could not even be sniffed.

    A file's unexpected exception becomes an "error" outcome (logged), so the other files still load."""
    units: list[Unit] = []
    outcomes: list[Outcome] = []
    for path in paths:
        path = Path(path)
        if path.is_dir():
            claimed: set[Path] = set()
            for adapter in FOLDER_ADAPTERS:
                u, c = adapter(path, limits)
                units.extend(u)
                claimed |= c
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                if f in claimed or f.name.startswith(".") or f.name in ("run.json", "README.md", "STABLE") \
                        or f.name.endswith(DATABASE_SUFFIXES):
                    continue
                rel = str(f.relative_to(path.parent))
                try:
                    unit = file_unit(f, rel)
                except NotALogFile:
                    continue  # folders hold other files too; only log files are loaded
                except IngestError as e:
                    outcomes.append(refused(rel, e))
                    continue
                except OSError as e:  # removed or unreadable between the listing and the read
                    outcomes.append(Outcome(rel, "refused", message=f"{rel}: cannot be read ({e.strerror or e})",
                                            rule="unreadable file"))
                    continue
                except Exception as e:
                    outcomes.append(internal_error(rel, e))
                    continue
                unit.config = _run_json_config(f.parent)
                units.append(unit)
        elif path.is_file():
            try:
                unit = file_unit(path)
                unit.config = _run_json_config(path.parent)
                units.append(unit)
            except IngestError as e:
                outcomes.append(refused(path.name, e))
            except Exception as e:
                outcomes.append(internal_error(path.name, e))
        else:
            outcomes.append(Outcome(str(path), "refused", message=f"{path}: no such file or folder",
                                    rule="no such file"))
    return units, outcomes


def load_unit(store: Store, unit: Unit, run: str | None = None, limits: Limits | None = None,
              config: dict | None = None, on_rows: RowsCallback | None = None) -> Outcome:
    """Load one unit in its own transaction."""
    return load_units(store, [unit], run, limits or Limits.from_env(), config, on_rows=on_rows)[0]


def _failure(unit: Unit, e: BaseException) -> Outcome:
    """The Outcome of a unit whose load raised `e` (its transaction has rolled back)."""
    fmt = unit.detected.format
    if isinstance(e, IngestError):
        return refused(unit.name, e, fmt)
    if isinstance(e, StoreError):
        return Outcome(unit.name, "refused", fmt, message=f"{unit.name}: {e}", rule="refused by the database")
    if isinstance(e, (MemoryError, RecursionError)):
        return Outcome(unit.name, "refused", fmt, message=f"{unit.name}: too large to load ({type(e).__name__})",
                       rule=TooLarge.rule)
    return internal_error(unit.name, e, fmt)


def _load_into(tx: Transaction, unit: Unit, run: str | None, limits: Limits, config: dict | None,
               on_rows: RowsCallback | None) -> Outcome:
    """Load one unit inside the open transaction `tx`; raises on a refusal (the caller rolls back)."""
    fmt = unit.detected.format
    if unit.skip:
        return Outcome(unit.name, "skipped", fmt, message=unit.skip)
    size = unit_bytes(unit)
    ahead = take_ahead(unit.paths)  # the command line's hash of this file, started before its imports
    if fmt != "summary" and size > ALONE_BYTES and not tx.may_be_loaded(size):
        hasher = ahead or HashInThread(unit.paths)  # no loaded file has this size: hash while loading
        try:
            outcome, fid = _load_rows(tx, unit, None, size, run, limits, config, on_rows)
            sha, hashed_size = hasher.result()
        finally:
            hasher.close()
        if hashed_size != size:
            raise CorruptFile(unit.name, None, f"the file changed while it was loaded ({size:,} bytes when it "
                              f"started, {hashed_size:,} read)", "load it again once it is completely written")
        tx.hashed(fid, sha, run)
        return outcome
    sha, hashed_size = ahead.result() if ahead is not None else (None, None)
    if hashed_size != size:  # none ahead, or the file changed since
        sha, size = content_hash(unit.paths)
    if tx.is_loaded(sha, run):  # by an earlier call, or by an earlier file of this one
        return Outcome(unit.name, "skipped", fmt, message="same content already loaded")
    if fmt == "summary":
        return _load_summary(tx, unit, sha, size, run, limits, config)
    return _load_rows(tx, unit, sha, size, run, limits, config, on_rows)[0]


def _load_rows(tx: Transaction, unit: Unit, sha: str | None, size: int, run: str | None, limits: Limits,
               config: dict | None, on_rows: RowsCallback | None) -> tuple[Outcome, int]:
    """Read, check and insert the rows of a token, routing or sequence file and add its summaries; (its
    Outcome, its file_id). sha None: the caller hashes the file meanwhile (Transaction.hashed)."""
    fmt = unit.detected.format
    w = tx.w
    rows = {"tokens": 0, "routing": 0, "sequences": 0}
    summarised = summaries.tokens_summarised(unit.paths, fmt)  # DriftLogger's sample: its summaries come separately
    fid = tx.new_file(sha, unit.name, size, fmt, run)
    keys = {t: TableKeys(t) for t in rows}
    # token summaries by the kernel as the batches pass (compute.py's SQL after the insert where it gives up)
    streamed = None if summarised or not STREAM_SUMMARIES else stream_summaries.StepSummaries()
    # reading and checking batch i+1 overlaps with DuckDB inserting batch i (both release the GIL), and the
    # summaries of batch i+1 with both; a small file is one batch, with nothing to overlap, and a thread per file
    # would only add its start-up
    large = size > ALONE_BYTES
    feeder = stream_summaries.InThread(streamed) if streamed is not None and large \
        and unit.detected.kind != "routing" else streamed
    # a small file's summary rows wait here and join its transaction's other summary rows at its end (one INSERT
    # per table for all its files), where a large file's are appended to the summary tables as they come
    held: list[tuple[str, pa.Table]] | None = [] if streamed is not None and not large else None
    counts = StepCounts()  # expert-load rows summed across batches where the file is in key order
    flips = TokenFlips()  # the tokens key-ordered routing rows refer to, one row each

    def summary_rows(out: list[tuple[str, pa.Table]]):
        if held is None:
            yield from ((table, with_file_id(data, fid)) for table, data in out)
        else:
            held.extend(out)

    def prepared():
        try:
            # a large file is read (pyarrow decodes without the GIL) in a thread of its own, a batch or two ahead
            # of the checks here: the checks and reading in one thread were the slowest stage of the load, which
            # DuckDB waited on for 1.0 s (tokens) and 1.7 s (routing) of the 40M-token benchmark
            reader = unit.reader(unit, limits)
            for batch in prefetch(reader, name="ingest-read") if large else reader:
                # runs: the run_codes of the run column, found once per batch for the keys, summaries and rows
                data, experts, runs = normalise(unit.name, batch, run, fid)
                if data.num_rows == 0:
                    continue
                keys[batch.table].add(data, runs)
                if feeder is not None and batch.table == "tokens":
                    yield from summary_rows(feeder.feed(data, runs))
                if experts is not None:
                    # per-batch results go to the database, which spills: nothing here grows with the file
                    if not summarised:  # a sample's expert load comes in its summary file
                        part = counts.add(expert_load(data, experts.S, experts.T, experts.t_rows, runs),
                                          keys["routing"].ordered)
                        if part is not None:
                            yield "expert_load", with_file_id(part, fid)
                    if keys["routing"].ordered:
                        part = flips.add(routing_tokens(data))
                        if part is not None:
                            yield STAGED_TOKENS, part
                yield batch.table, w.coded(batch.table, data, runs)
            last = counts.finish()
            if last is not None:
                yield "expert_load", with_file_id(last, fid)
            last = flips.finish()
            if last is not None and keys["routing"].ordered:
                yield STAGED_TOKENS, last
            if feeder is not None:
                yield from summary_rows(feeder.finish())
        finally:
            if feeder is not streamed:
                feeder.close()

    items = whole_row_groups(prepared())
    # a large file's pages reach the disk as they are written, not all at its COMMIT (writeback.py)
    with Writeback(tx.store.path) if large else contextlib.nullcontext():
        insert_items(w, prefetch(items) if large else items,
                     ("expert_load", STAGED_TOKENS, *stream_summaries.TOKEN_TABLES), rows, fid,
                     _rows_reporter(unit, on_rows))
    others = _check_file(w, unit.name, fid, rows, keys)
    if rows["routing"] and not summarised and not counts.merged:
        w.regroup_expert_load(fid)  # a file out of order appended partial counts: one row per key now
    tokens_done = _streamed_summaries(tx, unit.name, fid, streamed, rows["tokens"], held)
    summaries.add_file(w, fid, summarised, unit.name, tokens_done=tokens_done,
                       routing_alone=bool(rows["routing"]) and not others["routing"],
                       has=(rows["tokens"] > 0, rows["routing"] > 0), tokens_alone=not others["tokens"],
                       routed_tokens=ROUTED_TOKENS if rows["routing"] and keys["routing"].ordered else None)
    w.drop_staged(STAGED_TOKENS, ROUTED_TOKENS)
    runs = sorted(set().union(*(k.runs for k in keys.values())))
    tx.ensure_runs(runs, config or unit.config)
    w.finish_file(fid, sum(rows.values()))
    return Outcome(unit.name, "loaded", fmt, rows, runs), fid


def _streamed_summaries(tx: Transaction, name: str, fid: int, streamed, n_tokens: int,
                        held: list[tuple[str, pa.Table]] | None) -> bool:
    """Store the token summaries computed while the file streamed (already appended to the summary tables, or
    `held` rows that go with the transaction's other summary rows); False where they were not (the caller then
    runs the SQL, after the rows appended before the stream gave up are deleted)."""
    if streamed is None or not n_tokens:
        return False
    if not streamed.ok:
        log.info("%s: token summaries by SQL (%s)", name, streamed.why)
        if held is None and streamed.emitted:
            for table in stream_summaries.TOKEN_TABLES:
                tx.w.execute(f"DELETE FROM {table} WHERE file_id = ?", [fid])
        return False
    for table, data in held or ():
        tx.append(table, with_file_id(data, fid))
    log.info("%s: token summaries of %d steps computed while streaming", name, streamed.steps)
    return True


def _load_summary(tx: Transaction, unit: Unit, sha: str, size: int, run: str | None, limits: Limits,
                  config: dict | None) -> Outcome:
    """A DriftLogger summary file: its rows appended to the summary tables, checked whole (they reach the
    tables with the other files' summary rows at the end of the transaction)."""
    rows: dict[str, int] = {}
    runs: set[str] = set()
    fid = tx.new_file(sha, unit.name, size, "summary", run)
    with open(unit.paths[0], "rb") as fp:
        for table, data in summary_files.read(fp, unit.name, limits, run):
            tx.append(table, with_file_id(data, fid))
            rows[table] = rows.get(table, 0) + data.num_rows
            runs.update(pc.unique(data.column("run")).to_pylist())
    tx.ensure_runs(sorted(runs), config or unit.config)
    tx.w.finish_file(fid, sum(rows.values()))
    return Outcome(unit.name, "loaded", "summary", rows, sorted(runs))


# DuckDB stores tables in row groups of 122,880 rows; appends in whole multiples of that fill row groups
# completely and were measured ~25% cheaper than 500,000-row appends (benchmarks/RESULTS-ingest.md).
ROW_GROUP = 122_880
INSERT_ROWS = 4 * ROW_GROUP

# Token summaries computed while the batches stream (analysis/ingest/summary_stream.py); off: compute.py's SQL only.
STREAM_SUMMARIES = True

# Temporary tables of one load: the tokens that key-ordered routing rows refer to, with their flip counts, and
# the same joined with their token rows' log-probs by the orphan check (Writer.first_orphan_routing).
STAGED_TOKENS, ROUTED_TOKENS = "_staged_routing_tokens", "_staged_routed_tokens"


def with_file_id(data: pa.Table, fid: int) -> pa.Table:
    """`data` with the file_id column of file `fid`."""
    return data.append_column("file_id", pa.array(np.full(data.num_rows, fid, np.int32)))


def whole_row_groups(items: Iterator[tuple[str, pa.Table]], size: int = INSERT_ROWS,
                     first: int = ROW_GROUP) -> Iterator[tuple[str, pa.Table]]:
    """Re-cut (table, rows) items into appends of exactly `size` rows per table (the remainder last), the first
    of each table `first` rows: the database starts on a file after one batch has been read and checked, not
    after four (the serial start of each large file, ~0.1 s). Batches of one table whose columns differ (a
    routing batch whose ids pack into one integer beside one whose ids do not) are never joined: the rows held
    of the earlier columns are let go first, a shorter append."""
    buffers: dict[str, list[pa.Table]] = {}
    counts: dict[str, int] = {}
    started: set[str] = set()
    for table, data in items:
        buf = buffers.setdefault(table, [])
        if buf and data.schema != buf[0].schema:
            yield table, pa.concat_tables(buf)
            started.add(table)
            buf.clear()
            counts[table] = 0
        buf.append(data)
        counts[table] = counts.get(table, 0) + data.num_rows
        while counts[table] >= (want := size if table in started else first):
            whole = pa.concat_tables(buffers[table])
            n = (whole.num_rows // want) * want if table in started else want
            for lo in range(0, n, want):
                yield table, whole.slice(lo, want)
            started.add(table)
            rest = whole.slice(n)
            buffers[table], counts[table] = ([rest] if rest.num_rows else []), rest.num_rows
    for table, buf in buffers.items():
        if buf:
            yield table, pa.concat_tables(buf)


def prefetch(gen: Iterator, depth: int = 2, name: str = "ingest-prefetch") -> Iterator:
    """Run `gen` in a worker thread, `depth` items ahead (bounded memory); re-raise its errors here."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(msg) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in gen:
                if not put(("item", item)):
                    return
            put(("end", done))
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            put(("error", e))

    t = threading.Thread(target=work, daemon=True, name=name)
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "item":
                yield item
            elif kind == "error":
                raise item
            else:
                return
    finally:
        stop.set()
        t.join()


def _rows_reporter(unit: Unit, on_rows: RowsCallback | None) -> Callable[[str, int], None] | None:
    if on_rows is None:
        return None
    total, done = expected_rows(unit), 0

    def report(table: str, n: int) -> None:
        nonlocal done
        done += n
        on_rows(done, total)
    return report


def _check_file(w, name: str, fid: int, rows: dict[str, int], keys: dict[str, TableKeys]) -> dict[str, bool]:
    """Refuse the file if a key repeats, a routing row has no token or a layer's k disagrees; returns, per table,
    whether other files hold rows that could share a key with this one's (see _others_in_range)."""
    others = {t: bool(rows[t]) and _others_in_range(w, t, keys[t], fid) for t in rows}
    for table, cols in (("tokens", "run, step, sample, pos"), ("routing", "run, step, sample, pos, layer"),
                        ("sequences", "run, step, sample")):
        # a file in key order holds no key twice (TableKeys): only a clash with other files' rows is possible
        if rows[table] and (others[table] or not keys[table].ordered):
            dup = w.first_duplicate(table, fid, within=not keys[table].ordered)
            if dup:
                key = ", ".join(f"{c}={v!r}" for c, v in zip(cols.split(", "), dup[0]))
                raise DuplicateKey(name, f"{table} key ({key})", f"duplicate key: this key {dup[1]}",
                                   "each key may be loaded once; remove the repeated rows or use another run name")
    if rows["routing"]:
        orphan = w.first_orphan_routing(fid, (STAGED_TOKENS, ROUTED_TOKENS) if keys["routing"].ordered else None)
        if orphan:
            key = ", ".join(f"{c}={v!r}" for c, v in zip(("run", "step", "sample", "pos", "layer"), orphan)
                            if v is not None)
            raise OrphanRouting(name, f"routing row ({key})", "no token with this (run, step, sample, pos) exists",
                                "load the tokens file first or in the same call, and check the run name")
        conflict = w.first_k_conflict(fid) if others["routing"] else None
        if conflict:
            run, step, layer, k_new, k_old = conflict
            raise BadExperts(name, f"run {run!r}, step {step}, layer {layer}",
                             f"top-k has {k_new} experts here but {k_old} in rows already loaded",
                             "every routing row of a layer needs the same k")
    return others


def _others_in_range(w, table: str, keys: TableKeys, fid: int) -> bool:
    """Whether other files hold `table` rows of this file's runs within its step range: only those can share a
    key (or a layer's k) with it. One LIMIT 1 probe, pruned by the step column's zone maps, where the exact
    checks scan every row of the table: without it, each file of a 1,000-step run paid for all earlier ones."""
    if keys.steps is None:
        return False
    lo, hi = keys.steps
    return bool(w.execute(f"SELECT 1 FROM {table} WHERE step BETWEEN ? AND ? AND list_contains(?, run) "
                          "AND file_id <> ? LIMIT 1", [lo, hi, sorted(keys.runs), fid]).fetchall())


def ingest_paths(store: Store, paths: Sequence[str | Path], run: str | None = None, config: dict | None = None,
                 limits: Limits | None = None, progress: Callable[[int, int, str], None] | None = None,
                 on_rows: RowsCallback | None = None) -> list[Outcome]:
    """Load files and folders; one Outcome per file (or joined framework unit), in load order."""
    limits = limits or Limits.from_env()
    try:
        units, outcomes = expand([Path(p) for p in paths], limits)
    except IngestError as e:  # a folder adapter refused a whole layout
        return [refused("?", e)]
    return outcomes + load_units(store, units, run, limits, config, progress, on_rows)


def load_units(store: Store, units: Sequence[Unit], run: str | None, limits: Limits | None = None,
               config: dict | None = None, progress: Callable[[int, int, str], None] | None = None,
               on_rows: RowsCallback | None = None) -> list[Outcome]:
    """Load units all-or-nothing each; token-bearing units first, so routing rows given in the same call
    find their tokens whatever the order. Small units share transactions (analysis/ingest/batches.py), and a
    refused one still leaves nothing behind. `progress(i, n, name)` is told when unit i of n starts, `on_rows`
    (see analysis.ingest.progress) how many rows of it the database has taken, from a worker thread.

    The outermost layer of a load: a unit's unexpected exception (a bug, not a refusal) becomes an "error"
    outcome with its traceback logged; the transaction has rolled back and the next units still load."""
    limits = limits or Limits.from_env()
    units = sorted(units, key=lambda u: u.detected.kind == "routing")

    def load_one(tx: Transaction, unit: Unit, first: bool) -> Outcome:
        return _load_into(tx, unit, run, limits, config, on_rows if first else None)
    return load_groups(store, units, load_one, _failure, progress)


__all__ = ["Outcome", "Unit", "ingest_paths", "load_unit", "load_units", "expand", "READERS", "FOLDER_ADAPTERS"]
