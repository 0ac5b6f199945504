"""How far a load has got: rows taken by the database per file, against the rows the file holds when its
format says so up front (Parquet's footer; other formats show the count and the rate).

The library only calls callbacks; the command line draws them with tqdm (`TerminalProgress`), the Data page
with st.progress (pages/data.py).
"""
from __future__ import annotations

import sys
from typing import Callable, TextIO

# on_rows(rows loaded so far in this file, rows the file holds or None when unknown)
RowsCallback = Callable[[int, "int | None"], None]


def expected_rows(unit) -> int | None:
    """Rows the unit will insert, when cheap to know before reading it: Parquet long tables (footer)."""
    if unit.detected.format != "parquet" or len(unit.paths) != 1:
        return None
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(unit.paths[0]).metadata.num_rows
    except Exception:  # a corrupt footer is the reader's to refuse, with its own message
        return None


class TerminalProgress:
    """A tqdm bar per file on a terminal (rows, with the total when known); nothing when stderr is not a TTY.

    Bars appear only for files that take more than `delay` seconds, so small loads print just their lines."""

    def __init__(self, stream: TextIO | None = None, delay: float = 2.0, mininterval: float = 0.5):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.delay, self.mininterval = delay, mininterval
        self.bar = None

    def file(self, index: int, n_files: int, name: str) -> None:
        """load_units' progress(i, n, name): a new file starts (name empty once all are done)."""
        self.close()
        if self.enabled and name:
            from tqdm import tqdm
            self.bar = tqdm(desc=f"[{index + 1}/{n_files}] {name}", unit=" rows", unit_scale=True,
                            file=self.stream, delay=self.delay, mininterval=self.mininterval, leave=False,
                            dynamic_ncols=True)

    def rows(self, done: int, total: int | None) -> None:
        if self.bar is not None:
            if total is not None and self.bar.total != total:
                self.bar.total = total
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
