"""A file's token summaries computed while its batches stream in, by the one-pass kernel (kernel.py).

Ingest hands every checked `tokens` batch to `StepSummaries.feed` (file_rows.FileRows, in a large file's
read-ahead worker, while DuckDB inserts on the main thread). The batches of a file in (run, step) order make one group of accumulators per (run, step):
a step may span several batches, its sequences get a dense index as their samples first appear. When the
(run, step) changes, the finished step becomes summary rows (`kernel.tables`), an Arrow table per summary
table, which ingest appends to the summary tables with the file's id, in the file's transaction (a file that is
then refused takes them with it in the rollback).

A file this does not handle gives up (`ok` False) and ingest deletes the rows it appended (`emitted`) and falls
back to the SQL over the stored rows (summarise.py):
a (run, step) that comes back after another one started (a file not ordered by step), a step with more than
`max_sequences` sequences (its accumulators take ~3 KB per sequence) or with lags over more than MAX_LAGS
versions; and a file of many small steps (SMALL_STEPS), which the SQL summarises faster. The rows are the SQL's
to a few ulps (tests/test_summary_kernel.py, tests/test_summary_stream.py).
"""
from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from analysis.ingest import summary_files
from analysis.ingest.keys import Runs, run_codes
from analysis.summaries import kernel as K
from analysis.summaries import schema as S
from analysis.summaries.checks import PENDING_MAX, CheckSums
from analysis.summaries.residual import ResidualSums

log = logging.getLogger(__name__)

MAX_SEQUENCES = 100_000  # sequences of one step held at once (~300 MB of accumulators)
MAX_LAGS = 4096  # lag buckets of one step (~0.5 MB each): versions that are not small counters go to the SQL
# Each step costs the stream ~0.7 ms of Python whatever its tokens (its accumulators, its rows made tables), where
# the SQL costs per token: past SMALL_STEPS steps of fewer than SMALL_STEP_TOKENS tokens on average, the SQL is the
# faster (4M tokens as 4,000 steps: 3.2 s against 5.1 s; 2M as 20,000 steps: 3.3 s against 15.2 s; 40 steps of
# 100k tokens: the same; benchmarks/RESULTS-scale.md), so the stream gives way to it.
SMALL_STEPS, SMALL_STEP_TOKENS = 500, 2_000
TOKEN_TABLES = ("summary_seq", "summary_seq_band", "summary_step", "summary_hist", "summary_bucket",
                "summary_bucket_band")


class _Step:
    """The accumulators of one (run, step), grown as its sequences and lags appear."""

    def __init__(self, run: str, step: int):
        self.run, self.step = run, step
        self.samples = np.empty(0, np.int64)  # sorted sample ids seen so far
        self.index = np.empty(0, np.int64)  # their dense sequence index
        self.n_seq, self.lag_lo, self.n_lag = 0, 0, 0
        self.n_tokens = 0
        self.acc = K.Accumulators.zeros(0, 0)
        self.checks = CheckSums()  # the logging checks' sums (schema.CHECK_SUMS), into the step's row
        self.residual = ResidualSums()  # the residual signatures' counts (schema.RESIDUAL_SUMS), likewise
        self.lp = np.zeros((5, 0))  # per dense sequence index: count and schema.SEQ_SUMS (kernel._seq_sums)

    def seq_index(self, sample: np.ndarray) -> np.ndarray:
        """The dense index of each token's sample, new samples numbered in order of first appearance."""
        uniq, inv = _unique_inverse(sample)
        if len(uniq) and (not len(self.samples) or uniq[0] > self.samples[-1]):
            # the usual case (a log in key order): all new and above every sample seen, so numbered on from n_seq
            # in sorted order, with no lookup, gather or re-sort
            first = self.n_seq
            self.n_seq += len(uniq)
            self.samples = np.concatenate([self.samples, uniq])
            self.index = np.concatenate([self.index, np.arange(first, self.n_seq)])
            return inv + first if first else inv
        at = np.searchsorted(self.samples, uniq)
        known = (at < len(self.samples)) & (self.samples[np.minimum(at, len(self.samples) - 1)] == uniq) \
            if len(self.samples) else np.zeros(len(uniq), bool)
        idx = np.empty(len(uniq), np.int64)
        idx[known] = self.index[at[known]]
        new = ~known
        idx[new] = self.n_seq + np.arange(new.sum())
        if new.any():
            self.n_seq += int(new.sum())
            samples = np.concatenate([self.samples, uniq[new]])
            order = np.argsort(samples, kind="stable")
            self.samples, self.index = samples[order], np.concatenate([self.index, idx[new]])[order]
        return idx[inv]

    def fit(self, seen: np.ndarray) -> bool:
        """Grow the accumulators to n_seq sequences and to the lag range of the (non-null) lags `seen`;
        False, leaving them as they are, where that range would span more than MAX_LAGS lags."""
        lo, n_lag = self.lag_lo, self.n_lag
        if len(seen):
            a, b = int(seen.min()), int(seen.max())
            if n_lag:
                a, b = min(a, lo), max(b, lo + n_lag - 1)
            lo, n_lag = a, b - a + 1
        if n_lag > MAX_LAGS:
            return False
        cap = len(self.acc.seq_max_pos)
        if self.n_seq <= cap and (lo, n_lag) == (self.lag_lo, self.n_lag):
            return True
        cap = max(self.n_seq, min(2 * cap, MAX_SEQUENCES), 64) if self.n_seq > cap else cap
        self.acc = _resized(self.acc, cap, n_lag, self.lag_lo - lo if self.n_lag else 0)
        self.lag_lo, self.n_lag = lo, n_lag
        return True

    def add_logprobs(self, part: np.ndarray) -> None:
        """Add a batch's per-sequence log-prob sums (schema.SEQ_SUMS, as Accumulators.add's seq_sums_out)."""
        if part.shape[1] > self.lp.shape[1]:
            self.lp = np.pad(self.lp, ((0, 0), (0, part.shape[1] - self.lp.shape[1])))
        self.lp[:, :part.shape[1]] += part

    def tables(self) -> dict[str, dict]:
        """The step's summary tables that have rows: their columns (numpy, without run and step)."""
        samples = np.zeros(len(self.acc.seq_max_pos), np.int64)
        samples[self.index] = self.samples
        tables = K.tables(self.acc, samples, self.lag_lo, self.n_lag)
        if tables["summary_step"]:
            tables["summary_step"] |= {k: [v] for k, v in self.checks.row().items()}
            tables["summary_step"] |= {k: [v] for k, v in self.residual.row().items()}
        seq = tables["summary_seq"]
        if seq:
            idx = self.index[np.searchsorted(self.samples, seq["sample"])]
            lp = self.lp[:, idx]
            seq |= {"n_lp_tokens": lp[0].astype(np.int64)} | dict(zip(S.SEQ_SUM_NAMES[1:], lp[1:]))
        return {name: tables[name] for name in TOKEN_TABLES if summary_files.n_rows(tables[name])}


# Summary rows of finished steps held as numpy columns until this many, then made Arrow tables at once: one Arrow
# array per column for all of them, where one per step (~150 conversions over the six tables) cost ~1.6 ms a step,
# 16 ns a token at 100k tokens a step. Bounded: ~10 MB of columns.
PENDING_ROWS = 50_000


def _arrow_rows(name: str, parts: list[tuple[str, int, dict]]) -> pa.Table:
    """The rows of summary table `name` from several steps' columns (each step's table has the same columns:
    kernel.tables), typed as stored, with run and step."""
    counts = [summary_files.n_rows(cols) for _, _, cols in parts]
    runs = [run for run, _, _ in parts]
    one_run = all(r == runs[0] for r in runs)
    step = np.repeat(np.array([st for _, st, _ in parts], np.int64), counts)
    columns = {k: np.concatenate([np.asarray(cols[k]) for _, _, cols in parts]) for k in parts[0][2]}
    return summary_files.rows_of(name, runs[0] if one_run else np.repeat(np.array(runs, object), counts), step,
                                 columns)


def _unique_inverse(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(v, return_inverse=True), without its sort where v is already non-decreasing (a log's
    samples within a step almost always are): that sort was ~1 s of CPU per 40M tokens."""
    if len(v) > 1 and not (v[1:] >= v[:-1]).all():
        return np.unique(v, return_inverse=True)
    new = np.empty(len(v), bool)
    new[:1] = True
    np.not_equal(v[1:], v[:-1], out=new[1:])
    return v[new], np.cumsum(new) - 1


def _resized(acc: K.Accumulators, cap: int, n_lag: int, shift: int) -> K.Accumulators:
    """Empty accumulators for `cap` sequences and n_lag lags holding `acc`'s sums; its lag row k moves to k + shift."""
    new = K.Accumulators.zeros(cap, n_lag)
    n = len(acc.seq_max_pos)
    old_lag = acc.wide.shape[1] - K.LAG0
    for name in ("seq", "seq_top", "seq_max_pos", "seq_flip"):  # sequences: rows 0 .. n − 1
        a = getattr(acc, name)
        getattr(new, name)[(slice(None),) * (a.ndim - 2) + (slice(0, n),)] = a
    new.seq_band[:, :n * K.NB] = acc.seq_band
    for name, per in (("wide", 1), ("wide_top", 1), ("band", K.NB)):  # buckets, then the lag rows shifted
        a, b = getattr(acc, name), getattr(new, name)
        lead = (slice(None),) * (a.ndim - 2)
        b[lead + (slice(0, K.LAG0 * per),)] = a[lead + (slice(0, K.LAG0 * per),)]
        to = (K.LAG0 + shift) * per
        b[lead + (slice(to, to + old_lag * per),)] = a[lead + (slice(K.LAG0 * per, None),)]
    new.hist[...], new.flip[...] = acc.hist, acc.flip
    return new


def _optional(data: pa.Table, name: str) -> pa.ChunkedArray | None:
    return data.column(name) if name in data.column_names else None


def _lags(data: pa.Table) -> np.ndarray:
    """trainer_version − sampler_version per token; −1 where either is null or absent (made ≥ 0 by the caller)."""
    tv, sv = _optional(data, "trainer_version"), _optional(data, "sampler_version")
    if tv is None or sv is None:
        return np.empty(0, np.int64)
    lag = pc.subtract_checked(tv, sv)  # an overflow raises: the SQL then refuses the file as before
    return np.asarray(pc.fill_null(lag, np.iinfo(np.int64).min).to_numpy(), np.int64)


class StepSummaries:
    """Token summaries of one file, per (run, step), fed batch by batch; see the module docstring."""

    def __init__(self, max_sequences: int | None = None):
        self.max_sequences = MAX_SEQUENCES if max_sequences is None else max_sequences
        self.ok = True
        self.why = ""
        self.steps = 0  # (run, step) groups summarised
        self.tokens = 0  # tokens of those groups
        self._cur: _Step | None = None
        self._done: set[tuple[str, int]] = set()
        self.emitted = False  # whether rows were returned (and appended by the caller) before any give-up
        self._pending: list[tuple[str, int, dict]] = []  # finished steps' tables, not yet Arrow (PENDING_ROWS)
        self._pending_rows = 0

    def _give_up(self, why: str) -> None:
        self.ok, self.why, self._cur = False, why, None
        self._pending, self._pending_rows = [], 0

    def feed(self, data: pa.Table, runs: Runs | None = None) -> list[tuple[str, pa.Table]]:
        """Add a tokens batch; (summary table, rows) of the steps it finished (without file_id). `runs`: run_codes
        of its run column, when the caller has them.
        An unexpected error gives up (logged) rather than refuse the file: the SQL then summarises it."""
        if not self.ok or data.num_rows == 0:
            return []
        try:
            return self._feed(data, runs or run_codes(data.column("run")))
        except Exception as e:
            log.warning("token summaries while streaming failed; the SQL computes them", exc_info=e)
            self._give_up(f"{type(e).__name__} while streaming")
            return []

    def _feed(self, data: pa.Table, runs: Runs) -> list[tuple[str, pa.Table]]:
        runs, codes = runs
        names = runs.to_pylist()
        step = np.asarray(data.column("step").to_numpy(), np.int64)
        changed = step[1:] != step[:-1]
        if len(names) > 1:
            changed |= codes[1:] != codes[:-1]
        cut = np.flatnonzero(changed) + 1
        bounds = np.concatenate([[0], cut, [len(step)]])
        s = np.asarray(data.column("sampler_logprob").to_numpy(), np.float64)
        t = np.asarray(data.column("trainer_logprob").to_numpy(), np.float64)
        pos = np.asarray(data.column("pos").to_numpy(), np.int64)
        sample = np.asarray(data.column("sample").to_numpy(), np.int64)
        ent = _optional(data, "sampler_entropy")
        entropy = None if ent is None else np.asarray(pc.fill_null(ent, np.nan).to_numpy(), np.float64)
        seg = _optional(data, "segment")
        segment = None if seg is None else np.asarray(pc.fill_null(seg, -1).to_numpy(), np.int64)
        lags = _lags(data)
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            key = (names[codes[a]], int(step[a]))
            cur = self._cur
            if cur is None or (cur.run, cur.step) != key:
                if key in self._done:
                    self._give_up(f"run {key[0]!r}, step {key[1]} comes back after another step: not ordered by step")
                    return out
                if cur is not None:
                    out += self._step_done(cur)
                    if not self.ok:  # many small steps: the SQL summarises the file
                        return []
                self._done.add(key)
                cur = self._cur = _Step(*key)
            seq = cur.seq_index(sample[a:b])
            if cur.n_seq > self.max_sequences:
                self._give_up(f"run {key[0]!r}, step {key[1]} has more than {self.max_sequences} sequences")
                return out
            lag = lags[a:b]
            none = lag == np.iinfo(np.int64).min
            if not cur.fit(lag[~none]):
                self._give_up(f"run {key[0]!r}, step {key[1]} has lags over more than {MAX_LAGS} versions")
                return out
            tok_lag = np.where(none, -1, lag - cur.lag_lo) if len(lag) else None
            lp = np.zeros((5, cur.n_seq))  # the tokens' per-sequence log-prob sums, from the kernel's pass
            cur.acc.add(s[a:b], t[a:b], pos=pos[a:b], seq=seq, tok_lag=tok_lag,
                        entropy=None if entropy is None else entropy[a:b], seq_sums_out=lp)
            d = t[a:b] - s[a:b]  # Δ as stored, for the two below
            if not cur.checks.add(s[a:b], t[a:b], pos[a:b], seq, d):
                self._give_up(f"run {key[0]!r}, step {key[1]}: more than {PENDING_MAX} tokens wait for a "
                              "neighbour (tokens far from key order)")
                return out
            cur.add_logprobs(lp)
            cur.residual.add(d, seq, pos[a:b], None if segment is None else segment[a:b])
            cur.n_tokens += int(b - a)
        return out

    def _step_done(self, step: _Step) -> list[tuple[str, pa.Table]]:
        """Hold a finished step's rows; (summary table, rows) of the steps held so far once they are enough."""
        self.steps += 1
        self.tokens += step.n_tokens
        if self.steps >= SMALL_STEPS and self.tokens < SMALL_STEP_TOKENS * self.steps:
            self._give_up(f"{self.steps} steps of {self.tokens / self.steps:.0f} tokens on average: the SQL "
                          "summarises many small steps faster")
            return []
        tables = step.tables()
        self._pending.append((step.run, step.step, tables))
        self._pending_rows += sum(summary_files.n_rows(cols) for cols in tables.values())
        return self._flush() if self._pending_rows >= PENDING_ROWS else []

    def _flush(self) -> list[tuple[str, pa.Table]]:
        """(summary table, rows) of every step held, one Arrow table per summary table."""
        out = []
        for name in TOKEN_TABLES:
            parts = [(run, step, tables[name]) for run, step, tables in self._pending if name in tables]
            if parts:
                out.append((name, _arrow_rows(name, parts)))
        self._pending, self._pending_rows = [], 0
        self.emitted = self.emitted or bool(out)
        return out

    def finish(self) -> list[tuple[str, pa.Table]]:
        """The rows of the steps not returned yet, the last one included (call after the last batch)."""
        if not self.ok:
            return []
        out = self._step_done(self._cur) if self._cur is not None else []
        self._cur = None
        return out + self._flush()
