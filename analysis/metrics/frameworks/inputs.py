"""Per-sequence inputs of the framework views: one entry per sequence (numpy arrays sorted by run, step, sample)
with every sum a framework formula reads, and the reducers over groups of them (`Groups`).

From the per-sequence summaries (`summary_seq`, one plain scan of the columns a view reads): the token sums of
schema.py (Σ Δ, Σ Δ², Σ k3, Σ (r − 1), ... with r = exp(clamp(Δ, −20, 20))). At a ratio bound C (schema.CAPS, or
any band edge), the counts and sums of r − 1 above ln C, below −ln C, between, and below 0: per sequence from its
band rows outside [1/C, C] (`summary_seq_band`; the sums within by subtraction), or per step from the Δ
histogram (`summary_hist`) for views that only add them up over a group's tokens.

From the per-sequence log-prob sums of summary_seq (schema.SEQ_SUMS): Σ s, Σ t (verl's and our perplexities),
Σ log cosh(Δ/2) (NeMo's Jensen-Shannon term, a function of Δ alone) and Σ r·t (NeMo approx_entropy). A sequence
whose rows predate those sums (n_lp_tokens short of its n_tokens) has them summed from its token rows instead
(`logprob_sql`, only for the steps that need it).

From the token rows, only what the summaries do not hold:
  * `extremes`: the frameworks exponentiate Δ unclamped (verl k3_kl, NeMo, slime, prime-rl) or clamp Δ per token
    before a sum (verl rejection). Tokens with |Δ| > 20 are the only ones where that differs from the summaries;
    one filtered scan sums the differences per sequence (steps without such tokens are skipped by the summaries'
    max |Δ|).
  * `token_columns`: a view's own per-sequence token sums (verl's token rejection options), the tokens below a
    veto threshold (only steps whose summaries hold one), and `reward` from table sequences.
These are exact where the token rows are complete (`read.coverage`); on a DriftLogger sample they cover the
kept rows only.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import polars as pl

from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries.schema import (BAND_EDGES, CAPS, CLAMP, D_EDGES, SEQ_SUM_NAMES, TOPK_SUM_NAMES, columns,
                                      merge_kind)
from analysis.summaries.sql import clamp_log_ratio_sql, log_cosh_half_sql, run_filter, token_filter

EXTREME_COLUMNS = ("ext_d", "ext_d2", "ext_r_hi", "ext_r_lo", "ext_ri_hi", "ext_ri_lo", "ext_rt")
LOGPROB_COLUMNS = ("sum_s", "sum_t", "sum_js", "sum_rt")  # schema.SEQ_SUMS less n_lp_tokens


LN_SAFE = math.log(100.0)  # a sequence whose max Δ is above: its mid-band sums are read, not subtracted


def band_sql(where: str, signs: bool) -> str:
    """Per sequence, from its ratio-band rows outside [1/C, C] (parameters of `band_params`): n_hi and n_lo, the
    tokens with Δ > ln C and Δ < −ln C, a_hi / a_lo = Σ (r − 1) and b_hi / b_lo = Σ (r − 1)² over them, and with
    signs=True rm1_neg = Σ (r − 1) over Δ < 0. Only those band rows: the bands within [1/C, C] hold most rows and
    their sums follow from summary_seq's by subtraction (`sequence_arrays`). A plain sum: a sequence has a few
    band rows, and fsum's compensation cost ~15% of the query for no digit."""
    keep = "band > $hi_bin OR band < $lo_bin" + (" OR band < $zero_bin" if signs else "")
    neg = ", coalesce(sum(sum_rm1) FILTER (WHERE band < $zero_bin), 0) AS rm1_neg" if signs else ""
    return f"""SELECT run, step, sample,
        coalesce(sum(n_tokens) FILTER (WHERE band > $hi_bin), 0)::DOUBLE AS n_hi,
        coalesce(sum(n_tokens) FILTER (WHERE band < $lo_bin), 0)::DOUBLE AS n_lo,
        coalesce(sum(sum_rm1) FILTER (WHERE band > $hi_bin), 0) AS a_hi,
        coalesce(sum(sum_rm1) FILTER (WHERE band < $lo_bin), 0) AS a_lo,
        coalesce(sum(sum_rm1_sq) FILTER (WHERE band > $hi_bin), 0) AS b_hi,
        coalesce(sum(sum_rm1_sq) FILTER (WHERE band < $lo_bin), 0) AS b_lo{neg}
        FROM summary_seq_band WHERE ({where}) AND ({keep}) GROUP BY run, step, sample"""


def mid_sql(where: str) -> str:
    """Per sequence, a_mid = Σ (r − 1) and b_mid = Σ (r − 1)² over its bands within [1/C, C], summed directly."""
    return f"""SELECT run, step, sample,
        coalesce(fsum(sum_rm1) FILTER (WHERE band BETWEEN $lo_bin AND $hi_bin), 0) AS a_mid_x,
        coalesce(fsum(sum_rm1_sq) FILTER (WHERE band BETWEEN $lo_bin AND $hi_bin), 0) AS b_mid_x
        FROM summary_seq_band WHERE {where} GROUP BY run, step, sample"""


def hist_band_sql(where: str, signs: bool) -> str:
    """Per (run, step), from the Δ histogram (summary_hist, on D_EDGES, which hold every band edge): the band
    columns of `band_sql` and a_mid, b_mid summed over the step's tokens (parameters of `band_params(...,
    D_EDGES)`). For views that only sum them over a group's tokens: a few rows per step instead of one per
    sequence and band."""
    neg = ", coalesce(fsum(sum_rm1) FILTER (WHERE bin < $zero_bin), 0) AS rm1_neg" if signs else ""
    return f"""SELECT run, step,
        coalesce(sum(n_tokens) FILTER (WHERE bin > $hi_bin), 0)::DOUBLE AS n_hi,
        coalesce(sum(n_tokens) FILTER (WHERE bin < $lo_bin), 0)::DOUBLE AS n_lo,
        coalesce(fsum(sum_rm1) FILTER (WHERE bin < $lo_bin), 0) AS a_lo,
        coalesce(fsum(sum_rm1) FILTER (WHERE bin BETWEEN $lo_bin AND $hi_bin), 0) AS a_mid,
        coalesce(fsum(sum_rm1_sq) FILTER (WHERE bin BETWEEN $lo_bin AND $hi_bin), 0) AS b_mid{neg}
        FROM summary_hist WHERE {where} GROUP BY run, step"""


def _edge(x: float) -> float:
    """The edge of BAND_EDGES that ln of a ratio bound x is (up to rounding: ln 0.5 against −ln 2)."""
    lx = math.log(x)
    for e in BAND_EDGES:
        if math.isclose(e, lx, rel_tol=1e-12, abs_tol=1e-15):
            return e
    raise ValueError(f"no ratio band edge at {x:g}")


def band_params(cap, edges: Sequence[float] = BAND_EDGES) -> dict:
    """Parameters of `band_sql` (`hist_band_sql` with edges=D_EDGES): `cap` C (the bounds 1/C and C) or (lo, hi)
    ratio bounds on band edges; lo = 0 leaves nothing below."""
    if isinstance(cap, tuple):
        lo, hi = cap
        lo_bin = -1 if lo == 0.0 else F.edge_bin(_edge(lo), edges)
        return {"hi_bin": F.edge_bin(_edge(hi), edges), "lo_bin": lo_bin}
    if float(cap) not in CAPS:
        raise ValueError(f"the cap must be one of {', '.join(f'{c:g}' for c in CAPS)} (the ratio bands the "
                         f"summaries keep), got {cap:g}")
    return {"hi_bin": F.edge_bin(_edge(cap), edges), "lo_bin": F.edge_bin(_edge(1.0 / cap), edges)}


def extremes_sql(where: str) -> str:
    """Per sequence with a token |Δ| > CLAMP: what unclamped Δ changes in the sums (d = Δ, c = clamp(Δ)):
    ext_d = Σ (d − c), ext_d2 = Σ (d² − c²), ext_r_hi / ext_r_lo = Σ (e^d − e^c) over d > 20 / d < −20,
    ext_ri_hi / ext_ri_lo = Σ (e^−d − e^−c) likewise (e^d overflows to inf past 709, as in the frameworks),
    ext_rt = Σ (e^d − e^c)·t (what unclamped e^Δ adds to Σ r·t)."""
    cd = clamp_log_ratio_sql("d")
    return f"""SELECT run, step, sample, fsum(d - cd) AS ext_d, fsum(d * d - cd * cd) AS ext_d2,
        coalesce(sum(exp(d) - exp(cd)) FILTER (WHERE d > 0), 0) AS ext_r_hi,
        coalesce(fsum(exp(d) - exp(cd)) FILTER (WHERE d < 0), 0) AS ext_r_lo,
        coalesce(fsum(exp(-d) - exp(-cd)) FILTER (WHERE d > 0), 0) AS ext_ri_hi,
        coalesce(sum(exp(-d) - exp(-cd)) FILTER (WHERE d < 0), 0) AS ext_ri_lo, sum((exp(d) - exp(cd)) * t) AS ext_rt
        FROM (SELECT run, step, sample, d, t, {cd} AS cd FROM (
              SELECT run, step, sample, trainer_logprob - sampler_logprob AS d, trainer_logprob AS t
              FROM tokens WHERE {where}) e_
              WHERE abs(d) > {CLAMP}::DOUBLE) x_
        GROUP BY run, step, sample"""


def logprob_sql(where: str) -> str:
    """Per sequence from the token rows, as schema.SEQ_SUMS: sum_s = Σ s, sum_t = Σ t, sum_js = Σ log cosh(Δ/2),
    sum_rt = Σ r·t with r = e^clamp(Δ, ±20)."""
    return f"""SELECT run, step, sample, fsum(s) AS sum_s, fsum(t) AS sum_t, fsum({log_cosh_half_sql()}) AS sum_js,
        fsum(exp({clamp_log_ratio_sql()}) * t) AS sum_rt
        FROM (SELECT run, step, sample, sampler_logprob AS s, trainer_logprob AS t,
                     trainer_logprob - sampler_logprob AS d FROM tokens WHERE {where}) l_
        GROUP BY run, step, sample"""


def _codes(frame: pl.DataFrame, runs: Sequence[str]) -> np.ndarray:
    """The run of each row as its index in `runs`."""
    if len(runs) == 1:
        return np.zeros(frame.height, np.int64)
    return frame["run"].cast(pl.Enum(list(runs))).to_physical().to_numpy().astype(np.int64)


def _keys(frame: pl.DataFrame, runs: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _codes(frame, runs), frame["step"].to_numpy().astype(np.int64), frame["sample"].to_numpy().astype(np.int64)


def align(q: dict, keys: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """For each (run code, step, sample) of `keys` (each at most once), its row in the sorted, unique sequence
    rows of `q`, or −1 where `q` has no such sequence: a merge of the two key lists, in numpy."""
    n = q["_run"].size
    src = np.r_[np.zeros(n, np.int8), np.ones(keys[0].size, np.int8)]
    run, step, sample = (np.concatenate([q[k], x]) for k, x in zip(("_run", "step", "sample"), keys))
    order = np.lexsort((src, sample, step, run))      # equal keys side by side, the sequence row first
    out = np.full(keys[0].size, -1, np.int64)
    pos = np.flatnonzero(src[order] == 1)
    prev = order[pos - 1]
    hit = (pos > 0) & (src[prev] == 0)
    hit &= (run[prev] == run[order[pos]]) & (step[prev] == step[order[pos]]) & (sample[prev] == sample[order[pos]])
    out[order[pos[hit]] - n] = prev[hit]
    return out


def _put(q: dict, frame: pl.DataFrame, runs: Sequence[str], cols: Sequence[str], fill: float = 0.0,
         where: np.ndarray | None = None) -> None:
    """Columns of a per-sequence query result into `q` (`fill` for sequences it has no row for); with `where`,
    only into those sequences (the others keep their values)."""
    idx = align(q, _keys(frame, runs)) if frame.height else np.zeros(0, np.int64)
    ok = idx >= 0
    for c in cols:
        x = q[c] if where is not None else np.full(q["_run"].size, fill)
        new = x.copy()
        new[idx[ok]] = frame[c].cast(pl.Float64).fill_null(fill).to_numpy()[ok]
        q[c] = np.where(where, new, x) if where is not None else new


def group_starts(q: dict, keys: Sequence[str]) -> np.ndarray:
    """[0, the first row of each later group, n] of sorted rows; keys among "_run", "step", "sample"."""
    n = q["_run"].size
    if not n:
        return np.zeros(1, np.int64)
    change = np.zeros(n, bool)
    change[0] = True
    for k in keys:
        change[1:] |= q[k][1:] != q[k][:-1]
    return np.append(np.flatnonzero(change), n)


ALWAYS = ("n_tokens", "sum_d", "max_abs_d", "min_d", "max_d", "sum_rm1", "sum_rm1_sq")  # what this module reads


def sequence_arrays(store: Store, runs: Sequence[str], steps: tuple[int, int] | None, cap,
                    logprobs: bool, bands: bool | str = True, signs: bool = True,
                    only: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """One entry per sequence with trained tokens, as float64 arrays sorted by (run, step, sample): "_run" (the
    run's index in `runs`), "step", "sample" (int64), the merged TOKEN_SUMS of summary_seq (n_tokens as `n`),
    with bands=True the band columns of `band_sql` at `cap` and a_mid, b_mid (and with signs rm1_pos); with
    bands="group" the same columns summed over each step, on the step's first sequence (0 on the others: for
    views that only add them up over a group's sequences; `_group_bands`), the
    EXTREME_COLUMNS (0 where no token passes |Δ| > 20) and, with logprobs=True, the LOGPROB_COLUMNS (from the
    summaries where they cover the sequence, else from its token rows). `only`: of the TOKEN_SUMS, read these
    (and ALWAYS) only.

    In numpy after one plain scan of summary_seq: sorting, merging the few sequences with rows from several
    files and joining the other queries' per-sequence rows in polars or in a GROUP BY cost several times the
    scan on 80k sequences (benchmarks/RESULTS-frameworks.md)."""
    where, params = run_filter(runs, steps)
    have = store.has_seq_sums
    lp = list(SEQ_SUM_NAMES) if logprobs and have else []
    cols = [c for c in columns("summary_seq") if merge_kind(c) != "key"
            and c not in ("max_pos", "n_flip_tokens") and c not in TOPK_SUM_NAMES and (c in lp if c in SEQ_SUM_NAMES else
                                                           only is None or c in only or c in ALWAYS)]
    raw = store.sql(f"SELECT run, step, sample, {', '.join(cols)} FROM summary_seq WHERE {where}", params)
    run, step, sample = _keys(raw, runs)
    order = np.lexsort((sample, step, run))
    if (order[1:] > order[:-1]).all():   # stored in order already: no gather
        order = slice(None)
    q = {"_run": run[order], "step": step[order], "sample": sample[order]}
    for c in cols:  # SEQ_SUMS are null in rows written before them (nan here)
        q[c] = raw[c].cast(pl.Float64).to_numpy()[order]
    starts = group_starts(q, ("_run", "step", "sample"))
    if starts.size - 1 < q["_run"].size:   # a sequence's tokens came in several files: merge its rows
        first = starts[:-1]
        extra = np.ones(q["_run"].size, bool)
        extra[first] = False                                   # the rows after a sequence's first one
        into = (np.cumsum(~extra) - 1)[extra]                  # ... and the merged row each goes into
        for c in ("_run", "step", "sample"):
            q[c] = q[c][first]
        for c in cols:
            kind, x = merge_kind(c), q[c]
            merged = x[first]
            if kind == "sum":  # nulls (a routing file's row, SEQ_SUMS before them) add as 0: for SEQ_SUMS,
                # n_lp_tokens then falls short of n and the sequence's sums come from its token rows
                merged = np.nan_to_num(merged, nan=0.0)
                np.add.at(merged, into, np.nan_to_num(x[extra], nan=0.0))
            else:  # a routing file's row has no tokens and null minima and maxima: fmin and fmax skip them
                (np.fmin if kind == "min" else np.fmax).at(merged, into, x[extra])
            q[c] = merged
    keep = q["n_tokens"] > 0
    if not keep.all():
        q = {c: x[keep] for c, x in q.items()}
    q["n"] = q.pop("n_tokens")
    if bands == "group":
        _group_bands(store, runs, steps, q, cap, signs)
    elif bands:
        bp = band_params(cap)
        zero = {"zero_bin": F.edge_bin(0.0, BAND_EDGES)} if signs else {}
        b = store.sql(band_sql(where, signs), params | bp | zero)
        _put(q, b, runs, b.columns[3:])
        # within [1/C, C] by subtraction: exact to a few ε of Σ |r − 1|, which for r ≤ 100 (max Δ ≤ LN_SAFE) is
        # at most 100 n; above, the mid bands are summed directly (steps with such a sequence only)
        q["a_mid"] = q["sum_rm1"] - q["a_hi"] - q["a_lo"]
        q["b_mid"] = q["sum_rm1_sq"] - q["b_hi"] - q["b_lo"]
        if signs:
            q["rm1_pos"] = q["sum_rm1"] - q["rm1_neg"]
        wide = q["max_d"] > LN_SAFE
        if wide.any():
            mwhere, mparams = run_filter(runs, steps, only_steps=np.unique(q["step"][wide]).tolist())
            mid = store.sql(mid_sql(mwhere), mparams | bp).rename({"a_mid_x": "a_mid", "b_mid_x": "b_mid"})
            _put(q, mid, runs, ("a_mid", "b_mid"), where=wide)
    for c in EXTREME_COLUMNS:
        q[c] = np.zeros(q["n"].size)
    far = q["max_abs_d"] > CLAMP
    if far.any():
        twhere, tparams = token_filter(store, runs, steps, only_steps=np.unique(q["step"][far]).tolist())
        _put(q, store.sql(extremes_sql(twhere), tparams), runs, EXTREME_COLUMNS)
    if logprobs:
        if not lp:
            for c in SEQ_SUM_NAMES:
                q[c] = np.full(q["n"].size, np.nan)
        short = ~(q.pop("n_lp_tokens") == q["n"])
        if short.any():  # rows written before SEQ_SUMS: those sequences' sums from the token rows
            twhere, tparams = token_filter(store, runs, steps, only_steps=np.unique(q["step"][short]).tolist())
            _put(q, store.sql(logprob_sql(twhere), tparams), runs, LOGPROB_COLUMNS, where=short)
    return q


def _group_bands(store: Store, runs: Sequence[str], steps, q: dict, cap, signs: bool) -> None:
    """The band columns of a step, from `hist_band_sql`, on its first sequence in `q`, 0 on the others."""
    where, params = run_filter(runs, steps)
    zero = {"zero_bin": F.edge_bin(0.0, D_EDGES)} if signs else {}
    h = store.sql(hist_band_sql(where, signs), params | band_params(cap, D_EDGES) | zero)
    first = group_starts(q, ("_run", "step"))[:-1]
    at = {(r, st): i for r, st, i in zip(q["_run"][first].tolist(), q["step"][first].tolist(), first.tolist())}
    code = {r: i for i, r in enumerate(runs)}
    rows = [at.get((code[r], st), -1) for r, st in zip(h["run"].to_list(), h["step"].to_list())]
    idx = np.array(rows, dtype=np.int64)
    ok = idx >= 0
    for c in h.columns[2:]:
        x = np.zeros(q["n"].size)
        x[idx[ok]] = h[c].to_numpy()[ok]
        q[c] = x
    if signs:  # its group sums are Σ sum_rm1 − Σ rm1_neg
        q["rm1_pos"] = q["sum_rm1"] - q["rm1_neg"]


def below_sql(where: str) -> str:
    """Per sequence, the tokens with unclamped Δ < $ln_tau (n_below): the token veto's catastrophic tokens."""
    return f"""SELECT run, step, sample, count(*)::DOUBLE AS n_below FROM tokens
        WHERE {where} AND trainer_logprob - sampler_logprob < $ln_tau GROUP BY run, step, sample"""


def token_columns(store: Store, runs: Sequence[str], steps: tuple[int, int] | None, q: dict,
                  token_sql: Callable[[str], tuple[str, dict] | None], ln_tau: float | None,
                  rewards: bool) -> None:
    """Into `q`, what a view reads beyond the summaries, each from one query, 0 where a sequence has none:
    the per-sequence columns of `token_sql(WHERE over tokens)` (every token row of the selection); with ln_tau,
    n_below = tokens with Δ < ln τ, scanning only the steps whose summaries hold such a token (min_d < ln τ);
    with rewards, `reward` of table sequences (nan where none is stored)."""
    if not q["n"].size:
        return
    where, params = token_filter(store, runs, steps)
    query = token_sql(where)
    if query is not None:
        sql, extra = query
        t = store.sql(sql, params | extra)
        _put(q, t, runs, t.columns[3:])
    if ln_tau is not None:
        q["n_below"] = np.zeros(q["n"].size)
        hit = q["min_d"] < ln_tau
        if hit.any():
            where, params = token_filter(store, runs, steps, only_steps=np.unique(q["step"][hit]).tolist())
            _put(q, store.sql(below_sql(where), params | {"ln_tau": ln_tau}), runs, ("n_below",))
    if rewards:
        where, params = run_filter(runs, steps)
        rw = store.sql(f"SELECT run, step, sample, any_value(reward) AS reward FROM sequences WHERE {where} "
                       "GROUP BY ALL", params)
        _put(q, rw, runs, ("reward",), fill=np.nan)


class Groups:
    """Reducers over the groups (steps or runs) of sorted sequence rows, one value per group: the groups are
    the rows from each of `starts[:-1]` to the next (`group_starts`)."""

    def __init__(self, starts: np.ndarray):
        self.first = starts[:-1]
        self.count = np.diff(starts).astype(np.float64)   # sequences per group

    def add(self, x) -> np.ndarray:
        return np.add.reduceat(np.asarray(x, dtype=np.float64), self.first)

    def max(self, x) -> np.ndarray:
        return np.maximum.reduceat(np.asarray(x, dtype=np.float64), self.first)

    def min(self, x) -> np.ndarray:
        return np.minimum.reduceat(np.asarray(x, dtype=np.float64), self.first)

    def mean(self, x) -> np.ndarray:
        """Plain mean over a group's sequences."""
        return self.add(x) / self.count

    def expand(self, per_group: np.ndarray) -> np.ndarray:
        """A per-group value on each of its rows."""
        return np.repeat(per_group, self.count.astype(np.int64))

    def std(self, x) -> np.ndarray:
        """Sample std (n − 1, as torch.std) over a group's sequences, two-pass; 0 for a single sequence."""
        x = np.asarray(x, dtype=np.float64)
        dev = x - self.expand(self.mean(x))
        var = self.add(dev * dev) / np.maximum(self.count - 1.0, 1.0)
        return np.where(self.count > 1, np.sqrt(var), 0.0)


def k3_of(x: np.ndarray) -> np.ndarray:
    """e^x − 1 − x without cancellation (expm1; its series below 0.01, as the summaries compute k3)."""
    x = np.asarray(x, dtype=np.float64)
    small = np.abs(x) < 0.01
    out = np.expm1(x) - x
    xs = x[small]
    out[small] = xs * xs * (1 / 2 + xs * (1 / 6 + xs * (1 / 24 + xs * (1 / 120 + xs * (1 / 720 + xs / 5040)))))
    return out



# -- per-sequence sums the frameworks read, from the columns above (q: the `arrays` of some sequences) ------

def sum_r(q) -> np.ndarray:
    """Σ e^Δ, Δ unclamped."""
    return q["n"] + q["sum_rm1"] + q["ext_r_hi"] + q["ext_r_lo"]


def sum_r_inv(q) -> np.ndarray:
    """Σ e^−Δ, Δ unclamped (summaries: k3r = expm1(−clamp Δ) + Δ)."""
    return q["n"] + q["sum_k3r"] - q["sum_d"] + q["ext_ri_hi"] + q["ext_ri_lo"]


def sum_k3_unclamped(q) -> np.ndarray:
    """Σ (e^Δ − 1 − Δ)."""
    return q["sum_k3"] + q["ext_r_hi"] + q["ext_r_lo"]


def sum_k3r_unclamped(q) -> np.ndarray:
    """Σ (e^−Δ − 1 + Δ)."""
    return q["sum_k3r"] + q["ext_ri_hi"] + q["ext_ri_lo"]


def sum_exp_abs(q) -> np.ndarray:
    """Σ e^|Δ|, Δ unclamped."""
    return q["n"] + q["sum_mpe"] + q["ext_r_hi"] + q["ext_ri_lo"]


def sum_abs_rm1(q) -> np.ndarray:
    """Σ |e^Δ − 1|, Δ unclamped."""
    return q["rm1_pos"] - q["rm1_neg"] + q["ext_r_hi"] - q["ext_r_lo"]


def sum_clamped_d(q) -> np.ndarray:
    """Σ clamp(Δ, −20, 20)."""
    return q["sum_d"] - q["ext_d"]


def sum_clamped_d2(q) -> np.ndarray:
    """Σ clamp(Δ, −20, 20)²."""
    return q["sum_d2"] - q["ext_d2"]


def sum_clamped_k3(q) -> np.ndarray:
    """Σ (e^c − 1 − c), c = clamp(Δ, −20, 20) (the summaries' k3 is e^c − 1 − Δ)."""
    return q["sum_k3"] + q["ext_d"]


def sum_ratio_sq(q) -> np.ndarray:
    """Σ r², r = e^clamp(Δ)."""
    return q["n"] + 2.0 * q["sum_rm1"] + q["sum_rm1_sq"]


def clamped_weight_sums(q, cap: float) -> tuple[np.ndarray, np.ndarray]:
    """(Σ w, Σ w²) per sequence for w = clamp(r, 1/C, C), r = e^clamp(Δ), from the ratio bands at C."""
    lo, hi = 1.0 / cap - 1.0, cap - 1.0
    a = q["a_mid"] + q["n_lo"] * lo + q["n_hi"] * hi          # Σ (w − 1)
    b = q["b_mid"] + q["n_lo"] * lo * lo + q["n_hi"] * hi * hi  # Σ (w − 1)²
    return q["n"] + a, q["n"] + 2.0 * a + b
