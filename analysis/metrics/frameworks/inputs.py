"""Per-sequence inputs of the framework views: one row per sequence with every sum a framework formula reads.

From the per-sequence summaries (`summary_seq`, its ratio bands `summary_seq_band`): the token sums of schema.py
(Σ Δ, Σ Δ², Σ k3, Σ (r − 1), ... with r = exp(clamp(Δ, −20, 20))) and, at a cap C of schema.CAPS, the counts and
sums of r − 1 above ln C, below −ln C, between, and either side of 0.

From the per-sequence log-prob sums of summary_seq (schema.SEQ_SUMS): Σ s, Σ t (verl's and our perplexities),
Σ log cosh(Δ/2) (NeMo's Jensen-Shannon term, a function of Δ alone) and Σ r·t (NeMo approx_entropy). A sequence
whose rows predate those sums (n_lp_tokens short of its n_tokens) has them summed from its token rows instead
(`logprob_sql`, only for the steps that need it).

From the token rows, only what the summaries do not hold:
  * `extremes`: the frameworks exponentiate Δ unclamped (verl k3_kl, NeMo, slime, prime-rl) or clamp Δ per token
    before a sum (verl rejection). Tokens with |Δ| > 20 are the only ones where that differs from the summaries;
    one filtered scan sums the differences per sequence (steps without such tokens are skipped by the summaries'
    max |Δ|).
Both are exact where the token rows are complete (`read.coverage`); on a DriftLogger sample they cover the
kept rows only.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import polars as pl

from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries.schema import BAND_EDGES, CAPS, CLAMP, SEQ_SUM_NAMES
from analysis.summaries.sql import clamp_log_ratio_sql, log_cosh_half_sql, run_filter, token_filter

SEQ_KEYS = ("run", "step", "sample")
EXTREME_COLUMNS = ("ext_d", "ext_d2", "ext_r_hi", "ext_r_lo", "ext_ri_hi", "ext_ri_lo", "ext_rt")
LOGPROB_COLUMNS = ("sum_s", "sum_t", "sum_js", "sum_rt")  # schema.SEQ_SUMS less n_lp_tokens


def band_sql(where: str) -> str:
    """Per sequence, from its ratio bands (parameters of `band_params`): n_hi (Δ > ln C), n_lo (Δ < −ln C),
    a_mid = Σ (r − 1) and b_mid = Σ (r − 1)² over −ln C ≤ Δ ≤ ln C, rm1_pos / rm1_neg = Σ (r − 1) over Δ > 0 / Δ < 0."""
    return f"""SELECT run, step, sample,
        coalesce(sum(n_tokens) FILTER (WHERE band > $hi_bin), 0)::DOUBLE AS n_hi,
        coalesce(sum(n_tokens) FILTER (WHERE band < $lo_bin), 0)::DOUBLE AS n_lo,
        coalesce(fsum(sum_rm1) FILTER (WHERE band BETWEEN $lo_bin AND $hi_bin), 0) AS a_mid,
        coalesce(fsum(sum_rm1_sq) FILTER (WHERE band BETWEEN $lo_bin AND $hi_bin), 0) AS b_mid,
        coalesce(fsum(sum_rm1) FILTER (WHERE band > $zero_bin), 0) AS rm1_pos,
        coalesce(fsum(sum_rm1) FILTER (WHERE band < $zero_bin), 0) AS rm1_neg
        FROM summary_seq_band WHERE {where} GROUP BY run, step, sample"""


def band_params(cap: float) -> dict:
    if float(cap) not in CAPS:
        raise ValueError(f"the cap must be one of {', '.join(f'{c:g}' for c in CAPS)} (the ratio bands the "
                         f"summaries keep), got {cap:g}")
    return {"hi_bin": F.edge_bin(math.log(cap), BAND_EDGES), "lo_bin": F.edge_bin(-math.log(cap), BAND_EDGES),
            "zero_bin": F.edge_bin(0.0, BAND_EDGES)}


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


def sequence_inputs(store: Store, runs: Sequence[str], steps: tuple[int, int] | None, cap: float,
                    logprobs: bool) -> pl.DataFrame:
    """One row per sequence with trained tokens, ordered by (run, step, sample): the merged TOKEN_SUMS of
    summary_seq (n_tokens as `n`), the band columns of `band_sql` at `cap`, the EXTREME_COLUMNS (0 where no
    token passes |Δ| > 20) and, with logprobs=True, the LOGPROB_COLUMNS (from the summaries where they cover the
    sequence, else from its token rows)."""
    where, params = run_filter(runs, steps)
    have = store.has_seq_sums
    lp = list(SEQ_SUM_NAMES) if logprobs and have else []
    skip = [c for c in SEQ_SUM_NAMES if c not in lp]
    seq = store.sql(f"""
        WITH m AS ({F.merged('summary_seq', list(SEQ_KEYS), where, without=skip)} HAVING sum(n_tokens) > 0),
             b AS ({band_sql(where)})
        SELECT m.*, b.* EXCLUDE (run, step, sample) FROM m LEFT JOIN b USING (run, step, sample)
        ORDER BY run, step, sample""", params | band_params(cap))
    seq = seq.drop([c for c in ("max_pos", "n_flip_tokens") if c in seq.columns]).rename({"n_tokens": "n"})
    seq = seq.with_columns(pl.col("n").cast(pl.Float64))
    if seq.height and float(seq["max_abs_d"].max()) > CLAMP:
        ext_steps = seq.filter(pl.col("max_abs_d") > CLAMP)["step"].unique().to_list()
        twhere, tparams = token_filter(store, runs, steps, only_steps=ext_steps)
        ext = store.sql(extremes_sql(twhere), tparams)
        seq = seq.join(ext, on=list(SEQ_KEYS), how="left")
    else:
        seq = seq.with_columns(pl.lit(None, pl.Float64).alias(c) for c in EXTREME_COLUMNS)
    seq = seq.with_columns(pl.col(c).fill_null(0.0) for c in EXTREME_COLUMNS)
    if logprobs:
        if not lp:
            seq = seq.with_columns(pl.lit(None, pl.Float64).alias(c) for c in SEQ_SUM_NAMES)
        covered = pl.col("n_lp_tokens").cast(pl.Float64).fill_null(0.0) == pl.col("n")
        short = seq.filter(~covered)["step"].unique().to_list()
        if short:  # rows written before SEQ_SUMS: those steps' sums from the token rows
            twhere, tparams = token_filter(store, runs, steps, only_steps=short)
            tok = store.sql(logprob_sql(twhere), tparams).rename({c: f"{c}_tok" for c in LOGPROB_COLUMNS})
            seq = seq.join(tok, on=list(SEQ_KEYS), how="left").with_columns(
                pl.when(covered).then(pl.col(c)).otherwise(pl.col(f"{c}_tok")).alias(c) for c in LOGPROB_COLUMNS
            ).drop([f"{c}_tok" for c in LOGPROB_COLUMNS])
        seq = seq.drop("n_lp_tokens")
    return seq.sort(list(SEQ_KEYS))


def arrays(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """The numeric columns of a frame of sequence rows as float64 arrays (keys dropped)."""
    return {c: frame[c].cast(pl.Float64).to_numpy() for c in frame.columns if c not in SEQ_KEYS}


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
