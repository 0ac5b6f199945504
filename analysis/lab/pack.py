"""Merge a lab run's per-step files into one file per kind, for the bundled demo.

DriftLogger writes one summary, token and routing file per step. Each Parquet file carries a footer and
per-column metadata; for a 200-step run of the lab that overhead is most of the bytes (a step's summary file is
~25 kB of which a third is data), and a first start loads 600 files instead of 3. The rows carry their run and step,
and ingest recognises a file by its content (the summary metadata key; token rows marked as summarised), so one
file holding every step's rows is read exactly as the per-step files are: the same rows (a summary file's grouped
by table), the same schema and metadata, the same encodings (analysis.record.logger.encodings), zstd level 19.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.record.logger import encodings

KINDS = ("summary", "tokens", "routing")


def pack_run(run_dir: Path) -> dict[str, Path]:
    """Replace run_dir's `<kind>-step*.parquet` files by one `<kind>-steps<first>-<last>.parquet` per kind."""
    written = {}
    for kind in KINDS:
        files = sorted(run_dir.glob(f"{kind}-step[0-9]*.parquet"))
        if not files:
            continue
        tables = [pq.read_table(f) for f in files]
        if any(t.schema.metadata != tables[0].schema.metadata for t in tables):
            raise ValueError(f"{run_dir}: the {kind} files carry different schema metadata; not packing them")
        table = pa.concat_tables(tables, promote_options="permissive")
        table = table.replace_schema_metadata(tables[0].schema.metadata)
        if kind == "summary":  # a table's rows together (a stable sort: step order kept): 13% smaller
            table = table.sort_by([("summary", "ascending"), ("step", "ascending")])
        first, last = files[0].stem.removeprefix(f"{kind}-step"), files[-1].stem.removeprefix(f"{kind}-step")
        path = run_dir / f"{kind}-steps{first}-{last}.parquet"
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, compression="zstd", compression_level=19, store_schema=True,
                       write_statistics=True, **encodings(table.schema))
        tmp.replace(path)
        for f in files:
            f.unlink()
        written[kind] = path
    return written
