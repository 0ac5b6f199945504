"""Write one run's merged summaries as a summary file (analysis/ingest/summary_files.py), so `ingest` loads it
as it loads DriftLogger's.

    OUT/run=<run>/run.json                 the run's config, from the lake's run=<run>/run.json
    OUT/run=<run>/summary.parquet          every step's rows of every summary table (and expert_load), one file
                                           per run: ingest loads it in one transaction
    OUT/run=<run>/tokens-sample.parquet    with --token-sample: the kept token rows; routing-sample.parquet their
                                           routing rows (marked driftscope.summarised: not summarised again)
"""
from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote

import pyarrow as pa

from analysis.ingest import summary_files as sf
from analysis.lake.layout import open_lake, write_parquet
from analysis.summaries import schema as S


def summary_file(tables: dict[str, pa.Table]) -> pa.Table:
    """The rows of several summary tables as one summary-file table: the union of their columns (nulls where a
    table has no such column) and the `summary` column naming each row's table."""
    fields = {sf.TABLE_COLUMN: pa.string()}
    for name in tables:
        fields |= {c.name: sf.ARROW[c.sql_type] for c in sf.TABLES[name]}
    parts = []
    for name, rows in tables.items():
        n = rows.num_rows
        if n:
            cols = {sf.TABLE_COLUMN: pa.repeat(pa.scalar(name), n)}
            parts.append(pa.table({f: cols[f] if f in cols else rows.column(f).cast(t) if f in rows.column_names
                                   else pa.nulls(n, t) for f, t in fields.items()}))
    schema = pa.schema(fields).with_metadata({sf.SUMMARY_KEY: sf.FORMAT_VERSION})
    return (pa.concat_tables(parts) if parts else schema.empty_table()).replace_schema_metadata(schema.metadata)


def write_run_summaries(out: str | Path, run: str, config: dict | None, tables: dict[str, pa.Table],
                        sample: dict[str, pa.Table | None] | None = None) -> list[str]:
    """Write the files of one run under `out`/run=<run>/ (percent-encoded, as hive writers do); returns their
    paths. `out` is a local folder or a URI pyarrow writes to (s3://, gs://), like the lake."""
    fs, root = open_lake(str(out))
    folder = f"{root}/run={quote(run, safe='')}"  # one folder level whatever the name holds
    fs.create_dir(folder, recursive=True)
    text = json.dumps({"run": run, "config": config}, indent=2, sort_keys=True) + "\n"
    with fs.open_output_stream(f"{folder}/run.json") as f:
        f.write(text.encode("utf-8"))
    written = [f"{folder}/summary.parquet"]
    write_parquet(fs, written[0], summary_file(tables))
    for kind, rows in (sample or {}).items():
        if rows is not None and rows.num_rows:
            written.append(f"{folder}/{kind}-sample.parquet")
            write_parquet(fs, written[-1], rows, {S.SUMMARISED_KEY.decode(): S.SUMMARISED_VALUE.decode()})
    return written
