"""Read-ahead and re-batching of one load's items: a generator run a few items ahead in a worker thread
(`read_ahead`), and (table, rows) items re-cut into appends of whole DuckDB row groups (`whole_row_groups`)."""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import pyarrow as pa

# DuckDB stores tables in row groups of 122,880 rows; appends in whole multiples of that fill row groups
# completely and were measured ~25% cheaper than 500,000-row appends (benchmarks/RESULTS-ingest.md).
ROW_GROUP = 122_880
INSERT_ROWS = 4 * ROW_GROUP


def whole_row_groups(items: Iterator[tuple[str, pa.Table]], size: int = INSERT_ROWS,
                     first: int = ROW_GROUP) -> Iterator[tuple[str, pa.Table]]:
    """Re-cut (table, rows) items into appends of exactly `size` rows per table (the remainder last), the first
    of each table `first` rows: the database starts on a file after one batch has been read and checked, not
    after four (the serial start of each large file, ~0.1 s). Batches of one table whose columns differ (a
    routing batch whose ids pack into one integer beside one whose ids do not) are never joined: the rows held
    of the earlier columns are let go first, a shorter append."""
    buffers: dict[str, list[pa.Table]] = {}
    counts: dict[str, int] = {}
    started: set[str] = set()
    for table, data in items:
        buf = buffers.setdefault(table, [])
        if buf and data.schema != buf[0].schema:
            yield table, pa.concat_tables(buf)
            started.add(table)
            buf.clear()
            counts[table] = 0
        buf.append(data)
        counts[table] = counts.get(table, 0) + data.num_rows
        while counts[table] >= (want := size if table in started else first):
            whole = pa.concat_tables(buffers[table])
            n = (whole.num_rows // want) * want if table in started else want
            for lo in range(0, n, want):
                yield table, whole.slice(lo, want)
            started.add(table)
            rest = whole.slice(n)
            buffers[table], counts[table] = ([rest] if rest.num_rows else []), rest.num_rows
    for table, buf in buffers.items():
        if buf:
            yield table, pa.concat_tables(buf)


def read_ahead(gen: Iterator, depth: int = 2, name: str = "ingest-prefetch") -> Iterator:
    """Run `gen` in a worker thread, `depth` items ahead (bounded memory); re-raise its errors here. Leaving the
    loop early (an error here) stops the worker and waits for it."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(msg) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in gen:
                if not put(("item", item)):
                    return
            put(("end", done))
        except BaseException as e:  # handed to the consumer, which raises it in its own thread
            put(("error", e))

    t = threading.Thread(target=work, daemon=True, name=name)
    t.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "item":
                yield item
            elif kind == "error":
                raise item
            else:
                return
    finally:
        stop.set()
        t.join()
