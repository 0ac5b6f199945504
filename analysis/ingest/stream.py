"""Feed one load's checked batches to DuckDB in as few INSERT statements as possible, in bounded memory.

Measured on 40M token rows with a 500 MB DuckDB memory_limit (benchmarks/RESULTS-scale.md): inside one
transaction, one INSERT per batch keeps every batch in memory until COMMIT (3.0 GB peak RSS), while one INSERT
that streams all the batches from an Arrow reader stays flat (0.7 GB). So consecutive batches of one table
become one streamed INSERT. Side rows (expert-load counts and token summaries, appended to their tables; the
tokens routing rows refer to, staged in a temporary table) wait in a capped buffer and are written between
INSERTs: a new INSERT starts when the table or the columns change, or when the side buffer is full.
"""
from __future__ import annotations

from typing import Callable, Iterator

import pyarrow as pa

from analysis.ingest.keys import in_key_runs

# Side rows held in Python before the streamed INSERT is cut to stage them. Each cut ends the INSERT, stages the
# side rows and starts another (~0.1-0.2 s on two cores): the routing file of benchmarks/bench_scale.py (16M routing
# rows) has 1.58M side rows, 68 MB, and was cut into three INSERTs at the earlier 500,000-row cap; 128 MiB takes
# them in one, and memory stays bounded for any file.
SIDE_CAP_BYTES = 128 << 20


def insert_items(w, items: Iterator[tuple[str, pa.Table]], side_tables: tuple[str, ...], rows: dict[str, int],
                 file_id: int, on_rows: Callable[[str, int], None] | None = None) -> None:
    """Insert (table, data) items of file `file_id`: tables named in `side_tables` are side rows (see `_put`), the
    others go to their stored table in streamed INSERTs.

    `rows[table]` counts the rows inserted; `on_rows(table, n)` (optional) is told of each batch as DuckDB takes
    it. An error raised while producing items (a refused row, say) is raised here, after DuckDB stopped
    reading, so the caller's transaction rolls back with the original exception."""
    it = iter(items)
    side: list[tuple[str, pa.Table]] = []
    side_bytes = 0  # of `side`, kept as it grows: a table's nbytes takes ~13 µs, and a file stages hundreds
    pending: list[tuple[str, pa.Table]] = []
    while True:
        item = pending.pop() if pending else next(it, None)
        if item is None:
            break
        table, data = item
        if table in side_tables:
            _put(w, table, data)
            continue
        error: list[BaseException] = []

        def batches(table=table, first=data) -> Iterator[pa.RecordBatch]:
            nonlocal side_bytes
            try:
                item = (table, first)
                while item is not None:
                    table2, data2 = item
                    if table2 in side_tables:
                        side.append((table2, data2))
                        side_bytes += data2.nbytes
                        if side_bytes >= SIDE_CAP_BYTES:
                            return
                    elif table2 != table or data2.schema != first.schema:
                        pending.append((table2, data2))
                        return
                    else:
                        rows[table] += data2.num_rows
                        if on_rows:
                            on_rows(table, data2.num_rows)
                        yield from data2.to_batches()
                    # next() by hand: a `for` or `yield from` over `it` would close it when this reader ends
                    item = next(it, None)
            except BaseException as e:  # handed to the caller once DuckDB has stopped reading
                error.append(e)

        ordered = in_key_runs(table, data)  # its first batch decides
        w.insert_stream(table, pa.RecordBatchReader.from_batches(data.schema, batches()), data.column_names,
                        file_id, ordered)
        if error:
            raise error[0]
        _stage(w, side)
        side.clear()
        side_bytes = 0


def _stage(w, side: list[tuple[str, pa.Table]]) -> None:
    """Write the side rows with one statement per table where their columns agree (a file's 400 steps made
    2,400 small INSERTs of summary rows, ~0.7 s of the main thread on 40M tokens), as one chunk each: DuckDB
    took 0.15 s for the 819k expert-load rows of the 16M-row benchmark file in 262 Arrow chunks, 0.10 s
    for the same rows made one chunk first."""
    by_name: dict[str, list[pa.Table]] = {}
    for name, part in side:
        by_name.setdefault(name, []).append(part)
    for name, parts in by_name.items():
        if all(p.schema == parts[0].schema for p in parts):
            _put(w, name, pa.concat_tables(parts).combine_chunks())
        else:
            for part in parts:
                _put(w, name, part)


def _put(w, name: str, data: pa.Table) -> None:
    """Side rows: into the temporary table `name` where it is a staging name (`_staged_...`, w.stage), else
    appended to the stored table `name` (its rows carry their file_id), in the load's transaction."""
    if name.startswith("_staged_"):
        w.stage(name, data)
    else:
        w.insert_arrow(name, data)
