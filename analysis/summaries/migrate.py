"""Summary layout 1 → 2: databases written before the ratio-band split moved to its own tables.

Layout 1 kept a `band` key in summary_seq and summary_bucket (one wide row per sequence or bucket and ratio
band). Layout 2 (schema.py) keeps one wide row per sequence / bucket and file, and the band split in the narrow
summary_seq_band / summary_bucket_band. Layout-1 rows hold everything layout 2 needs, so the conversion is the
merge rule of schema.py, done in SQL on the summary rows alone: the band tables take the band's
(n_tokens, sum_rm1, sum_rm1_sq) from each row, the wide tables merge a key's bands. No token row is read, so
runs whose summaries came from DriftLogger summary files (whose token rows are a sample, or absent) convert
as exactly as runs loaded from token files.
"""
from __future__ import annotations

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
