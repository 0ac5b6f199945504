"""Load files and folders into the store: all-or-nothing per file, idempotent by content hash.

Files given together may come in any order: token-bearing files load before routing-only ones, so a
routing file finds its tokens. A refused file leaves the database exactly as it was.
"""
from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Sequence

import pyarrow.compute as pc

from analysis.ingest import engine_load, frameworks, long, precision, sequences, summary_files, tensors
from analysis.ingest import summarise as summaries
from analysis.ingest.batches import ALONE_BYTES, Transaction, load_groups, unit_bytes
from analysis.ingest.detect import detect
from analysis.ingest.errors import (
    BadExperts,
    CorruptFile,
    DuplicateKey,
    IngestError,
    NotALogFile,
    OrphanRouting,
    OrphanTopk,
    TooLarge,
)
from analysis.ingest.file_rows import SIDE_TABLES, STAGED_TOKENS, FileRows, with_file_id
from analysis.ingest.hashing import HashInThread, content_hash, take_ahead
from analysis.ingest.keys import TableKeys
from analysis.ingest.limits import Limits
from analysis.ingest.progress import RowsCallback, expected_rows
from analysis.ingest.readahead import read_ahead, whole_row_groups
from analysis.ingest.stream import insert_items
from analysis.ingest.units import Outcome, Unit
from analysis.ingest.validate import Batch
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
    "prime-rl-traces": frameworks.primerl_traces.read_unit,
    "miles-columns": frameworks.miles.lone_columns,
    "summary": lambda unit, limits: iter(()),  # loaded by _load_summary: its rows go to the summary tables
} | {fmt: (lambda unit, limits: iter(())) for fmt in engine_load.FORMATS}  # loaded by _load_engine_dump

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
    if fmt not in ("summary", *engine_load.FORMATS) and size > ALONE_BYTES and not tx.may_be_loaded(size):
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
    if fmt in engine_load.FORMATS:
        return _load_engine_dump(tx, unit, sha, size, run, limits, config)
    return _load_rows(tx, unit, sha, size, run, limits, config, on_rows)[0]


# The temporary table of the routed tokens joined with their token rows' log-probs by the orphan check, which the
# routing summaries then read (see _check_file).
ROUTED_TOKENS = "_staged_routed_tokens"


def _load_rows(tx: Transaction, unit: Unit, sha: str | None, size: int, run: str | None, limits: Limits,
               config: dict | None, on_rows: RowsCallback | None) -> tuple[Outcome, int]:
    """Read, check and insert the rows of a token, routing or sequence file and add its summaries; (its
    Outcome, its file_id). sha None: the caller hashes the file meanwhile (Transaction.hashed)."""
    # open: the file's row in `files`, and the state its batches build up (file_rows.FileRows)
    fmt, w, large = unit.detected.format, tx.w, size > ALONE_BYTES
    fid = tx.new_file(sha, unit.name, size, fmt, run)
    state = FileRows(unit.name, fid, run, summaries.tokens_summarised(unit.paths, fmt), large)
    # stream: every batch read, checked and inserted, with the side rows it adds
    rows = _stream(tx, unit, limits, state, large, on_rows)
    # check: the rules that need the file's rows in the database
    routed, others = _check_file(w, unit.name, fid, rows, state.keys)
    # summarise
    _summarise(tx, unit.name, fid, rows, state, routed, tokens_alone=not others["tokens"])
    # finish
    w.drop_staged(STAGED_TOKENS, ROUTED_TOKENS)
    runs = state.runs()
    tx.ensure_runs(runs, config or unit.config)
    w.finish_file(fid, sum(rows.values()), precision.coarsest(unit.precision_floor, state.floor))
    return Outcome(unit.name, "loaded", fmt, rows, runs), fid


def _stream(tx: Transaction, unit: Unit, limits: Limits, state: FileRows, large: bool,
            on_rows: RowsCallback | None) -> dict[str, int]:
    """Insert the file's checked rows and their side rows; returns the rows inserted per table. A large file
    is read (pyarrow decodes without the GIL) in a thread of its own, a batch or two ahead of its checks, and
    checked in another, ahead of DuckDB's INSERT (which releases the GIL too): reading and checking in one thread
    was the slowest stage of the load, which DuckDB waited on for 1.0 s (tokens) and 1.7 s (routing) of the
    40M-token benchmark. A small file is one batch, with nothing to overlap."""
    batches = unit.reader(unit, limits)
    if large:
        batches = read_ahead(batches, name="ingest-read")
    items = whole_row_groups(state.items(batches, tx.w))
    rows = {"tokens": 0, "routing": 0, "sequences": 0, "topk": 0}
    insert_items(tx.w, read_ahead(items) if large else items, SIDE_TABLES, rows, state.fid,
                 _rows_reporter(unit, on_rows, tx.store if large else None))
    return rows


def _rows_reporter(unit: Unit, on_rows: RowsCallback | None,
                   writeback: Store | None = None) -> Callable[[str, int], None] | None:
    """What insert_items tells of each batch DuckDB takes: `on_rows` its progress, and the database file of
    `writeback` (a large file's load) is written to disk as the load goes (Store.start_writeback): its COMMIT
    waited 0.28 s for the pages of the 40M-token benchmark's tokens file otherwise."""
    if on_rows is None and writeback is None:
        return None
    total = expected_rows(unit) if on_rows is not None else None
    done = 0

    def report(table: str, n: int) -> None:
        nonlocal done
        done += n
        if writeback is not None:
            writeback.start_writeback()
        if on_rows is not None:
            on_rows(done, total)
    return report


def _check_file(w, name: str, fid: int, rows: dict[str, int],
                keys: dict[str, TableKeys]) -> tuple[str | None, dict[str, bool]]:
    """Refuse the file if a key repeats, a routing row has no token, a layer's k disagrees or a token's routing
    layers span two files. Returns the temporary table of the file's routed tokens joined with their token
    rows' log-probs (ROUTED_TOKENS), where the orphan check made one (a key-ordered routing file): the routing
    summaries read it; and per table whether other files hold rows of its runs in its step range."""
    # only other files' rows of this file's runs in its step range can share a key (or a layer's k) with it
    others = {t: bool(rows[t]) and _others_in_range(w, t, keys[t], fid) for t in rows}
    for table, cols in (("tokens", "run, step, sample, pos"), ("routing", "run, step, sample, pos, layer"),
                        ("sequences", "run, step, sample"), ("topk", "run, step, sample, pos")):
        # a file in key order holds no key twice (TableKeys): only a clash with other files' rows is possible
        if rows[table] and (others[table] or not keys[table].ordered):
            dup = w.first_duplicate(table, fid, within=not keys[table].ordered)
            if dup:
                key = ", ".join(f"{c}={v!r}" for c, v in zip(cols.split(", "), dup[0]))
                raise DuplicateKey(name, f"{table} key ({key})", f"duplicate key: this key {dup[1]}",
                                   "each key may be loaded once; remove the repeated rows or use another run name")
    if rows["topk"]:
        orphan = w.execute("""SELECT run, step, sample, pos FROM topk x WHERE file_id = ? AND NOT EXISTS (
                                  SELECT 1 FROM tokens t WHERE t.run = x.run AND t.step = x.step
                                  AND t.sample = x.sample AND t.pos = x.pos) LIMIT 1""", [fid]).fetchall()
        if orphan:
            key = ", ".join(f"{c}={v!r}" for c, v in zip(("run", "step", "sample", "pos"), orphan[0]))
            raise OrphanTopk(name, f"top-k row ({key})", "no token with this (run, step, sample, pos) exists",
                                "load the tokens file first or in the same call, and check the run name")
    if not rows["routing"]:
        return None, others
    # a key-ordered file's routed tokens were staged one row each as it streamed (FileRows): checking those,
    # joined with their token rows, is `layers` times less work than checking every routing row
    routed = w.join_token_logprobs(STAGED_TOKENS, ROUTED_TOKENS) if keys["routing"].ordered else None
    orphan = w.first_orphan_routing(fid, (STAGED_TOKENS, routed) if routed else None)
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
    if others["routing"]:  # without other files' routing rows in range (the usual case) there is none to span
        summaries.check_routing_whole(w, fid, name)
    return routed, others


def _others_in_range(w, table: str, keys: TableKeys, fid: int) -> bool:
    """Whether other files hold `table` rows of this file's runs within its step range: only those can share a
    key (or a layer's k) with it. One LIMIT 1 probe, pruned by the step column's zone maps, where the exact
    checks scan every row of the table: without it, each file of a 1,000-step run paid for all earlier ones."""
    if keys.steps is None:
        return False
    lo, hi = keys.steps
    return bool(w.execute(f"SELECT 1 FROM {table} WHERE step BETWEEN ? AND ? AND list_contains(?, run) "
                          "AND file_id <> ? LIMIT 1", [lo, hi, sorted(keys.runs), fid]).fetchall())


def _summarise(tx: Transaction, name: str, fid: int, rows: dict[str, int], state: FileRows,
               routed: str | None, tokens_alone: bool) -> None:
    """Add the file's summaries: its token summaries as streamed where the stream could (else the SQL over its
    rows), the logging checks' pairs of neighbouring tokens across this file and another (unless `tokens_alone`:
    no other file holds tokens in its step range), its routing ones by SQL, from the routed tokens the orphan
    check joined with their log-probs (`routed`, where it made them)."""
    w = tx.w
    if state.summarised:  # DriftLogger's sample: its summaries (and expert load) come in a summary file
        summaries.skip_file(w, fid)
        return
    if rows["tokens"]:
        if state.keep_summaries(tx):
            log.info("%s: token summaries of %d steps computed while streaming", name, state.summaries.steps)
        else:
            log.info("%s: token summaries by SQL (%s)", name, state.summaries.why)
            summaries.add_tokens(w, fid)
        if not tokens_alone:
            summaries.add_seams(w, fid)
    if rows["topk"] and (topk := state.topk.rows(fid)) is not None:  # full-distribution sums (schema.TOPK_SUMS)
        tx.append("summary_step", topk)
        tx.append("summary_seq", state.topk.seq_rows(fid))  # per sequence: the columns per tag and length
    if rows["routing"]:
        if not state.counts.merged:
            w.regroup_expert_load(fid)  # a file out of order appended partial counts: one row per key now
        summaries.add_routing(w, fid, routed)


def _load_summary(tx: Transaction, unit: Unit, sha: str, size: int, run: str | None, limits: Limits,
                  config: dict | None) -> Outcome:
    """A DriftLogger summary file: its rows appended to the summary tables, checked whole (they reach the
    tables with the other files' summary rows at the end of the transaction)."""
    rows: dict[str, int] = {}
    runs: set[str] = set()
    fid = tx.new_file(sha, unit.name, size, "summary", run)
    with open(unit.paths[0], "rb") as fp:
        for table, data in summary_files.read(fp, unit.name, limits, run):
            if table == "sequences":  # rows, not sums: stored now, so that a key loaded twice is refused below
                tx.w.insert_arrow(table, with_file_id(data, fid))
            else:
                tx.append(table, with_file_id(data, fid))
            rows[table] = rows.get(table, 0) + data.num_rows
            runs.update(pc.unique(data.column("run")).to_pylist())
    dup = tx.w.first_duplicate("sequences", fid) if rows.get("sequences") else None
    if dup:
        key = ", ".join(f"{c}={v!r}" for c, v in zip(("run", "step", "sample"), dup[0]))
        raise DuplicateKey(unit.name, f"sequences key ({key})", f"duplicate key: this key {dup[1]}",
                           "give every sequence its own sample id (DriftLogger: sample_ids=, distinct across "
                           "trainer ranks)")
    tx.ensure_runs(sorted(runs), config or unit.config)
    tx.w.finish_file(fid, sum(rows.values()))
    return Outcome(unit.name, "loaded", "summary", rows, sorted(runs))


def _load_engine_dump(tx: Transaction, unit: Unit, sha: str, size: int, run: str | None, limits: Limits,
                      config: dict | None) -> Outcome:
    """An inference engine's expert-load dump or placement (analysis/ingest/engine_load.py): read whole and
    checked before any row is appended, so a refusal leaves nothing behind."""
    fmt = unit.detected.format
    tables = engine_load.READERS[fmt](unit.paths[0], unit.name, limits, run)
    fid = tx.new_file(sha, unit.name, size, fmt, run)
    rows = {}
    for table, data in tables.items():
        if data.num_rows:
            tx.append(table, with_file_id(data, fid))
        rows[table] = data.num_rows
    runs = [run] if run else []
    tx.ensure_runs(runs, config or unit.config)
    tx.w.finish_file(fid, sum(rows.values()))
    return Outcome(unit.name, "loaded", fmt, rows, runs)


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
    units = sorted(units, key=lambda u: u.detected.kind in ("routing", "topk"))

    def load_one(tx: Transaction, unit: Unit, first: bool) -> Outcome:
        return _load_into(tx, unit, run, limits, config, on_rows if first else None)
    return load_groups(store, units, load_one, _failure, progress)


__all__ = ["Outcome", "Unit", "ingest_paths", "load_unit", "load_units", "expand", "READERS", "FOLDER_ADAPTERS"]
