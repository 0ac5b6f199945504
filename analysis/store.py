"""The only module that talks to DuckDB: opens the database, creates tables, runs parameterised SQL,
serialises writes, and turns DuckDB errors into the project's own `StoreError`."""
from __future__ import annotations

import json
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import duckdb
import numpy as np
import pyarrow as pa

from analysis import key_runs, migrations, schema, settings
from analysis.summaries import schema as summary_schema
from analysis.writeback import Writeback

if TYPE_CHECKING:  # DuckDB's .pl() imports polars where a result is read: a load never needs its ~0.2 s import
    import polars as pl

# Which runs have routing, and the trainer's side of it. Every routing row is counted in expert_load by the same
# ingest transaction, so its few rows answer this without scanning millions of routing rows.
_ROUTING_SIDES = "SELECT run, bool_or(n_trainer > 0) AS has_trainer FROM expert_load GROUP BY run ORDER BY run"


class StoreError(Exception):
    """A database problem explained for the user (never a raw DuckDB traceback)."""


def default_db_path() -> Path:
    return settings.DB.read()


def _ddl() -> list[str]:
    stmts = [
        """CREATE TABLE IF NOT EXISTS runs (
               run VARCHAR PRIMARY KEY, created TIMESTAMP DEFAULT current_timestamp, config VARCHAR)""",
        """CREATE TABLE IF NOT EXISTS files (
               file_id INTEGER PRIMARY KEY, sha256 VARCHAR NOT NULL, name VARCHAR, size BIGINT,
               format VARCHAR, run_override VARCHAR, rows BIGINT, loaded_at TIMESTAMP DEFAULT current_timestamp,
               precision_floor DOUBLE)""",
        "CREATE SEQUENCE IF NOT EXISTS file_ids START 1",
        # Expert load per (step, layer, expert) is aggregated at ingest: a load profile then never has to
        # unnest millions of top-k lists at query time.
        """CREATE TABLE IF NOT EXISTS expert_load (
               run VARCHAR, step BIGINT, layer INTEGER, expert INTEGER,
               n_sampler BIGINT, n_trainer BIGINT, file_id INTEGER)""",
        # Where experts ran (logged, or read from an engine's dump): per layer, physical slot -> logical expert,
        # slots split contiguously over n_ranks ranks (metrics/load.py Placement)
        """CREATE TABLE IF NOT EXISTS expert_placement (
               run VARCHAR, layer INTEGER, slot INTEGER, expert INTEGER, n_ranks INTEGER, file_id INTEGER)""",
        schema.RUN_IDS_DDL,
        schema.probe_ddl(),  # added with the probe: older databases gain it here
    ]
    for table in schema.TABLES:
        for name in schema.stored_tables(table):
            stmts.append(f"CREATE TABLE IF NOT EXISTS {name} ({_columns_ddl(table, name)})")
    # databases made before sequences had the response text, files their precision floor, or routing rows their
    # packed sampler ids
    stmts.append("ALTER TABLE sequences ADD COLUMN IF NOT EXISTS response VARCHAR")
    stmts.append("ALTER TABLE files ADD COLUMN IF NOT EXISTS precision_floor DOUBLE")
    stmts += [f"ALTER TABLE {schema.ROUTING_STORE} ADD COLUMN IF NOT EXISTS {c.name} {c.sql_type}"
              for c in schema.ROUTING_PACKED]
    return stmts + summary_schema.ddl()


def _columns_ddl(table: str, stored: str) -> str:
    fixed = schema.FIXED_COMPRESSION.get(stored, {})
    return ", ".join(f"{c.name} {c.sql_type}" + (f" USING COMPRESSION {fixed[c.name]}" if c.name in fixed else "")
                     for c in schema.stored_columns(table, stored in schema.NARROW_STORES))


def coded_tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    """The stored token / routing tables of this database that hold run codes (run_id); tables made before the
    codes hold names and are read and written as they are (see schema.RUN_IDS)."""
    rows = con.execute("SELECT DISTINCT table_name FROM duckdb_columns() WHERE column_name = 'run_id' "
                       "AND schema_name = 'main' AND database_name = current_database() "
                       "AND list_contains(?, table_name)", [list(schema.RUN_CODED)]).fetchall()
    return {r[0] for r in rows}


def _views(con: duckdb.DuckDBPyConnection) -> None:
    coded = coded_tables(con)
    con.execute(schema.tokens_view(coded))
    con.execute(schema.routing_view(coded))


class Store:
    """A DuckDB file with one writer at a time and one cursor per thread for readers.

    `memory_limit` / `threads` default to the DRIFT_MEMORY_LIMIT / DRIFT_THREADS environment variables.
    """

    def __init__(self, path: str | Path | None = None, *, read_only: bool = False,
                 memory_limit: str | None = None, threads: int | None = None):
        self.path = Path(path) if path is not None else default_db_path()
        self.read_only = read_only
        config: dict[str, Any] = {}
        memory_limit = memory_limit or settings.MEMORY_LIMIT.read()
        threads = threads or settings.THREADS.read()
        if memory_limit:
            config["memory_limit"] = str(memory_limit)
        if threads:
            config["threads"] = int(threads)
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        elif not self.path.exists():
            raise StoreError(f"no database at {self.path}: one is made by loading logs into it (`python -m analysis "
                             f"ingest FILES --db {self.path}`, or the app's Data page)")
        try:
            self._con = duckdb.connect(str(self.path), read_only=read_only, config=config)
        except duckdb.Error as e:
            raise StoreError(f"cannot open database {self.path}: {e}") from None
        self._local = threading.local()
        self.write_lock = threading.RLock()
        # Queries in flight, so that shutdown() can interrupt them and wait: a daemon thread still inside DuckDB
        # when the interpreter finalises is unwound from inside DuckDB's C++ and aborts the process (exit -6).
        self._cursors: weakref.WeakSet = weakref.WeakSet()
        self._by_thread: dict[int, weakref.ref] = {}  # thread ident -> its cursor (interrupt_thread)
        self._halted: set[int] = set()  # threads whose queries are refused until resume_thread
        self._active = 0
        self._idle = threading.Condition()
        self._closing = False
        self._writeback: Writeback | None = None  # start_writeback's descriptor of the file, closed after DuckDB's
        if not read_only:
            with self.write_lock:
                migrations.split_tokens(self._con)
                for stmt in _ddl():
                    self._con.execute(stmt)
                migrations.add_columns(self._con)
                migrations.compact_routing(self._con)
                _views(self._con)
                migrations.to_layout2(self._con)  # summaries of layout 1 (band key in the wide rows)
        elif migrations.is_layout1(self._con):
            self._con.close()
            raise StoreError(f"database {self.path} holds summaries of an older layout (layout 1) that this version "
                             "converts when it opens the database for writing: open it once in the app with "
                             "editing allowed, or run `python -m analysis ingest <a log it holds> --db "
                             f"{self.path}` (files already loaded are skipped)")

    def close(self) -> None:
        for cur in list(self._cursors):
            cur.close()
        self._con.close()
        if self._writeback is not None:  # only now: closing it earlier would drop DuckDB's lock (writeback.py)
            self._writeback.close()
            self._writeback = None

    def start_writeback(self) -> None:
        """Have the kernel start writing the pages DuckDB has written to the database file so far, without
        waiting (analysis/writeback.py): a large load calls it as its INSERT goes, so that its COMMIT waits for
        the last pages only. Nothing for an in-memory or read-only database."""
        if self._writeback is None:
            if self.read_only or not self.path.is_file():
                return
            self._writeback = Writeback(self.path)
        self._writeback.start()

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Refuse new queries, interrupt the running ones (in any thread), wait until they have returned, close.

        For a process that is exiting (app.py registers it with atexit): True if every query returned in time."""
        with self._idle:
            self._closing = True
        deadline = time.monotonic() + timeout
        while True:
            with self._idle:
                if self._active == 0:
                    break
            self.interrupt()
            with self._idle:
                self._idle.wait(0.05)
            if time.monotonic() > deadline:
                return False
        try:
            self.close()
        except duckdb.Error:
            pass
        return True

    @property
    def closing(self) -> bool:
        return self._closing

    def interrupt_thread(self, ident: int) -> None:
        """Interrupt the query that thread `ident` runs, if any (it raises StoreError in that thread), and refuse
        that thread's next queries until it calls `resume_thread`: a call of several queries stops at the next
        one too. The other threads' queries go on. For the prefetch worker, which gives way to page scripts."""
        with self._idle:
            self._halted.add(ident)
            ref = self._by_thread.get(ident)
        cur = ref() if ref is not None else None
        if cur is not None:
            try:
                cur.interrupt()
            except duckdb.Error:
                pass

    def resume_thread(self) -> None:
        """Let this thread query again after `interrupt_thread`."""
        with self._idle:
            self._halted.discard(threading.get_ident())

    def interrupt(self) -> None:
        """Interrupt whatever query runs on any of this store's cursors (the query raises in its own thread)."""
        with self._idle:
            cursors = list(self._cursors)
        for cur in cursors + [self._con]:
            try:
                cur.interrupt()
            except duckdb.Error:
                pass

    @contextmanager
    def _query(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """This thread's cursor, counted as in flight while the caller uses it."""
        with self._idle:
            if self._closing:
                raise StoreError("the database is closing (the server is shutting down)")
            if self._halted and threading.get_ident() in self._halted:
                raise StoreError("query interrupted: this thread gives way (Store.interrupt_thread)")
            self._active += 1
        try:
            yield self.cursor()
        finally:
            with self._idle:
                self._active -= 1
                self._idle.notify_all()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's own cursor (a DuckDB connection is not safe to share between threads)."""
        cur = getattr(self._local, "cur", None)
        if cur is None:
            cur = self._con.cursor()
            self._local.cur = cur
            with self._idle:
                self._cursors.add(cur)  # weak: a finished thread's cursor goes with its thread
                # thread ids are reused: a new thread's entry replaces a finished one's, and dead ones are dropped
                self._by_thread = {k: r for k, r in self._by_thread.items() if r() is not None}
                self._by_thread[threading.get_ident()] = weakref.ref(cur)
        return cur

    # -- reads -------------------------------------------------------------------------------------
    def sql(self, query: str, params: Sequence[Any] | dict | None = None) -> pl.DataFrame:
        """Run a read query with bound parameters and return a polars DataFrame."""
        with self._query() as cur:
            try:
                return cur.sql(query, params=params).pl()
            except duckdb.Error as e:
                raise StoreError(f"query failed: {e}") from None

    def arrow(self, query: str, params: Sequence[Any] | dict | None = None):
        """Run a read query with bound parameters and return a pyarrow Table (picklable, unlike a reader)."""
        with self._query() as cur:
            try:
                return cur.sql(query, params=params).to_arrow_table()
            except duckdb.Error as e:
                raise StoreError(f"query failed: {e}") from None

    def rows(self, query: str, params: Sequence[Any] | dict | None = None) -> list[tuple]:
        with self._query() as cur:
            try:
                return cur.execute(query, params or []).fetchall()
            except duckdb.Error as e:
                raise StoreError(f"query failed: {e}") from None

    def scalar(self, query: str, params: Sequence[Any] | dict | None = None) -> Any:
        rows = self.rows(query, params)
        return rows[0][0] if rows else None

    # -- writes ------------------------------------------------------------------------------------
    @contextmanager
    def transaction(self) -> Iterator["Writer"]:
        """One all-or-nothing unit of work: commits on success, rolls back on any exception."""
        if self.read_only:
            raise StoreError("the database is open read-only")
        with self.write_lock, self._query() as cur:
            cur.execute("BEGIN TRANSACTION")
            try:
                yield Writer(cur)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            else:
                try:
                    cur.execute("COMMIT")
                except duckdb.Error as e:
                    raise StoreError(f"could not commit: {e}") from None

    # -- runs and files ----------------------------------------------------------------------------
    def runs(self) -> pl.DataFrame:
        """One row per run: size, steps, whether it has routing, and its config JSON.

        Sizes come from the summaries (a few rows per step and sequence), not from the token rows: n_tokens
        counts every token the summaries cover, also where the token rows are a sample."""
        return self.sql(f"""
            WITH s AS (SELECT run, sum(n_tokens)::BIGINT AS n_tokens, count(DISTINCT step) AS n_steps,
                              min(step) AS first_step, max(step) AS last_step
                       FROM summary_step WHERE n_tokens > 0 GROUP BY run),
                 q AS (SELECT run, count(DISTINCT (step, sample)) AS n_sequences FROM summary_seq
                       WHERE n_tokens > 0 GROUP BY run),
                 t AS (SELECT * FROM s LEFT JOIN q USING (run)),
                 r AS ({_ROUTING_SIDES})
            SELECT runs.run, coalesce(t.n_tokens, 0) AS n_tokens, coalesce(t.n_steps, 0) AS n_steps,
                   coalesce(t.n_sequences, 0) AS n_sequences, r.run IS NOT NULL AS has_routing,
                   coalesce(r.has_trainer, false) AS has_trainer_routing,
                   t.first_step, t.last_step, runs.config
            FROM runs LEFT JOIN t USING (run) LEFT JOIN r USING (run)
            ORDER BY runs.created, runs.run""")

    @property
    def has_check_sums(self) -> bool:
        """Whether summary_step has the logging checks' sums (summaries/schema.py CHECK_SUMS): a database made
        before them gains them when opened for writing; opened read-only, it is read without them."""
        return self._has_columns("summary_step", summary_schema.CHECK_SUM_NAMES)

    @property
    def has_seq_sums(self) -> bool:
        """Whether summary_seq has the per-sequence log-prob sums (summaries/schema.py SEQ_SUMS), as has_check_sums."""
        return self._has_columns("summary_seq", summary_schema.SEQ_SUM_NAMES)

    @property
    def has_residual_sums(self) -> bool:
        """Whether summary_step has the residual signatures' counts (summaries/schema.py RESIDUAL_SUMS), as
        has_check_sums."""
        return self._has_columns("summary_step", summary_schema.RESIDUAL_SUM_NAMES)

    @property
    def has_topk_sums(self) -> bool:
        """Whether summary_step has the full-distribution sums (summaries/schema.py TOPK_SUMS), as has_check_sums."""
        return self._has_columns("summary_step", summary_schema.TOPK_SUM_NAMES)

    @property
    def has_weight_sums(self) -> bool:
        """Whether summary_layer has the routing-weight sums (summaries/schema.py WEIGHT_SUMS), as has_check_sums."""
        return self._has_columns("summary_layer", summary_schema.WEIGHT_SUM_NAMES)

    @property
    def has_margin_sums(self) -> bool:
        """Whether summary_layer has the router-margin sums (summaries/schema.py MARGIN_SUMS) and the table
        summary_margin exists, as has_check_sums."""
        return (self._has_columns("summary_layer", summary_schema.MARGIN_SUM_NAMES)
                and self._has_columns("summary_margin", ["margin_bin"]))

    @property
    def has_seq_topk_sums(self) -> bool:
        """Whether summary_seq has the full-distribution sums per sequence (TOPK_SUMS), as has_check_sums."""
        return self._has_columns("summary_seq", summary_schema.TOPK_SUM_NAMES)

    def has_columns(self, table: str, names: Sequence[str]) -> bool:
        """Whether `table` (or view) has every column of `names`: a database made before SCHEMA.md gained them,
        opened read-only, has not."""
        return self._has_columns(table, names)

    def _has_columns(self, table: str, names: Sequence[str]) -> bool:
        """Whether `table` has every column of `names` (asked once per table: the layout does not change while open)."""
        known = self.__dict__.setdefault("_columns_known", {})
        if table not in known:
            known[table] = {r[0] for r in self.rows(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND schema_name = 'main' "
                "AND database_name = current_database()", [table])}
        return set(names) <= known[table]

    def routing_sides(self) -> dict[str, bool]:
        """{run: whether it recorded the trainer's routing too} for every run with routing. Read from
        expert_load (a few rows per (run, step, layer, expert)), which ingest writes in the same transaction
        as the routing rows, rather than from millions of routing rows."""
        return {run: bool(t) for run, t in self.rows(_ROUTING_SIDES)}

    def run_names(self) -> list[str]:
        return [r[0] for r in self.rows("SELECT run FROM runs ORDER BY created, run")]

    def run_id(self, run: str) -> int:
        """The code that stored token and routing rows of `run` hold (schema.RUN_IDS), given now if it has none:
        for SQL that writes stored rows itself (benchmark and test builders)."""
        with self.transaction() as w:
            return w.run_id(run, now=True)

    def run_config(self, run: str) -> dict:
        text = self.scalar("SELECT config FROM runs WHERE run = ?", [run])
        return json.loads(text) if text else {}

    def set_run_config(self, run: str, config: dict) -> None:
        with self.transaction() as w:
            w.execute("UPDATE runs SET config = ? WHERE run = ?", [json.dumps(config, sort_keys=True), run])

    def delete_run(self, run: str) -> None:
        """Remove a run and everything loaded for it, including the record of its files."""
        with self.transaction() as w:
            ids = [r[0] for r in w.execute(
                "SELECT DISTINCT file_id FROM tokens WHERE run = ? UNION SELECT DISTINCT file_id FROM routing "
                "WHERE run = ? UNION SELECT DISTINCT file_id FROM sequences WHERE run = ? "
                "UNION SELECT DISTINCT file_id FROM summary_step WHERE run = ? "
                "UNION SELECT DISTINCT file_id FROM expert_load WHERE run = ? "
                "UNION SELECT DISTINCT file_id FROM expert_placement WHERE run = ? "
                "UNION SELECT DISTINCT file_id FROM topk WHERE run = ?",
                [run, run, run, run, run, run, run]).fetchall()]
            coded = coded_tables(w.cur)
            for table in (*schema.stored_tables("tokens"), *schema.stored_tables("routing")):
                where = f"run_id = (SELECT run_id FROM {schema.RUN_IDS} WHERE run = ?)" if table in coded else "run = ?"
                w.execute(f"DELETE FROM {table} WHERE {where}", [run])
            for table in ("sequences", "topk", "expert_load", "expert_placement", "runs", schema.RUN_IDS, schema.PROBE_TABLE,
                          *(t for t in summary_schema.TABLES if "run" in summary_schema.columns(t))):
                w.execute(f"DELETE FROM {table} WHERE run = ?", [run])
            # a file that held several runs keeps its record while any of its rows remain
            for fid in ids:
                left = w.execute("SELECT (SELECT count(*) FROM tokens WHERE file_id = ?) + "
                                 "(SELECT count(*) FROM routing WHERE file_id = ?) + "
                                 "(SELECT count(*) FROM summary_step WHERE file_id = ?) + "
                                 "(SELECT count(*) FROM expert_load WHERE file_id = ?) + "
                                 "(SELECT count(*) FROM expert_placement WHERE file_id = ?) + "
                                 "(SELECT count(*) FROM topk WHERE file_id = ?)",
                                 [fid, fid, fid, fid, fid, fid]).fetchall()[0][0]
                if not left:
                    w.execute("DELETE FROM files WHERE file_id = ?", [fid])
                    w.execute("DELETE FROM summary_skip WHERE file_id = ?", [fid])

    def files(self) -> pl.DataFrame:
        floor = ", precision_floor" if self._has_columns("files", ["precision_floor"]) else ""
        return self.sql(f"SELECT file_id, name, format, size, rows, run_override, loaded_at, sha256{floor} "
                        "FROM files ORDER BY file_id")

    def precision_floors(self) -> dict[str, float]:
        """{run: the coarsest precision floor of the files that brought its tokens} for runs with a floor (a log
        whose values were rounded when written: ingest/precision.py). A database opened read-only from before the
        column has none."""
        if not self._has_columns("files", ["precision_floor"]):
            return {}
        return {run: float(floor) for run, floor in self.rows(
            "SELECT s.run, max(f.precision_floor) FROM files f "
            "JOIN (SELECT DISTINCT run, file_id FROM summary_step) s ON s.file_id = f.file_id "
            "WHERE f.precision_floor IS NOT NULL GROUP BY s.run ORDER BY s.run")}


class Writer:
    """SQL for one ingest transaction; every statement takes its values as parameters."""

    def __init__(self, cur: duckdb.DuckDBPyConnection):
        self.cur = cur
        self._staged: set[str] = set()
        # run codes (schema.RUN_IDS): the committed ones, and those this transaction hands out, which reach
        # run_ids once the rows that use them are in (the load's producer thread asks while an INSERT runs)
        self._run_ids: dict[str, int] = dict(cur.execute(f"SELECT run, run_id FROM {schema.RUN_IDS}").fetchall())
        self._coded = coded_tables(cur)
        self._next_run_id = max(self._run_ids.values(), default=-1) + 1
        self._new_run_ids: list[tuple[int, str]] = []
        self._ids_lock = threading.Lock()

    def run_id(self, run: str, now: bool = False) -> int:
        """The code of run `run`, a new one if it has none: written to run_ids with the next insert, or `now`
        (for SQL that writes stored rows itself; from the transaction's own thread)."""
        with self._ids_lock:
            rid = self._run_ids.get(run)
            if rid is None:
                rid = self._run_ids[run] = self._next_run_id
                self._next_run_id += 1
                self._new_run_ids.append((rid, run))
        if now:
            self._flush_run_ids()
        return rid

    def _flush_run_ids(self) -> None:
        with self._ids_lock:
            new, self._new_run_ids = self._new_run_ids, []
        if new:
            self.cur.execute(f"INSERT INTO {schema.RUN_IDS} SELECT * FROM (VALUES "
                             + ", ".join("(?, ?)" for _ in new) + ")", [v for pair in new for v in pair])

    def coded(self, table: str, data, runs=None):
        """`data` (a pyarrow Table of `table`) with run codes in place of run names where its stored table holds
        codes (see coded_tables). `runs`: (names as a pyarrow Array, each row's index into them) of its run
        column, when the caller has them already (key_runs.run_codes)."""
        if table not in schema.TABLES or "run" not in data.column_names \
                or schema.stored_table(table, data.column_names) not in self._coded:
            return data
        if runs is None:
            runs = key_runs.run_codes(data.column("run"))
        names, index = runs
        ids = np.array([self.run_id(name) for name in names.to_pylist()], np.int32)
        col = np.full(data.num_rows, ids[0], np.int32) if len(ids) == 1 else ids[index]
        return data.set_column(data.column_names.index("run"), "run_id", pa.array(col))

    def execute(self, query: str, params: Sequence[Any] | None = None):
        return self.cur.execute(query, params or [])

    def new_file(self, sha256: str, name: str, size: int, fmt: str, run_override: str | None) -> int:
        fid = self.cur.execute("SELECT nextval('file_ids')").fetchall()[0][0]
        self.cur.execute("INSERT INTO files (file_id, sha256, name, size, format, run_override, rows) "
                         "VALUES (?, ?, ?, ?, ?, ?, 0)", [fid, sha256, name, size, fmt, run_override])
        return fid

    def finish_file(self, file_id: int, rows: int, precision_floor: float | None = None) -> None:
        """The file's row count, and its precision floor (ingest/precision.py) where its log is rounded."""
        self.cur.execute("UPDATE files SET rows = ?, precision_floor = ? WHERE file_id = ?",
                         [rows, precision_floor, file_id])

    def set_file_hash(self, file_id: int, sha256: str) -> None:
        """The content hash of a file whose row `new_file` wrote before its hash was known."""
        self.cur.execute("UPDATE files SET sha256 = ? WHERE file_id = ?", [sha256, file_id])

    def insert_arrow(self, table: str, data) -> None:
        """Append a pyarrow Table whose columns are a subset of the stored columns of `table`."""
        if table not in schema.TABLES and table not in ("expert_load", "expert_placement") \
                and table not in summary_schema.TABLES:
            raise ValueError(f"unknown table {table}")
        data = self.coded(table, data)
        self._flush_run_ids()
        cols = ", ".join(data.column_names)
        target = self._target(table, data.column_names, key_runs.in_key_runs(table, data))
        self.cur.register("_ingest_batch", data)
        try:
            self.cur.execute(f"INSERT INTO {target} ({cols}) SELECT {cols} FROM _ingest_batch")
        finally:
            self.cur.unregister("_ingest_batch")

    def replace_probe(self, run: str, data) -> None:
        """The probe rows of `run` (a pyarrow Table of schema.PROBE's columns) in place of any it had: loading a
        probe's output twice leaves one copy."""
        cols = [c.name for c in schema.PROBE]
        if data.column_names != cols:
            raise ValueError(f"probe rows: expected columns {cols}, got {data.column_names}")
        self.cur.execute(f"DELETE FROM {schema.PROBE_TABLE} WHERE run = ?", [run])
        self.cur.register("_probe_batch", data)
        try:
            self.cur.execute(f"INSERT INTO {schema.PROBE_TABLE} SELECT * FROM _probe_batch")
        finally:
            self.cur.unregister("_probe_batch")

    def _target(self, table: str, columns: Sequence[str], ordered: bool) -> str:
        """The stored table of rows of `table` with these columns; `ordered`: they come in key order
        (schema.KEY_RUN). Rows with run names, not codes (a database made before the codes), go where names are
        stored: the twin tables for files not in key order are newer and always hold codes."""
        return schema.stored_table(table, columns, ordered or "run" in columns)

    def insert_stream(self, table: str, reader, columns: Sequence[str], file_id: int, ordered: bool = True) -> None:
        """Append every batch of a pyarrow RecordBatchReader in one INSERT: inside a transaction, DuckDB keeps
        memory flat for one streamed INSERT but not for many small ones (analysis/ingest/stream.py).

        `file_id` is written as a constant rather than read from the batches: scanning a constant Arrow column
        cost ~20% of the insert's CPU for token rows. Token and routing batches come with run codes (`coded`).
        `ordered` False: the rows do not come in key order (schema.KEY_RUN)."""
        if table not in schema.TABLES:
            raise ValueError(f"unknown table {table}")
        cols = [c for c in columns if c != "file_id"]
        target = self._target(table, cols, ordered)
        if "run" in cols and target in self._coded:
            raise ValueError(f"{table} rows need run codes (Writer.coded) before they are stored")
        self.cur.register("_ingest_stream", reader)
        try:
            self.cur.execute(f"INSERT INTO {target} ({', '.join(cols)}, file_id) "
                             f"SELECT {', '.join(cols)}, ? FROM _ingest_stream", [file_id])
        finally:
            self.cur.unregister("_ingest_stream")
        self._flush_run_ids()

    def stage(self, name: str, data) -> None:
        """Append a pyarrow Table to the temporary table `name` (created on first use, in this transaction):
        partial results of a load that the database holds, and spills, instead of Python."""
        if not name.startswith("_staged_") or not name.replace("_", "").isalnum():
            raise ValueError(f"not a staging table name: {name}")
        self.cur.register("_stage_batch", data)
        try:
            if name in self._staged:
                self.cur.execute(f"INSERT INTO {name} SELECT * FROM _stage_batch")
            else:
                self.cur.execute(f"CREATE TEMP TABLE {name} AS SELECT * FROM _stage_batch")
                self._staged.add(name)
        finally:
            self.cur.unregister("_stage_batch")

    def drop_staged(self, *names: str) -> None:
        for name in names:
            if name in self._staged:
                self.cur.execute(f"DROP TABLE {name}")
                self._staged.discard(name)

    def regroup_expert_load(self, file_id: int) -> None:
        """Sum the partial expert-load counts a file appended (one row per batch and key, where the file was not in
        key order: keys.StepCounts) into one row per (run, step, layer, expert)."""
        self.cur.execute("""CREATE TEMP TABLE _regrouped_expert_load AS
            SELECT run, step, layer, expert, sum(n_sampler) AS n_sampler, sum(n_trainer) AS n_trainer
            FROM expert_load WHERE file_id = ? GROUP BY run, step, layer, expert""", [file_id])
        try:
            self.cur.execute("DELETE FROM expert_load WHERE file_id = ?", [file_id])
            self.cur.execute("""INSERT INTO expert_load SELECT *, ? FROM _regrouped_expert_load
                                ORDER BY run, step, layer, expert""", [file_id])
        finally:
            self.cur.execute("DROP TABLE _regrouped_expert_load")

    def ensure_runs(self, runs: Sequence[str], config: dict | None = None) -> None:
        for run in runs:
            self.cur.execute("INSERT INTO runs (run, config) VALUES (?, ?) ON CONFLICT DO NOTHING",
                             [run, json.dumps(config or {}, sort_keys=True)])
            if config:
                self.cur.execute("UPDATE runs SET config = ? WHERE run = ? AND (config IS NULL OR config = '{}')",
                                 [json.dumps(config, sort_keys=True), run])

    def first_duplicate(self, table: str, file_id: int, within: bool = True) -> tuple[tuple, str] | None:
        """(key, where) of a key this file's rows hold twice, or share with rows already stored.

        `within=False` skips the in-file check (the caller proved the file's keys strictly increasing)."""
        key = schema.KEYS[table]
        cols = ", ".join(key)
        row = self.cur.execute(
            f"SELECT {cols} FROM {table} WHERE file_id = ? GROUP BY ALL HAVING count(*) > 1 LIMIT 1",
            [file_id]).fetchall() if within else None
        row = row[0] if row else None
        if row:
            return row, "appears twice in this file"
        # against earlier files: only (run, step) pairs that both hold can collide
        mine = f"(SELECT DISTINCT run, step FROM {table} WHERE file_id = ?)"
        overlap = self.cur.execute(
            f"SELECT count(*) FROM {table} WHERE file_id <> ? AND (run, step) IN (SELECT (run, step) FROM {mine})",
            [file_id, file_id]).fetchall()[0][0]
        if not overlap:
            return None
        row = self.cur.execute(
            f"""SELECT {', '.join('a.' + c for c in key)}, f.name FROM {table} a JOIN {table} b USING ({cols})
                JOIN files f ON f.file_id = b.file_id
                WHERE a.file_id = ? AND b.file_id <> ? LIMIT 1""", [file_id, file_id]).fetchall()
        row = row[0] if row else None
        if row:
            return row[:-1], f"is already loaded from {row[-1]}"
        return None

    def by_run_id(self, table: str, columns: Sequence[str]) -> str | None:
        """schema.by_run_id for this database's stored tables."""
        return schema.by_run_id(table, columns, self._coded)

    def with_token_logprobs(self, keys: str) -> str:
        """SQL of the rows of `keys` (a table, or a subquery in parentheses, with run, step, sample and pos among
        its columns) whose token row exists, with that row's log-probs as s and t. Matched by run code where every
        token table holds codes (see schema.by_run_id), else through the view; only the token rows of the keys'
        step range are read."""
        cols = "step, sample, pos, sampler_logprob, trainer_logprob"
        coded = self.by_run_id("tokens", cols.split(", "))
        if coded:
            k = f"SELECT k.*, c.run_id AS run_key FROM {keys} k JOIN {schema.RUN_IDS} c USING (run)"
            rows = f"SELECT run_id AS run_key, {cols} FROM ({coded})"
        else:
            k = f"SELECT *, run AS run_key FROM {keys}"
            rows = f"SELECT run AS run_key, {cols} FROM tokens"
        return f"""WITH k AS ({k})
            SELECT k.* EXCLUDE (run_key), r.sampler_logprob AS s, r.trainer_logprob AS t
            FROM k JOIN ({rows}) r ON r.run_key = k.run_key AND r.step = k.step AND r.sample = k.sample AND r.pos = k.pos
            WHERE r.step BETWEEN (SELECT min(step) FROM k) AND (SELECT max(step) FROM k)"""

    def join_token_logprobs(self, staged: str, name: str) -> str | None:
        """Make the temporary table `name` of the rows of the staged table `staged` (see `stage`) whose token row
        exists, with that row's log-probs s and t (`with_token_logprobs`); returns `name`, or None where nothing
        was staged as `staged`."""
        if staged not in self._staged:
            return None
        self.cur.execute(f"CREATE TEMP TABLE {name} AS {self.with_token_logprobs(staged)}")
        self._staged.add(name)
        return name

    def first_orphan_routing(self, file_id: int, token_keys: tuple[str, str] | None = None) -> tuple | None:
        """A routing row of this file whose token is not in `tokens`.

        `token_keys`: optional (a staged table of the distinct (run, step, sample, pos) the file's routing rows
        refer to, one row each (keys.TokenFlips); the same joined with their token rows, `join_token_logprobs`).
        Checking those tokens instead of every (token, layer) row is `layers` times less work."""
        if token_keys is not None:
            staged, routed = token_keys
            # most files have no orphan: the join of the staged tokens (its build side) with the token rows has
            # as many rows as they are, ~10x faster than the anti join below (0.08 vs 0.85 s for 500k keys
            # against 40M tokens), which then only runs to name the first orphan
            everyone = self.cur.execute(
                f"SELECT (SELECT count(*) FROM {staged}) = (SELECT count(*) FROM {routed})").fetchall()
            if everyone[0][0]:
                return None
            row = self.cur.execute(
                f"""SELECT r.run, r.step, r.sample, r.pos, NULL FROM {staged} r
                   ANTI JOIN (SELECT run, step, sample, pos FROM tokens
                              WHERE step BETWEEN (SELECT min(step) FROM {staged})
                                             AND (SELECT max(step) FROM {staged})) t
                     ON t.run = r.run AND t.step = r.step AND t.sample = r.sample AND t.pos = r.pos
                   LIMIT 1""").fetchall()
            return row[0] if row else None
        rows = self.cur.execute(
            """SELECT r.run, r.step, r.sample, r.pos, r.layer FROM routing r
               ANTI JOIN tokens t ON t.run = r.run AND t.step = r.step AND t.sample = r.sample AND t.pos = r.pos
               WHERE r.file_id = ? LIMIT 1""", [file_id]).fetchall()
        return rows[0] if rows else None

    def first_k_conflict(self, file_id: int) -> tuple | None:
        """A (run, step, layer) where this file's k differs from rows already stored."""
        rows = self.cur.execute(
            """SELECT a.run, a.step, a.layer, a.k, b.k FROM
                 (SELECT DISTINCT run, step, layer, k FROM routing WHERE file_id = ?) a
               JOIN (SELECT DISTINCT run, step, layer, k FROM routing WHERE file_id <> ?) b
                 ON a.run = b.run AND a.step = b.step AND a.layer = b.layer AND a.k <> b.k LIMIT 1""",
            [file_id, file_id]).fetchall()
        return rows[0] if rows else None
