"""One partition's work, the same on any engine: load its files through the real ingest into a private
in-memory database (every SCHEMA.md check, the same summary code as `ingest`), check the rows belong to the
partition's (run, step), and hand back the partial summaries as plain pyarrow Tables (picklable: a Ray task
returns them to the driver).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from analysis.ingest.validate import Batch
from analysis.lake import partial
from analysis.lake.layout import Partition, open_lake


@dataclass
class PartitionResult:
    """What a task hands back: the partition's summaries, or why it was refused (path and rule)."""
    run: str
    step: int
    tables: dict[str, pa.Table] = field(default_factory=dict)
    sample: dict[str, pa.Table] = field(default_factory=dict)  # token rows kept for drill-down (--token-sample)
    refused: str | None = None
    n_tokens: int = 0


@contextmanager
def local_files(lake: str, partition: Partition) -> Iterator[list[Path]]:
    """The partition's files as local paths: as they are on a local lake, else copied into a scratch folder
    that is removed afterwards (one partition at a time, so the copy is bounded by the partition's size)."""
    fs, _ = open_lake(lake)
    if isinstance(fs, pafs.LocalFileSystem):
        yield [Path(p) for p in partition.files]
        return
    scratch = tempfile.mkdtemp(prefix="drift-lake-")
    try:
        paths = []
        for i, remote in enumerate(partition.files):
            local = Path(scratch) / f"{i:05d}-{os.path.basename(remote)}"
            with fs.open_input_stream(remote) as src, open(local, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
            paths.append(local)
        yield paths
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _relative(lake: str, path: str) -> str:
    """A file's name for messages: its path under the lake root (`run=a/step=3/tokens-r00000.parquet`)."""
    _, root = open_lake(lake)
    return path[len(root) + 1:] if path.startswith(root + "/") else path


def with_partition_columns(reader, run: str, step: int):
    """Wrap an ingest reader so batches without `run` / `step` columns take them from the partition path
    (hive writers such as Spark and pyarrow.dataset leave partition columns out of the files)."""
    def read(unit, limits):
        for batch in reader(unit, limits):
            data = batch.data
            for name, value, type_ in (("run", run, pa.string()), ("step", step, pa.int64())):
                if name not in data.column_names:
                    data = data.append_column(name, pa.repeat(pa.scalar(value, type_), data.num_rows))
            yield Batch(batch.table, data, batch.where)
    return read


def summarize_partition(lake: str, partition: Partition, token_sample: float = 0.0,
                        threads: int | None = None) -> PartitionResult:
    """Validate and summarise one (run, step) partition; never raises for bad input (it is reported).

    `threads`: DuckDB threads of the private database (1 in a Ray task, which holds one CPU)."""
    from analysis.ingest.load import file_unit, load_units
    from analysis.ingest.errors import IngestError
    from analysis.store import Store

    result = PartitionResult(partition.run, partition.step)
    store = Store(":memory:", threads=threads)
    try:
        with local_files(lake, partition) as paths:
            units = []
            for remote, local in zip(partition.files, paths):
                try:
                    unit = file_unit(local, _relative(lake, remote))
                except IngestError as e:
                    result.refused = str(e)
                    return result
                unit.reader = with_partition_columns(unit.reader, partition.run, partition.step)
                units.append(unit)
            for outcome in load_units(store, units, run=None, limits=None):
                if outcome.status in ("refused", "error"):  # an internal error is reported like a refusal
                    result.refused = outcome.message
                    return result
        wrong = partial.first_row_outside(store, partition.run, partition.step)
        if wrong:
            result.refused = (f"{wrong[0]}: row with run={wrong[1]!r}, step={wrong[2]} lies in the partition "
                              f"{partition.name} (lake layout: a partition holds only its own run and step; "
                              "write the rows under run=<their run>/step=<their step>)")
            return result
        result.tables = partial.summary_tables(store)
        result.sample, kept = partial.token_sample(store, token_sample)
        result.tables[partial.SAMPLE_TABLE] = partial.sample_row(partition.run, partition.step, token_sample, kept)
        result.n_tokens = kept["n_tokens"]
        return result
    finally:
        store.close()
