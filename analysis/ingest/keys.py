"""Cheap key bookkeeping during a load: duplicate detection, the tokens a routing file refers to, and
expert-load counts, gathered batch by batch in numpy so the checks after the load touch little data.

Logs are almost always written in key order; for those, "no duplicate key" is a linear scan
(keys strictly increasing). Files in any other order fall back to an exact SQL check.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.ingest import routing_kernel
from analysis.key_runs import Runs, _changes, in_key_runs, run_codes, single_value  # noqa: F401 (re-exported)

KEY_INT = {"tokens": ("step", "sample", "pos"), "routing": ("step", "sample", "pos", "layer"),
           "sequences": ("step", "sample"), "topk": ("step", "sample", "pos")}


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
    """Tracks whether one table's keys, over all batches of a file, are strictly increasing, and the runs and
    the step range they cover (rows of other files outside them cannot share a key with this file)."""

    def __init__(self, table: str):
        self.names = KEY_INT[table]
        self.ordered = True
        self.run: str | None = None
        self.last: tuple | None = None
        self.runs: set[str] = set()
        self.steps: tuple[int, int] | None = None  # (lowest, highest)

    def add(self, data: pa.Table, runs: Runs | None = None) -> None:
        """`runs`: run_codes of data's run column, when the caller has them."""
        if not data.num_rows:
            return
        runs = (runs or run_codes(data.column("run")))[0].to_pylist()
        self.runs.update(runs)
        lo, hi = (v.as_py() for v in pc.min_max(data.column("step")).values())
        self.steps = (lo, hi) if self.steps is None else (min(lo, self.steps[0]), max(hi, self.steps[1]))
        if not self.ordered:
            return
        cols = [data.column(c).to_numpy() for c in self.names]
        if len(runs) != 1 or (self.run is not None and runs[0] != self.run):
            self.ordered = False
            return
        self.run = runs[0]
        if self.last is not None and tuple(int(c[0]) for c in cols) <= self.last:
            self.ordered = False
            return
        if not _strictly_increasing(cols):
            self.ordered = False
            return
        self.last = tuple(int(c[-1]) for c in cols)


def routing_tokens(data: pa.Table) -> pa.Table:
    """The distinct (run, step, sample, pos) that a key-ordered routing batch refers to (one row per token,
    not per (token, layer)), with the token's flip counts over this batch's layers: n_both (layers with
    routing of both sides), n_fl (of those, layers whose expert sets differ) and first_flip (the lowest such
    layer; null: none). Staged in the database (one row per token across batches: TokenFlips): the orphan check
    joins them with the token rows, and the per-token flip summaries read that join rather than group every
    (token, layer) row again (analysis/ingest/summarise.py)."""
    step, sample, pos = (data.column(c).to_numpy() for c in ("step", "sample", "pos"))
    new = np.ones(len(step), dtype=bool)
    new[1:] = _changes([step, sample, pos])
    starts = np.flatnonzero(new)
    flip_col = data.column("flip")
    both = pc.is_valid(flip_col).to_numpy(zero_copy_only=False)
    flip = pc.fill_null(flip_col, False).to_numpy(zero_copy_only=False)
    layer = np.asarray(data.column("layer").to_numpy(), np.int64)
    none = np.iinfo(np.int64).max

    def per_token(ufunc, values: np.ndarray) -> np.ndarray:  # over each token's rows (reduceat needs a start)
        return ufunc.reduceat(values, starts) if len(starts) else values[:0]
    first = per_token(np.minimum, np.where(flip, layer, none))
    return data.select(["run", "step", "sample", "pos"]).take(pa.array(starts)).append_column(
        "n_both", pa.array(per_token(np.add, both.astype(np.int64)))
    ).append_column("n_fl", pa.array(per_token(np.add, flip.astype(np.int64)))
    ).append_column("first_flip", pa.array(first, mask=first == none))


class CarryLast:
    """The rows of a file in key order, batch after batch, with each value of `key` in one batch's rows only: a
    batch's rows of its last key are held back and, where the next batch starts with the same key, joined with
    its rows of that key by `combine` (rows of one key -> their one group's rows). Used where a key's rows may
    span two batches and the database should not have to group them again (TokenFlips, StepCounts)."""

    def __init__(self, key: tuple[str, ...], combine):
        self.key, self.combine = key, combine
        self._held: pa.Table | None = None  # rows of the latest key, which the next batch may continue

    def add(self, part: pa.Table) -> pa.Table | None:
        """The rows of the keys the next batch `part` finished (None: none yet)."""
        n = part.num_rows
        if not n:
            return None
        starts = np.flatnonzero(_changes([part.column(c).to_numpy() for c in self.key])) + 1
        first_end, last_start = (int(starts[0]), int(starts[-1])) if len(starts) else (n, 0)
        held, out, start = self._held, [], 0
        if held is not None and all(held.column(c)[0].as_py() == part.column(c)[0].as_py() for c in self.key):
            joined = self.combine(pa.concat_tables([held, part.slice(0, first_end)]))
            if first_end == n:  # the batch continues the held key only
                self._held = joined
                return None
            out.append(joined)
            start = first_end
        elif held is not None:
            out.append(held)
        out.append(part.slice(start, last_start - start))
        self._held = part.slice(last_start)
        done = pa.concat_tables(out)
        return done if done.num_rows else None

    def finish(self) -> pa.Table | None:
        """The rows still held (the file's last key)."""
        held, self._held = self._held, None
        return held


def _token_flips(rows: pa.Table) -> pa.Table:
    """One token's rows of `routing_tokens` (its layers in two batches) as one row: counts added, the lowest
    first flip."""
    def one(value, type_) -> pa.Array:
        return pa.array([value.as_py()], type_)
    return rows.slice(0, 1).select(["run", "step", "sample", "pos"]).append_column(
        "n_both", one(pc.sum(rows.column("n_both")), pa.int64())
    ).append_column("n_fl", one(pc.sum(rows.column("n_fl")), pa.int64())
    ).append_column("first_flip", one(pc.min(rows.column("first_flip")), rows.schema.field("first_flip").type))


class TokenFlips(CarryLast):
    """`routing_tokens` of a key-ordered routing file's batches (one run), one row per token over the whole file:
    where a token's layers span two batches its two rows become one, so the database needs no GROUP BY over the
    staged rows (0.09 s for the 16M-row benchmark file)."""

    def __init__(self):
        super().__init__(("step", "sample", "pos"), _token_flips)


# Expert-load counts are a dense array over (run, step, layer) x expert id where that stays this small (32 MB a
# side); files with larger layer or expert ids (ids numbered across layers, or hashed) count the pairs they hold.
DENSE_COUNTS = 1 << 22


def _dense_counts(row_code, n_expert, size, S, T, t_rows):
    """(row code, expert, [sampler counts, trainer counts]) of every pair routed on either side: one array cell
    per possible pair (`size` of them)."""
    counts = []
    for M, rows in ((S, None), (T, t_rows)):
        n = np.zeros(size, dtype=np.int64)
        if M is not None and M.size:
            base = (row_code if rows is None else row_code[rows]) * n_expert
            routing_kernel.count_experts(base, M, n)
        counts.append(n)
    code = np.flatnonzero(counts[0] | counts[1])
    rest, expert = np.divmod(code, n_expert)
    return rest, expert, [n[code] for n in counts]


def _sparse_counts(row_code, n_expert, S, T, t_rows):
    """The same as _dense_counts, from the pairs that occur (sorted once): for ids too large for a dense array.
    Row codes are first renumbered densely, so that row x expert stays within int64."""
    rows_seen, dense_row = np.unique(row_code, return_inverse=True)
    keys = [(dense_row if rows is None else dense_row[rows])[:, None] * n_expert + M
            if M is not None and M.size else np.zeros((0, 1), np.int64)
            for M, rows in ((S, None), (T, t_rows))]
    keys = [k.astype(np.int64).ravel() for k in keys]
    pairs = np.unique(np.concatenate(keys))
    counts = [np.bincount(np.searchsorted(pairs, k), minlength=len(pairs)).astype(np.int64) for k in keys]
    row, expert = np.divmod(pairs, n_expert)
    return rows_seen[row], expert, counts


def expert_load(data: pa.Table, S: np.ndarray, T: np.ndarray | None, t_rows: np.ndarray,
                runs: Runs | None = None) -> pa.Table:
    """Tokens routed to each expert per (run, step, layer), for each side, in one routing batch.

    A (run, step, layer, expert) may appear in several batches: the rows are partial counts, summed across
    batches as they come (StepCounts) or, for a file out of key order, in the database at the end of the file
    (`Writer.regroup_expert_load`), so memory stays one batch's worth. `runs`: run_codes of data's run column,
    when the caller has them."""
    # hash-based dictionary encoding: np.unique would sort millions of (string) keys; a batch of one run and a
    # few consecutive steps (a log in key order) needs neither
    run_names, run_i = runs or run_codes(data.column("run"))
    steps = data.column("step").to_numpy()
    lo, hi = int(steps.min()), int(steps.max())
    if hi - lo < 1024:  # steps as offsets from the lowest (a step with no row gets no count below)
        step_values, step_i = pa.array(np.arange(lo, hi + 1, dtype=np.int64)), steps.astype(np.int64) - lo
    else:
        step_d = data.column("step").combine_chunks().dictionary_encode()
        step_values, step_i = step_d.dictionary, step_d.indices.to_numpy().astype(np.int64)
    n_step = len(step_values)
    layers = data.column("layer").to_numpy().astype(np.int64)
    n_layer = int(layers.max()) + 1
    row_code = (run_i * n_step + step_i) * n_layer + layers  # one code per (run, step, layer)
    n_expert = max(int(M.max()) + 1 for M in (S, T) if M is not None and M.size)
    size = (int(row_code.max()) + 1) * n_expert
    if size <= DENSE_COUNTS:
        rest, expert, counts = _dense_counts(row_code, n_expert, size, S, T, t_rows)
    else:  # large ids (of layers or experts): count the (row, expert) pairs that occur
        rest, expert, counts = _sparse_counts(row_code, n_expert, S, T, t_rows)
    rest, layer = np.divmod(rest, n_layer)
    ri, si = np.divmod(rest, n_step)
    return pa.table({
        "run": run_names.take(pa.array(ri)),
        "step": step_values.take(pa.array(si)).cast(pa.int64()),
        "layer": pa.array(layer.astype(np.int32)),
        "expert": pa.array(expert.astype(np.int32)),
        "n_sampler": pa.array(counts[0]),
        "n_trainer": pa.array(counts[1]),
    })


class StepCounts:
    """A routing file's expert-load rows (`expert_load` of each batch) with each (run, step, layer, expert) once,
    where the file comes in key order (one run): a step's rows that span two batches are summed (CarryLast), so the
    rows are appended to `expert_load` as they are final, with no GROUP BY in the database (staging the 1.07M
    partial rows of the 16M-row benchmark file and grouping them took 0.30 s where a plain append of the 819k
    summed ones takes 0.09 s). Once a batch is out of order (or a batch's rows are not in step order), `merged`
    turns False and the rest pass through as partial counts, which `Writer.regroup_expert_load` sums at the end
    of the file."""

    def __init__(self):
        self.merged = True
        self._steps = CarryLast(("step",), _sum_counts)

    def add(self, part: pa.Table, ordered: bool) -> pa.Table | None:
        """The rows to stage now, given the next batch's partial counts `part` and whether the file's keys are
        still in order (TableKeys.ordered after that batch); None: nothing yet."""
        steps = part.column("step").to_numpy()
        if self.merged and (not ordered or (steps[1:] < steps[:-1]).any()):
            self.merged = False
        if self.merged:
            return self._steps.add(part)
        held = self._steps.finish()
        return part if held is None else pa.concat_tables([held, part])

    def finish(self) -> pa.Table | None:
        """The rows still held (the file's last step)."""
        return self._steps.finish()


def _sum_counts(rows: pa.Table) -> pa.Table:
    """Rows of one (run, step) with each (layer, expert) once, their counts summed, in (layer, expert) order."""
    layer = rows.column("layer").to_numpy().astype(np.int64)
    expert = rows.column("expert").to_numpy().astype(np.int64)
    code = layer * (int(expert.max()) + 1) + expert
    uniq, first, inv = np.unique(code, return_index=True, return_inverse=True)
    sums = {}
    for c in ("n_sampler", "n_trainer"):
        total = np.zeros(len(uniq), np.int64)
        np.add.at(total, inv, rows.column(c).to_numpy())
        sums[c] = pa.array(total)
    return rows.select(["run", "step", "layer", "expert"]).take(pa.array(first)) \
        .append_column("n_sampler", sums["n_sampler"]).append_column("n_trainer", sums["n_trainer"])
