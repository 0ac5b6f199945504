"""Pieces the framework importers share: dense-layer detection, canonical batches."""
from __future__ import annotations

import json
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from analysis.ingest.errors import CorruptFile, WrongType
from analysis.ingest.limits import Limits
from analysis.ingest.textio import iter_lines
from analysis.ingest.validate import Batch
from analysis.routing_rows import routing_columns

# A sample id must stay unique within (run, step): prime-rl packs (rank, export_sequence_idx) into one
# BIGINT as rank * SAMPLE_STRIDE + export_sequence_idx, readable in decimal (2000017 = rank 2, record 17).
SAMPLE_STRIDE = 1_000_000


def need_dict(obj: Any, name: str, where: str, example: str) -> dict:
    if not isinstance(obj, dict):
        raise WrongType(name, where, f"expected a dict, got {type(obj).__name__}", example)
    return obj


def scalar_config(items: dict, keys: Sequence[str] | None = None) -> dict:
    """The JSON-able scalar entries of `items` (optionally only `keys`), for a run's config."""
    out = {}
    for k, v in items.items():
        if keys is not None and k not in keys:
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        if isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not np.isfinite(v)):
            out[str(k)] = v
    return out


class Columns:
    """Column parts for one canonical table, joined into one Arrow batch on `flush`."""

    def __init__(self, table: str):
        self.table = table
        self.parts: list[dict[str, Any]] = []
        self.where: list[Callable[[int], str]] = []
        self.sizes: list[int] = []

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def add(self, cols: dict[str, Any], where: Callable[[int], str]) -> None:
        n = len(next(iter(cols.values())))
        if n:
            self.parts.append(cols)
            self.where.append(where)
            self.sizes.append(n)

    def flush(self) -> Batch | None:
        if not self.parts:
            return None
        names = list(dict.fromkeys(c for p in self.parts for c in p))
        data = {}
        for c in names:
            chunks = [_arrow(p[c]) if c in p else None for p in self.parts]
            typ = next(a.type for a in chunks if a is not None and a.type != pa.null()) \
                if any(a is not None and a.type != pa.null() for a in chunks) else pa.null()
            data[c] = pa.concat_arrays([a.cast(typ) if a is not None else pa.nulls(n, typ)
                                        for a, n in zip(chunks, self.sizes)])
        starts = np.cumsum([0] + self.sizes)
        wheres = self.where

        def where(i: int) -> str:
            part = int(np.searchsorted(starts, i, side="right") - 1)
            return wheres[part](i - int(starts[part]))

        batch = Batch(self.table, pa.table(data), where)
        self.parts, self.where, self.sizes = [], [], []
        return batch


def _arrow(v: Any) -> pa.Array:
    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return v.combine_chunks() if isinstance(v, pa.ChunkedArray) else v
    return pa.array(v)


def routing_part(run: str | None, step: int, sample: np.ndarray, pos: np.ndarray, experts: np.ndarray) -> dict:
    """Routing columns (sampler side only: trainer_experts stays NULL) for tokens (sample, pos) with
    experts [n, L, K], one row per (token, layer), layers numbered 0..L-1 in order."""
    n = len(experts)
    keys: dict[str, Any] = {"step": np.full(n, step, dtype=np.int64), "sample": np.asarray(sample, dtype=np.int64),
                            "pos": np.asarray(pos, dtype=np.int32)}
    if run is not None:
        keys["run"] = pa.array([run] * n, pa.string())
    return routing_columns(keys, experts)


def flush(*cols: Columns) -> Iterator[Batch]:
    """The batches of the given column parts, emptying them."""
    for c in cols:
        batch = c.flush()
        if batch is not None:
            yield batch


def json_records(fp: BinaryIO, name: str, limits: Limits, label: str = "") -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank JSON line of `fp`; `label` prefixes the place (a file of a unit)."""
    for line_no, line in iter_lines(fp, name, limits):
        if not line.strip():
            continue
        where = f"{label}line {line_no}"
        try:
            yield where, json.loads(line)
        except ValueError as e:
            raise CorruptFile(name, where, f"invalid JSON ({e})", "the file is truncated or still being written") \
                from None
