"""Summary files: DriftLogger's per-step rows of the summary tables, written by the trainer, loaded by ingest.

One Parquet file per logged step (`summary-step000012.parquet`) holds that step's rows of every summary table
(analysis/summaries/schema.py) plus `expert_load`, in the union of their columns; the column `summary` names the
table of each row. The file is recognised by content: its schema metadata holds SUMMARY_KEY (the format version:
2 = summary layout 2; layout-1 files are still read). Rows carry no
file_id (ingest adds the summary file's). A file is checked whole before any row is stored: every row names a
known table, has its key columns, counts are ≥ 0, bins and bands are on the global edges, values are finite.
"""
from __future__ import annotations

from typing import BinaryIO, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest.errors import BadValue, CorruptFile, MissingColumn, UnknownFormat, WrongType
from analysis.ingest.limits import Limits
from analysis.migrations import BANDED
from analysis.summaries import schema as S

SUMMARY_KEY = b"driftscope.summary"
FORMAT_VERSION = b"2"  # summary layout 2 (schema.py): the ratio-band split in summary_seq_band / summary_bucket_band
LAYOUT1 = b"1"  # read too: its summary_seq / summary_bucket rows carry a band key, split here as the database's
#                 migration does (analysis/migrations.py)
TABLE_COLUMN = "summary"
ARROW = {"VARCHAR": pa.string(), "BIGINT": pa.int64(), "INTEGER": pa.int32(), "SMALLINT": pa.int16(),
         "DOUBLE": pa.float64()}
EXPERT_LOAD = S.KEY + (S.Col("layer", "INTEGER", "0-based MoE layer"), S.Col("expert", "INTEGER", "expert id"),
                       S.Col("n_sampler", "BIGINT", "tokens the sampler routed to the expert at this layer"),
                       S.Col("n_trainer", "BIGINT", "the same for the trainer (0 without its side)"))
# DriftLogger's per-sequence context (reward, advantage, texts, tag; analysis/record/context.py): SCHEMA.md's
# `sequences` rows, one per sequence of the step whatever its token sample, loaded into the table `sequences`
SEQUENCES = tuple(S.Col(c.name, c.sql_type, c.doc) for c in schema.SEQUENCES)
# the tables a summary file may hold, and their columns as written (no file_id)
TABLES: dict[str, tuple[S.Col, ...]] = {
    name: tuple(c for c in cols if c.name != "file_id") for name, cols in S.TABLES.items() if name != "summary_skip"
} | {"expert_load": EXPERT_LOAD, "sequences": SEQUENCES}


def is_key(table: str, column: str) -> bool:
    """Whether `column` is part of `table`'s key (never null; a summary table's by its merge rule)."""
    if table == "sequences":
        return column in schema.SEQUENCE_KEY
    return S.merge_kind(column) == "key"
FIX = "write summary files with DriftLogger (analysis/record/logger.py); docs/SCHEMA.md, 'Summary files', lists the rules"


def is_summary_file(metadata: dict | None) -> bool:
    return bool(metadata) and SUMMARY_KEY in metadata


def build(run: str, step: int, tables: dict[str, dict[str, list]]) -> pa.Table:
    """The summary file's table for one step: `tables` maps a table to its columns (without run and step)."""
    return from_tables({name: step_rows(run, step, name, cols) for name, cols in tables.items()})


def n_rows(cols: dict) -> int:
    """Rows of a table given as columns (0 without any column)."""
    return len(next(iter(cols.values()), []))


def step_rows(run: str, step: int, table: str, cols: dict) -> pa.Table:
    """One step's rows of summary table `table`, typed as stored: its columns (without run and step) plus both."""
    return rows_of(table, run, np.full(n_rows(cols), step, np.int64), cols)


def rows_of(table: str, run: str | np.ndarray, step: np.ndarray, cols: dict) -> pa.Table:
    """Rows of summary table `table`, typed as stored: `run` one name for every row or one per row, `step` one
    per row, and the other columns (numpy columns: no copy)."""
    types = {c.name: ARROW[c.sql_type] for c in TABLES[table]}
    run = pa.repeat(pa.scalar(run), len(step)) if isinstance(run, str) else pa.array(run, pa.string())
    data = {"run": run, "step": pa.array(step, pa.int64())}
    return pa.table(data | {k: pa.array(v, types[k]) for k, v in cols.items()})


def from_tables(tables: dict[str, pa.Table]) -> pa.Table:
    """The rows of several summary tables as one summary-file table: the union of their columns (nulls where a
    table has no such column) and the `summary` column naming each row's table."""
    fields = {TABLE_COLUMN: pa.string()}
    for name in tables:
        fields |= {c.name: ARROW[c.sql_type] for c in TABLES[name]}
    parts = []
    for name, rows in tables.items():
        n = rows.num_rows
        if n:
            have = set(rows.column_names)  # Table.column_names builds a new list per call: 10 ms a step here
            cols = {TABLE_COLUMN: pa.repeat(pa.scalar(name), n)}
            parts.append(pa.table({f: cols[f] if f in cols else rows.column(f).cast(t) if f in have
                                   else pa.nulls(n, t) for f, t in fields.items()}))
    schema = pa.schema(fields).with_metadata({SUMMARY_KEY: FORMAT_VERSION})
    return (pa.concat_tables(parts) if parts else schema.empty_table()).replace_schema_metadata(schema.metadata)


def read(fp: BinaryIO, name: str, limits: Limits, run: str | None = None) -> Iterator[tuple[str, pa.Table]]:
    """(table, rows) batches of a summary file, checked and in the stored column types; `run` overrides the
    run name of every row (`ingest --run`)."""
    try:
        pf = pq.ParquetFile(fp)
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, None, f"not a readable Parquet file ({e})", "re-export the file") from None
    version = (pf.schema_arrow.metadata or {}).get(SUMMARY_KEY)
    if version not in (FORMAT_VERSION, LAYOUT1):
        raise UnknownFormat(name, None, f"summary file format {version!r} is not known (this version reads "
                            f"{FORMAT_VERSION!r} and {LAYOUT1!r})", "log with the DriftLogger of this version")
    present = set(pf.schema_arrow.names)
    for col in (TABLE_COLUMN, "run", "step"):
        if col not in present:
            raise MissingColumn(name, None, f"summary file has no column '{col}'", FIX)
    offset = 0
    try:
        for rb in pf.iter_batches(batch_size=limits.batch_rows):
            yield from _split(name, pa.Table.from_batches([rb]), offset, present, run, version == LAYOUT1)
            offset += rb.num_rows
    except (pa.ArrowException, OSError) as e:
        raise CorruptFile(name, f"after row {offset}", f"Parquet data cannot be read ({e})",
                          "the file is corrupt or truncated; re-export it") from None


def _split(name: str, batch: pa.Table, offset: int, present: set[str], run: str | None, layout1: bool = False):
    which = batch.column(TABLE_COLUMN)
    unknown = pc.invert(pc.fill_null(pc.is_in(which, pa.array(list(TABLES))), False))
    if pc.any(unknown).as_py():
        i = _first(unknown)
        raise BadValue(name, f"row {offset + i + 1}, column '{TABLE_COLUMN}'",
                       f"unknown summary table {which[i].as_py()!r} (known: {', '.join(TABLES)})", FIX)
    for table in pc.unique(which).to_pylist():
        rows = np.flatnonzero(pc.equal(which, table).to_numpy(zero_copy_only=False))
        part = batch.take(pa.array(rows))
        yield table, _typed(name, table, part, lambda i: f"row {offset + int(rows[i]) + 1}", present, run)
        if layout1 and table in BANDED:
            # a layout-1 row per (key, band): its band's n_tokens, sum_rm1, sum_rm1_sq go to the band table (the
            # wide rows of a key, one per band, merge like rows of several files)
            banded = np.flatnonzero(pc.fill_null(part.column("n_tokens"), 0).to_numpy(zero_copy_only=False) > 0)
            yield BANDED[table], _typed(name, BANDED[table], part.take(pa.array(banded)),
                                        lambda i: f"row {offset + int(rows[banded[i]]) + 1}", present, run)


def _typed(name: str, table: str, part: pa.Table, row, present: set[str], run: str | None) -> pa.Table:
    """The columns of `table` from the file's rows `part`, cast to the stored types and checked."""
    out = {}
    for c in TABLES[table]:
        where = f"table {table}, column '{c.name}'"
        if c.name not in present:
            if is_key(table, c.name):
                raise MissingColumn(name, None, f"{where} is missing", FIX)
            continue
        try:
            col = pc.cast(part.column(c.name), ARROW[c.sql_type], safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            raise WrongType(name, where, f"expected {ARROW[c.sql_type]}, got {part.column(c.name).type}",
                            FIX) from None
        _check(name, table, c, col, row)
        out[c.name] = col
    if run is not None:
        out["run"] = pa.array([run] * part.num_rows, pa.string())
    return pa.table(out)


def _first(mask: pa.Array | pa.ChunkedArray) -> int:
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _scalar(v):
    return v.item() if hasattr(v, "item") else v  # a numpy scalar as the Python value, for messages


def _check(name: str, table: str, c: S.Col, col: pa.ChunkedArray, row) -> None:
    """The value rules of one column of `table`; raises naming the first row that breaks one."""
    def refuse(bad: np.ndarray, rule: str):
        i = int(np.flatnonzero(bad)[0])
        raise BadValue(name, f"{row(i)} (table {table}), column '{c.name}'",
                       rule.format(v=_scalar(values[i])), FIX)

    values = col.is_null().to_numpy(zero_copy_only=False)
    if is_key(table, c.name) and values.any():
        refuse(values, "key value is missing (null)")
    values = col.to_numpy(zero_copy_only=False) if col.null_count == 0 else \
        pc.fill_null(col, 0 if c.sql_type != "VARCHAR" else "").to_numpy(zero_copy_only=False)
    if c.sql_type == "DOUBLE" and not np.isfinite(values).all():
        refuse(~np.isfinite(values), "value must be finite, got {v!r}")
    if (c.name.startswith("n_") or c.name in ("step", "sum_common", "sum_flipped_layers", "sample",
                                              "response_length")) and (values < 0).any():
        refuse(values < 0, "a count must be >= 0, got {v}")
    limit = {"band": S.N_BANDS, "bin": S.N_BINS, "margin_bin": len(S.MARGIN_EDGES) - 1}.get(c.name)
    if limit is not None and ((values < 0) | (values >= limit)).any():
        refuse((values < 0) | (values >= limit),
               f"{c.name} must be in [0, {limit}) (the global edges of summaries/schema.py), got {{v}}")
    if c.name == "dim" and not np.isin(values, S.BUCKET_DIMENSIONS).all():
        refuse(~np.isin(values, S.BUCKET_DIMENSIONS),
               f"unknown bucket dimension {{v!r}} (known: {', '.join(S.BUCKET_DIMENSIONS)})")
    if c.name == "side" and not np.isin(values, S.MARGIN_SIDES).all():
        refuse(~np.isin(values, S.MARGIN_SIDES), f"unknown side {{v!r}} (known: {', '.join(S.MARGIN_SIDES)})")
    if c.name == "token_sample" and ((values < 0) | (values > 1)).any():
        refuse((values < 0) | (values > 1), "a share must be in [0, 1], got {v}")


__all__ = ["build", "from_tables", "read", "is_summary_file", "TABLES", "SUMMARY_KEY", "TABLE_COLUMN"]
