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
    write_parquet(fs, written[0], sf.from_tables(tables))
    for kind, rows in (sample or {}).items():
        if rows is not None and rows.num_rows:
            written.append(f"{folder}/{kind}-sample.parquet")
            write_parquet(fs, written[-1], rows, {S.SUMMARISED_KEY.decode(): S.SUMMARISED_VALUE.decode()})
    return written
