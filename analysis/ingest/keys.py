"""Cheap key bookkeeping during a load: duplicate detection, the tokens a routing file refers to, and
expert-load counts, gathered batch by batch in numpy so the checks after the load touch little data.

Logs are almost always written in key order; for those, "no duplicate key" is a linear scan
(keys strictly increasing). Files in any other order fall back to an exact SQL check.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

KEY_INT = {"tokens": ("step", "sample", "pos"), "routing": ("step", "sample", "pos", "layer"),
           "sequences": ("step", "sample")}


def _strictly_increasing(cols: list[np.ndarray]) -> bool:
    n = len(cols[0])
    if n < 2:
        return True
    gt = np.zeros(n - 1, dtype=bool)
    eq = np.ones(n - 1, dtype=bool)
    for c in cols:
        gt |= eq & (c[1:] > c[:-1])
        eq &= c[1:] == c[:-1]
    return bool(gt.all())


class TableKeys:
    """Tracks whether one table's keys, over all batches of a file, are strictly increasing."""

    def __init__(self, table: str):
        self.names = KEY_INT[table]
        self.ordered = True
        self.run: str | None = None
        self.last: tuple | None = None

    def add(self, data: pa.Table) -> None:
        if not self.ordered or not data.num_rows:
            return
        cols = [data.column(c).to_numpy() for c in self.names]
        runs = data.column("run")
        first_run = runs[0].as_py()
        if (self.run is not None and first_run != self.run) or not _single_value(runs):
            self.ordered = False
            return
        self.run = first_run
        if self.last is not None and tuple(int(c[0]) for c in cols) <= self.last:
            self.ordered = False
            return
        if not _strictly_increasing(cols):
            self.ordered = False
            return
        self.last = tuple(int(c[-1]) for c in cols)


def _single_value(arr: pa.ChunkedArray) -> bool:
    import pyarrow.compute as pc
    return pc.count_distinct(arr).as_py() == 1


class RoutingTokens:
    """The distinct (run, step, sample, pos) that routing rows refer to, while rows arrive in key order."""

    def __init__(self):
        self.parts: list[pa.Table] = []

    def add(self, data: pa.Table) -> None:
        step, sample, pos = (data.column(c).to_numpy() for c in ("step", "sample", "pos"))
        new = np.ones(len(step), dtype=bool)
        new[1:] = (step[1:] != step[:-1]) | (sample[1:] != sample[:-1]) | (pos[1:] != pos[:-1])
        idx = np.flatnonzero(new)
        self.parts.append(data.select(["run", "step", "sample", "pos"]).take(pa.array(idx)))

    def table(self) -> pa.Table:
        return pa.concat_tables(self.parts)


class ExpertLoad:
    """Tokens routed to each expert per (run, step, layer), for each side, summed over batches."""

    def __init__(self):
        self.counts: dict[tuple[str, int, int, int], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, data: pa.Table, S: np.ndarray, T: np.ndarray | None, t_rows: np.ndarray) -> None:
        # hash-based dictionary encoding: np.unique would sort millions of (string) keys
        run_d = data.column("run").combine_chunks().dictionary_encode()
        step_d = data.column("step").combine_chunks().dictionary_encode()
        run_u, step_u = run_d.dictionary.to_pylist(), step_d.dictionary.to_pylist()
        run_i = run_d.indices.to_numpy().astype(np.int64)
        step_i = step_d.indices.to_numpy().astype(np.int64)
        layers = data.column("layer").to_numpy().astype(np.int64)
        n_layer = int(layers.max()) + 1
        row_code = (run_i * len(step_u) + step_i) * n_layer + layers  # one code per (run, step, layer)
        for side, M, rows in ((0, S, None), (1, T, t_rows)):
            if M is None or M.size == 0:
                continue
            rc = row_code if rows is None else row_code[rows]
            n_expert = int(M.max()) + 1
            base = rc * n_expert
            size = int(base.max()) + n_expert
            n = np.zeros(size, dtype=np.int64)
            for c in range(M.shape[1]):  # one rank at a time: no [rows * k] temporary
                n += np.bincount(base + M[:, c], minlength=size)
            for c in np.flatnonzero(n).tolist():
                rs, ex = divmod(c, n_expert)
                rs, la = divmod(rs, n_layer)
                ri, si = divmod(rs, len(step_u))
                self.counts[(run_u[ri], step_u[si], la, ex)][side] += int(n[c])

    def table(self, file_id: int) -> pa.Table:
        items = sorted(self.counts.items())
        return pa.table({
            "run": pa.array([k[0] for k, _ in items], pa.string()),
            "step": pa.array([k[1] for k, _ in items], pa.int64()),
            "layer": pa.array([k[2] for k, _ in items], pa.int32()),
            "expert": pa.array([k[3] for k, _ in items], pa.int32()),
            "n_sampler": pa.array([v[0] for _, v in items], pa.int64()),
            "n_trainer": pa.array([v[1] for _, v in items], pa.int64()),
            "file_id": pa.array([file_id] * len(items), pa.int32()),
        })
