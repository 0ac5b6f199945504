"""How a batch's keys run: its run names as codes, and whether its rows come in runs of one key.

Below the store and ingest both: the writer picks a stored table by `in_key_runs`, ingest's key tracking
(ingest/keys.py) and its streamed summaries read runs by `run_codes`.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis import schema


def single_value(col: pa.ChunkedArray):
    """The value of a column that holds one value in every row (no nulls), else None. One comparison per row,
    where pc.unique hashes every row (~3× the time on a batch of run names)."""
    if len(col) == 0 or col.null_count:
        return None
    first = col[0]
    return first.as_py() if pc.all(pc.equal(col, first)).as_py() else None


# (run names, each row's index into them), see run_codes
Runs = tuple[pa.Array, np.ndarray]


def run_codes(col: pa.ChunkedArray) -> Runs:
    """(run names, each row's index into them as int64) of a run column; a batch of one run (nearly always)
    without hashing every row's name."""
    one = single_value(col)
    if one is not None:
        return pa.array([one], pa.string()), np.zeros(len(col), np.int64)
    encoded = col.combine_chunks().dictionary_encode()
    return encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


def _changes(cols: list[np.ndarray]) -> np.ndarray:
    """For each row but the first: whether its key (one value from each of `cols`) differs from the row before."""
    change = np.zeros(max(len(cols[0]) - 1, 0), bool)
    for c in cols:
        change |= c[1:] != c[:-1]
    return change


def in_key_runs(table: str, data: pa.Table) -> bool:
    """Whether rows of `table` come in runs of one key (run, then schema.KEY_RUN_COLUMNS) at least KEY_RUN rows
    long on average: the rows for the stored tables whose keys are RLE-compressed (schema.FIXED_COMPRESSION).
    True for a table without such columns (its rows have one stored table whatever their order)."""
    if table not in schema.KEY_RUN_COLUMNS:
        return True
    runs = data.column("run_id").to_numpy() if "run_id" in data.column_names else run_codes(data.column("run"))[1]
    change = _changes([runs] + [data.column(c).to_numpy() for c in schema.KEY_RUN_COLUMNS[table]])
    return int(change.sum()) * schema.KEY_RUN <= data.num_rows
