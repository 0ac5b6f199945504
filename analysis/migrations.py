"""Every data migration of the database layout, run by Store when it opens a database for writing.

- split_tokens, before the DDL: a `tokens` table of every column (before the token rows were split) becomes
  `token_rows_full`, and the DDL then adds the narrow table and the view;
- compact_routing, after the DDL: a plain `routing` table (before `routing_rows`) moves to the compact form;
- add_columns, after the DDL: columns SCHEMA.md gained after databases were made (ADDED_COLUMNS), null in the
  earlier rows;
- to_layout2: summaries of layout 1 (below).
Added tables and columns need no step here: the DDL makes the table `topk` (top-k log-probs) where it is missing and
adds summaries/schema.py ADDED (the logging checks', full-distribution and routing-weight sums) as null columns;
a database opened read-only reads them as null (Store.has_check_sums, has_topk_sums, has_weight_sums). Routing
weights are FLOAT[] in tables made now; `routing_rows` made before keeps DOUBLE[] (rewriting it would double the
file, which DuckDB does not shrink), which the view reads alike.
(Files loaded before summaries existed are summarised by ingest's own SQL: analysis/ingest/summarise.py,
`backfill`, run by ingest.open_store.)

Summary layout 1 → 2: databases written before the ratio-band split moved to its own tables.

Layout 1 kept a `band` key in summary_seq and summary_bucket (one wide row per sequence or bucket and ratio
band). Layout 2 (schema.py) keeps one wide row per sequence / bucket and file, and the band split in the narrow
summary_seq_band / summary_bucket_band. Layout-1 rows hold everything layout 2 needs, so the conversion is the
merge rule of schema.py, done in SQL on the summary rows alone: the band tables take the band's
(n_tokens, sum_rm1, sum_rm1_sq) from each row, the wide tables merge a key's bands. No token row is read, so
runs whose summaries came from DriftLogger summary files (whose token rows are a sample, or absent) convert
as exactly as runs loaded from token files.
"""
from __future__ import annotations

import duckdb

from analysis import schema
from analysis.summaries import schema as S

# the layout-1 tables that carried the band key, and the table their band split moves to
BANDED = {"summary_seq": "summary_seq_band", "summary_bucket": "summary_bucket_band"}


def _banded(con) -> list[str]:
    """The tables of BANDED that still have the layout-1 `band` column."""
    return [r[0] for r in con.execute(
        "SELECT table_name FROM duckdb_columns() WHERE column_name = 'band' AND schema_name = 'main' "
        "AND database_name = current_database() AND list_contains(?, table_name) ORDER BY table_name",
        [list(BANDED)]).fetchall()]


def is_layout1(con) -> bool:
    """Whether the database still has layout-1 summary tables (a `band` column in summary_seq / summary_bucket)."""
    return bool(_banded(con))


def _merged_select(table: str) -> tuple[str, str]:
    """(select-list, GROUP BY list) merging the layout-1 rows of `table` into its layout-2 columns per key and
    file (schema.merge_sql)."""
    keys = [c for c in S.columns(table) if S.merge_kind(c) == "key"]
    cols = [c if c in keys else S.merge_sql(table, c) for c in S.columns(table)]
    return ", ".join(cols), ", ".join(keys)


def to_layout2(con) -> bool:
    """Convert a layout-1 database in one transaction (the new band tables must exist: store DDL creates
    them); returns whether anything was converted."""
    tables = _banded(con)
    if not tables:
        return False
    band_cols = [c.name for c in S.BAND_SUMS]
    con.execute("BEGIN TRANSACTION")
    try:
        for table in tables:
            band_table = BANDED[table]
            keys = [c for c in S.columns(band_table) if c not in band_cols and c != "file_id"]
            cols = ", ".join(keys + band_cols + ["file_id"])
            con.execute(f"INSERT INTO {band_table} ({cols}) SELECT {cols} FROM {table} WHERE n_tokens > 0")
            select, group = _merged_select(table)
            ddl = ", ".join(f"{c.name} {c.sql_type}" for c in S.TABLES[table])
            con.execute(f"CREATE TABLE _{table}_v2 ({ddl})")
            con.execute(f"INSERT INTO _{table}_v2 SELECT {select} FROM {table} GROUP BY {group}")
            con.execute(f"DROP TABLE {table}")
            con.execute(f"ALTER TABLE _{table}_v2 RENAME TO {table}")
        con.execute("COMMIT")
    except Exception:
        con.execute("ROLLBACK")
        raise
    return True


# Columns of the stored tables added after databases with them were made: (stored table, column, type). The token
# columns go to `token_rows_full` only: the narrow tables never hold an optional column (schema.TOKEN_NARROW).
ADDED_COLUMNS = (
    ("sequences", "response", "VARCHAR"),
    ("sequences", "tag", "VARCHAR"),
    (schema.TOKEN_STORE_FULL, "advantage", "DOUBLE"),
    (schema.TOKEN_STORE_FULL, "segment", "INTEGER"),
    (schema.TOKEN_STORE_FULL, "sampling_support", "INTEGER"),
    (schema.ROUTING_STORE, "sampler_margin", "FLOAT"),  # router margins (the packed tables never hold them)
    (schema.ROUTING_STORE, "trainer_margin", "FLOAT"),
)


def add_columns(con: duckdb.DuckDBPyConnection) -> None:
    """Give a database made before them the columns of ADDED_COLUMNS (NULL in its earlier rows); the views are
    made after this, so `tokens` shows them."""
    for table, column, sql_type in ADDED_COLUMNS:
        con.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {sql_type}")


def register_runs(con: duckdb.DuckDBPyConnection, table: str) -> None:
    """Give every run name in `table` that run_ids lacks the next free code."""
    con.execute(f"""INSERT INTO {schema.RUN_IDS}
        SELECT (SELECT coalesce(max(run_id), -1) FROM {schema.RUN_IDS}) + row_number() OVER (ORDER BY run), run
        FROM (SELECT DISTINCT run FROM {table}) n
        WHERE NOT EXISTS (SELECT 1 FROM {schema.RUN_IDS} r WHERE r.run = n.run)""")


def split_tokens(con: duckdb.DuckDBPyConnection) -> None:
    """A database written before the token rows were split (`tokens` a plain table of every column): that
    table becomes `token_rows_full`, and the DDL then adds the narrow table and the view."""
    old = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND NOT temporary "
                      "AND schema_name = 'main'", [schema.TOKENS_VIEW_NAME]).fetchall()
    if old[0][0]:
        con.execute(f"ALTER TABLE {schema.TOKENS_VIEW_NAME} RENAME TO {schema.TOKEN_STORE_FULL}")


def compact_routing(con: duckdb.DuckDBPyConnection) -> None:
    """Move a database written before `routing_rows` existed (routing as a plain table) to the compact form (the
    DDL has just made `routing_rows`, with run codes)."""
    old = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'routing' AND NOT temporary").fetchall()
    if old[0][0]:
        con.execute("BEGIN TRANSACTION")
        register_runs(con, "routing")
        con.execute(f"""INSERT INTO {schema.ROUTING_STORE} BY NAME
            SELECT r.run_id, x.* EXCLUDE (run) REPLACE (
                       CASE WHEN x.trainer_experts = x.sampler_experts THEN NULL ELSE x.trainer_experts END
                       AS trainer_experts)
            FROM routing x JOIN {schema.RUN_IDS} r ON x.run = r.run""")
        con.execute("DROP TABLE routing")
        con.execute("COMMIT")
