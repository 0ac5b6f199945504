"""Summary tables: exact, mergeable aggregates that every run-, step-, layer- and bucket-level view reads.

Every row carries (run, step, file_id) and the key columns of its table. Several rows with the same key (from
several files, several machines, several trainer ranks) MERGE by a GROUP BY over the key: the columns whose
name starts with `n_` or `sum_` add up (SUM), `min_*` take MIN, `max_*` take MAX. Nothing else is ever needed to
merge, so any writer (ingest SQL, DriftLogger's torch code, a lake job) writes partial rows and never reads
what is already stored. `finalise.py` is the only place METRICS.md formulas are applied to these sums.

Per token, with s = sampler log-prob, t = trainer log-prob (natural log, ≤ 0):
  d   = t − s (Δ), unclamped
  cd  = clamp(d, −20, 20)                       (CLAMP, as in METRICS.md: r = exp(cd))
  rm1 = expm1(cd) = r − 1, computed without cancellation (sums of r − 1 keep all digits when r ≈ 1)
  k3  = r − 1 − d       = expm1(cd) − d  (≥ 0; for |d| < SERIES_BELOW by its Taylor series, see compute.py)
  k3r = 1/r − 1 + d     = expm1(−cd) + d (≥ 0; same series with −d)
  mpe = exp(|cd|) − 1   = expm1(|cd|)    (mult_prob_error − 1 per token)
  ps  = exp(s), pt = exp(t)
  qs  = 1 − exp(s) = −expm1(s),  qt = 1 − exp(t) = −expm1(t)   (1 − probability: Pearson moments are kept both
        around probability 0 (ps, pt) and around 1 (qs, qt); corr(qs, qt) = corr(ps, pt), and finalise takes the
        pair whose mean is nearer 0, so the moments do not cancel whether most tokens sit near p = 0 or p = 1)
  adp = |exp(t) − exp(s)| = |qs − qt|
Thresholds are applied to d in log space: r > C ⟺ d > ln C, r < 1/C ⟺ d < −ln C, |r − 1| > ε ⟺ d > ln(1+ε)
or d < ln(1−ε); F(τ) counts |cd| > ln τ. The token-level SQL (analysis/metrics/token.py) uses the same comparisons,
so counts from summaries and from token rows agree exactly.

Bin conventions (fixed, global, the same for every run and every writer):
  * "Δ bins" (`summary_hist.bin`, and `band` in summary_bucket_band / summary_seq_band) index a sorted edge list E
    (`D_EDGES` resp. `BAND_EDGES`) as  bin = 2·#{i: E[i] < d} + (1 if d == E[#{i: E[i] < d}] else 0):
    even bins are open intervals (E[k−1], E[k]) (bin 0 = (−∞, E[0]), bin 2·len(E) = (E[-1], ∞)), odd bins hold
    a value exactly on an edge. Strict and non-strict thresholds at any edge are then both exact.
  * Bucket dimensions (`summary_bucket.dim`) and their `bucket` index: see BUCKET_DIMENSIONS.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CLAMP = 20.0
SERIES_BELOW = 0.01  # |d| below which k3 / k3r use their Taylor series (compute.py)

# The cap C and clip ε values a summary answers exactly (the sidebar offers these; other values read tokens).
CAPS = (1.2, 1.5, 2.0, 3.0, 5.0, 10.0)
CLIPS = (0.1, 0.2, 0.28, 0.3, 0.5)
# thresholds of the extreme-token curve F(τ) (metrics.default_taus: 49 log-spaced τ from 1.01 to 1000)
TAUS = tuple(float(x) for x in np.geomspace(1.01, 1000.0, 49))


def _threshold_edges() -> list[float]:
    """ln C, ln(1 ± ε) and ln τ of the allowed parameters, and the clamp, mirrored around 0, with 0."""
    pos = {CLAMP}
    pos |= {math.log(c) for c in CAPS}
    pos |= {math.log1p(e) for e in CLIPS} | {-math.log1p(-e) for e in CLIPS}
    return sorted({0.0} | pos | {-x for x in pos})


def _display_edges() -> list[float]:
    """±10^(j/10) for j = −80..30 (|Δ| from 1e-8 to 1000 at 10 bins per decade), for histograms and heat maps."""
    mags = [10.0 ** (j / 10) for j in range(-80, 31)]
    return sorted(set(mags) | {-m for m in mags})


# Edges of the fine Δ bins (summary_hist.bin): the display grid, every threshold above, and ±ln τ.
BAND_EDGES: tuple[float, ...] = tuple(_threshold_edges())
D_EDGES: tuple[float, ...] = tuple(sorted(set(_display_edges()) | set(BAND_EDGES)
                                          | {math.log(t) for t in TAUS} | {-math.log(t) for t in TAUS}))
N_BINS = 2 * len(D_EDGES) + 1  # bin ids 0 .. 2·len(D_EDGES)
# The display grid of histograms and heat maps (0 and ±10^(j/10)): a subset of D_EDGES, so fine bins nest in it.
DISPLAY_EDGES: tuple[float, ...] = tuple(sorted({0.0} | set(_display_edges())))
N_BANDS = 2 * len(BAND_EDGES) + 1

# -- bucket dimensions -------------------------------------------------------------------------------
# prob: x = log10 exp(s) = s / ln 10, bucket = clamp(floor((x − PROB_LO) / PROB_WIDTH), 0, PROB_BINS − 1)
#       (probabilities below 10^PROB_LO share bucket 0; p = 1 is in the last bucket)
PROB_LO, PROB_WIDTH, PROB_BINS = -12.0, 0.5, 24
# position / length: bucket 0 = [0, 1), bucket k ≥ 1 = [2^(k−1), 2^k): 0, 1, 2–3, 4–7, ... (length ≥ 1, so its
#       bucket 0 is empty). Length is the response length max(pos) + 1 of the token's sequence.
# entropy: sampler_entropy in nats, bucket k = [ENTROPY_EDGES[k], ENTROPY_EDGES[k+1]) (the last open above);
#       values below the first edge go to bucket 0. Tokens without sampler_entropy are not counted.
ENTROPY_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 8.0)
# lag: trainer_version − sampler_version, bucket = the lag itself. Tokens without both versions are not counted.
BUCKET_DIMENSIONS = ("prob", "position", "entropy", "lag")  # stored in summary_bucket; "length" comes from
# summary_seq (a token's length bucket is its sequence's length, so it is a GROUP BY over sequence rows)


@dataclass(frozen=True)
class Col:
    name: str
    sql_type: str
    doc: str


# Per-token sums shared by summary_step, summary_bucket and summary_seq (over the tokens of the row).
TOKEN_SUMS = (
    Col("n_tokens", "BIGINT", "number of tokens"),
    Col("sum_d", "DOUBLE", "Σ d"),
    Col("sum_d2", "DOUBLE", "Σ d²"),
    Col("sum_abs_d", "DOUBLE", "Σ |d|"),
    Col("max_abs_d", "DOUBLE", "max |d|"),
    Col("min_d", "DOUBLE", "min d (ratio_min = exp(clamp(min_d)))"),
    Col("max_d", "DOUBLE", "max d (ratio_max = exp(clamp(max_d)))"),
    Col("sum_k3", "DOUBLE", "Σ k3, k3 = r − 1 − d"),
    Col("sum_k3r", "DOUBLE", "Σ k3r, k3r = 1/r − 1 + d"),
    Col("sum_rm1", "DOUBLE", "Σ (r − 1), r − 1 = expm1(cd)"),
    Col("sum_rm1_sq", "DOUBLE", "Σ (r − 1)²"),
    Col("sum_mpe", "DOUBLE", "Σ expm1(|cd|) (mult_prob_error = 1 + mean)"),
    Col("sum_adp", "DOUBLE", "Σ |exp t − exp s|"),
    Col("max_adp", "DOUBLE", "max |exp t − exp s|"),
    Col("sum_qs", "DOUBLE", "Σ qs, qs = 1 − exp s"),
    Col("sum_qt", "DOUBLE", "Σ qt, qt = 1 − exp t"),
    Col("sum_qs2", "DOUBLE", "Σ qs²"),
    Col("sum_qt2", "DOUBLE", "Σ qt²"),
    Col("sum_qsqt", "DOUBLE", "Σ qs·qt"),
    Col("sum_ps", "DOUBLE", "Σ ps, ps = exp s (Pearson moments around probability 0: finalise uses these or the"
                            " q moments, whichever mean is nearer 0, so neither cancels)"),
    Col("sum_pt", "DOUBLE", "Σ pt, pt = exp t"),
    Col("sum_ps2", "DOUBLE", "Σ ps²"),
    Col("sum_pt2", "DOUBLE", "Σ pt²"),
    Col("sum_pspt", "DOUBLE", "Σ ps·pt"),
    Col("min_s", "DOUBLE", "min s (Pearson is null when exp s is constant: min_s = max_s)"),
    Col("max_s", "DOUBLE", "max s"),
    Col("min_t", "DOUBLE", "min t"),
    Col("max_t", "DOUBLE", "max t"),
)

# Per-token routing aggregates (tokens with trainer routing; a token's layers all come from one file).
TOKEN_FLIP_SUMS = (
    Col("n_routed", "BIGINT", "tokens with routing of both sides at some layer"),
    Col("n_any_flip", "BIGINT", "of those, tokens with a flip at some layer (𝟙[∃ layer: E_s ≠ E_t])"),
    Col("sum_flipped_layers", "BIGINT", "Σ over routed tokens of the number of flipped layers"),
    Col("sum_abs_d_flip", "DOUBLE", "Σ |d| over routed tokens with a flip"),
    Col("sum_k3_flip", "DOUBLE", "Σ k3 over routed tokens with a flip"),
    Col("sum_abs_d_noflip", "DOUBLE", "Σ |d| over routed tokens without a flip"),
    Col("sum_k3_noflip", "DOUBLE", "Σ k3 over routed tokens without a flip"),
)

# The sums of the logging checks (METRICS.md "Logging checks"), summary_step only: the least-squares slope of t on
# s, and |Δ| between neighbouring tokens of a sequence at lag ±1 (a pair: positions p and p + 1 of one sequence,
# both in the row's tokens; a sequence whose tokens span two loaded files loses the pair at the seam). Rows written
# before these columns existed hold nulls, and so does a routing row (n_tokens 0): the checks of a group are null
# unless n_check_tokens covers every token of it. ratio_mean_se and missing_mass need only sum_rm1, sum_rm1_sq.
CHECK_SUMS = (
    Col("n_check_tokens", "BIGINT", "tokens the sums below cover (the row's n_tokens where they were written)"),
    Col("sum_s", "DOUBLE", "Σ s"),
    Col("sum_s2", "DOUBLE", "Σ s²"),
    Col("sum_sd", "DOUBLE", "Σ s·d (Σ s·t = Σ s² + Σ s·d, kept in this form so that cov(s, d) does not cancel when "
                            "t ≈ s; Σ t = Σ s + Σ d)"),
    Col("n_adj", "BIGINT", "adjacent pairs (p, p + 1) of a sequence"),
    Col("sum_abs_lag_prev", "DOUBLE", "Σ over the pairs of |t_{p+1} − s_p| (lag −1: a token's t against the "
                                      "sampler's log-prob one position earlier)"),
    Col("sum_abs_lag_next", "DOUBLE", "Σ over the pairs of |t_p − s_{p+1}| (lag +1)"),
)
CHECK_SUM_NAMES = tuple(c.name for c in CHECK_SUMS)

# The counts of the residual signatures (METRICS.md v3 "Residual signatures"), summary_step only: the share of
# Δ on a lattice of quantum LATTICE_Q, and of very negative Δ (< BOUNDARY_LOW) at a segment's first token against
# the other tokens of segmented sequences. A segment's first token is the one of least pos among the sequence's
# tokens with that segment id (its trained tokens: a token row is a trained token). first_token_kl_share needs no
# column here: Σ k3 at position 0 is the position bucket 0 of summary_bucket. Rows written before these columns
# hold nulls; the shares of a group are null unless n_res_tokens covers every token of it (as CHECK_SUMS).
LATTICE_Q = 0.125  # the default quantum of lattice_share_q, the one the summaries answer (others read token rows)
LATTICE_TOL = 1e-6  # |Δ/q − round(Δ/q)| below this: on the lattice
BOUNDARY_LOW = -10.0  # Δ below this: a "low" token of boundary_low_share
RESIDUAL_SUMS = (
    Col("n_res_tokens", "BIGINT", "tokens the counts below cover (the row's n_tokens where they were written)"),
    Col("n_d_nonzero", "BIGINT", "tokens with Δ ≠ 0"),
    Col("n_lattice", "BIGINT", "of those, tokens with |Δ/q − round(Δ/q)| < 1e-6 for q = LATTICE_Q"),
    Col("n_seg_tokens", "BIGINT", "tokens with a segment id"),
    Col("n_seg_first", "BIGINT", "of those, tokens at their segment's first position"),
    Col("n_seg_first_low", "BIGINT", "of those, tokens with Δ < BOUNDARY_LOW"),
    Col("n_seg_rest_low", "BIGINT", "segmented tokens not at a segment's first position with Δ < BOUNDARY_LOW"),
)
RESIDUAL_SUM_NAMES = tuple(c.name for c in RESIDUAL_SUMS)

# Per-sequence log-prob sums, summary_seq only: what the framework views read per sequence beyond TOKEN_SUMS (verl's
# perplexities, NeMo's Jensen-Shannon term and approx_entropy). Rows written before them hold nulls: a sequence's
# sums are used only where n_lp_tokens covers its n_tokens, else they are summed from its token rows.
SEQ_SUMS = (
    Col("n_lp_tokens", "BIGINT", "tokens the sums below cover (the row's n_tokens where they were written)"),
    Col("sum_s", "DOUBLE", "Σ s"),
    Col("sum_t", "DOUBLE", "Σ t"),
    Col("sum_js", "DOUBLE", "Σ log cosh(d/2) (Δ unclamped)"),
    Col("sum_rt", "DOUBLE", "Σ r·t, r = exp(cd)"),
)
SEQ_SUM_NAMES = tuple(c.name for c in SEQ_SUMS)

# The full-distribution sums (METRICS.md v3 "Full distribution"), summary_step and summary_seq (the latter for the
# columns per tag and per length bucket, grouped from the sequences as TOKEN_SUMS are): per trained position with the
# top-J token ids and log-probs of both sides, S_s and S_t those ids, I = S_s ∩ S_t, m_s = Σ_{i∈I} exp(ls_i) and m_t
# likewise, p̂ the probabilities renormalised over I. Rows without top-k (and rows written before these columns)
# hold nulls or n_topk = 0; the topk_* columns are means over the n_topk positions, null where there are none.
TOPK_SUMS = (
    Col("n_topk", "BIGINT", "trained positions with the top-J lists of both sides"),
    Col("sum_topk_overlap", "DOUBLE", "Σ |I| / J"),
    Col("n_top1_agree", "BIGINT", "positions whose two argmax ids (each side's largest log-prob) are the same id"),
    Col("sum_topk_mass_sampler", "DOUBLE", "Σ Σ_{i∈S_s} exp(ls_i)"),
    Col("sum_topk_mass_trainer", "DOUBLE", "Σ Σ_{i∈S_t} exp(lt_i)"),
    Col("sum_topk_kl_shared", "DOUBLE", "Σ KL(p̂_s ‖ p̂_t) over I (0 where |I| <= 1)"),
    Col("sum_topk_tv_lower", "DOUBLE", "Σ ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ |m_s − m_t|"),
    Col("sum_topk_tv_upper", "DOUBLE", "Σ ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ (1 − m_s) + ½ (1 − m_t)"),
)
TOPK_SUM_NAMES = tuple(c.name for c in TOPK_SUMS)

# The routing-weight sums (METRICS.md v3 "Routing margins and weights"), summary_layer only: over the (token, layer)
# rows with both sides' expert ids and combine weights and E_s = E_t as sets, d = Σ_k |w_s(e_k) − w_t(e_k)| with the
# weights matched by expert id (the two lists may rank the experts differently).
WEIGHT_SUMS = (
    Col("n_weight_rows", "BIGINT", "rows with both sides' weights and the same expert set"),
    Col("sum_weight_abs_diff", "DOUBLE", "Σ d"),
    Col("max_weight_abs_diff", "DOUBLE", "max d"),
)
WEIGHT_SUM_NAMES = tuple(c.name for c in WEIGHT_SUMS)

# The router-margin sums (METRICS.md v3 "Routing margins and weights"), summary_layer only: a margin is the k-th
# minus the (k+1)-th router probability of a (token, layer) row, stored as fp32 (sums and bins read the fp32 value,
# widened). Rows written before these columns hold nulls; margin_mean_* are null where a layer has no margins.
MARGIN_SUMS = (
    Col("n_margin_sampler", "BIGINT", "rows with the sampler's margin"),
    Col("sum_margin_sampler", "DOUBLE", "Σ of those margins"),
    Col("n_margin_trainer", "BIGINT", "rows with the trainer's margin"),
    Col("sum_margin_trainer", "DOUBLE", "Σ of those margins"),
)
MARGIN_SUM_NAMES = tuple(c.name for c in MARGIN_SUMS)
# Fixed margin bin edges: bin b = [E[b], E[b+1]) for b < 4, the last bin [0.1, 1] closed (summaries/margins.py)
MARGIN_EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
MARGIN_SIDES = ("sampler", "trainer")

KEY = (Col("run", "VARCHAR", "run name"), Col("step", "BIGINT", "trainer step"))
FILE = Col("file_id", "INTEGER", "the file (or summary file) that brought the row; delete_run and provenance")

BUCKET_KEY = (
    Col("dim", "VARCHAR", "bucket dimension: prob | position | entropy | lag (see BUCKET_DIMENSIONS)"),
    Col("bucket", "BIGINT", "bucket index in that dimension"),
)
# The ratio-band split of a sequence's or a bucket's tokens: all that the cap/clip columns
# (finalise.threshold_sql) read. Kept apart from the wide rows so those carry no band key (layout 2).
BAND_SUMS = (
    Col("band", "SMALLINT", "ratio band on BAND_EDGES (bin convention above)"),
    Col("n_tokens", "BIGINT", "tokens in the band"),
    Col("sum_rm1", "DOUBLE", "Σ (r − 1) of those tokens"),
    Col("sum_rm1_sq", "DOUBLE", "Σ (r − 1)²"),
)
BAND_SUM_NAMES = tuple(c.name for c in BAND_SUMS[1:])  # the sums of a band row: n_tokens, sum_rm1, sum_rm1_sq

TABLES: dict[str, tuple[Col, ...]] = {
    # one row per (run, step, file): every by=step token column, and the per-step routing columns
    "summary_step": KEY + TOKEN_SUMS + TOKEN_FLIP_SUMS + CHECK_SUMS + RESIDUAL_SUMS + TOPK_SUMS + (FILE,),
    # one row per (run, step, layer, file): routing counts (load_max_vio comes from expert_load)
    "summary_layer": KEY + (
        Col("layer", "INTEGER", "0-based MoE layer"),
        Col("k", "SMALLINT", "top-k size (one k per (run, step, layer), enforced at ingest)"),
        Col("n_rows", "BIGINT", "routing rows (tokens) at this layer, sampler-only rows included"),
        Col("n_both", "BIGINT", "rows with both sides recorded (flip columns count only these)"),
        Col("n_flip", "BIGINT", "rows with E_s ≠ E_t as sets"),
        Col("n_top1", "BIGINT", "rows whose first-ranked experts differ"),
        Col("sum_common", "BIGINT", "Σ |E_s ∩ E_t| over rows with both sides (overlap = sum_common / (k·n_both))"),
        Col("n_first_flip", "BIGINT", "tokens whose lowest flipped layer is this one"),
    ) + WEIGHT_SUMS + MARGIN_SUMS + (FILE,),
    # one row per (run, step, layer, side, margin_bin, file): flips and |Δ| of the (token, layer) rows with both
    # sides' experts by the margin bin of one side's router margin (flip_rate_by_margin)
    "summary_margin": KEY + (
        Col("layer", "INTEGER", "0-based MoE layer"),
        Col("side", "VARCHAR", "whose margin bins the row: sampler | trainer"),
        Col("margin_bin", "SMALLINT", "bin of that margin on MARGIN_EDGES"),
        Col("n_rows", "BIGINT", "(token, layer) rows with both sides' experts and that side's margin"),
        Col("n_flip", "BIGINT", "of those, rows with E_s ≠ E_t as sets"),
        Col("sum_abs_d", "DOUBLE", "Σ |Δ| of the rows' tokens (a token counts once per layer)"),
        FILE),
    # one row per (run, step, sample, file): a sequence's tokens in one file; a sequence's rows merge by
    # GROUP BY (run, step, sample) for the sequence metrics and the length buckets
    "summary_seq": KEY + (
        Col("sample", "BIGINT", "sequence id within (run, step)"),
        Col("max_pos", "INTEGER", "max pos of these tokens (length = 1 + max over the sequence's rows)"),
    ) + TOKEN_SUMS + (
        Col("n_flip_tokens", "BIGINT", "tokens of this sequence with a flip at some layer (routing files)"),
    ) + SEQ_SUMS + TOPK_SUMS + (FILE,),
    # one row per (run, step, sample, band, file) with n_tokens > 0: the cap/clip counts of the length buckets
    "summary_seq_band": KEY + (Col("sample", "BIGINT", "sequence id within (run, step)"),) + BAND_SUMS + (FILE,),
    # one row per (run, step, bin, file): Δ histogram on D_EDGES; also every cap/clip/τ threshold count
    "summary_hist": KEY + (
        Col("bin", "SMALLINT", "fine Δ bin on D_EDGES (bin convention above)"),
        Col("n_tokens", "BIGINT", "tokens in the bin"),
        Col("sum_rm1", "DOUBLE", "Σ (r − 1) of those tokens (ess for any allowed C)"),
        Col("sum_rm1_sq", "DOUBLE", "Σ (r − 1)²"),
        FILE),
    # one row per (run, step, dim, bucket, file): where the mismatch lives, on fixed bucket edges
    "summary_bucket": KEY + BUCKET_KEY + TOKEN_SUMS + (FILE,),
    # one row per (run, step, dim, bucket, band, file) with n_tokens > 0: the cap/clip counts per bucket
    "summary_bucket_band": KEY + BUCKET_KEY + BAND_SUMS + (FILE,),
    # files whose token rows are not summarised here (their summaries came in a summary file)
    "summary_skip": (FILE,),
    # one row per (run, step, file) of a DriftLogger summary file: what the step's token rows are a sample of.
    # The step's summaries cover n_tokens; its token rows hold n_kept of them: n_uniform drawn at rate
    # token_sample, plus every token of the worst_sequences sequences by |Σ d| (n_worst_seq_tokens) and the
    # top_tokens tokens by |d| (n_top_tokens); the parts overlap
    "summary_sample": KEY + (
        Col("token_sample", "DOUBLE", "share of tokens drawn uniformly (1: every token; 0: none)"),
        Col("worst_sequences", "INTEGER", "sequences kept whole, by |Σ d|"),
        Col("top_tokens", "INTEGER", "tokens kept by |d|"),
        Col("n_tokens", "BIGINT", "tokens the step's summaries cover"),
        Col("n_kept", "BIGINT", "of those, tokens written as token rows"),
        Col("n_uniform", "BIGINT", "kept by the uniform draw"),
        Col("n_worst_seq_tokens", "BIGINT", "kept as tokens of the worst sequences"),
        Col("n_top_tokens", "BIGINT", "kept among the top |d|"),
        FILE),
}

# Parquet schema-metadata key and value marking token rows that are already summarised elsewhere
# (DriftLogger's sampled token rows): ingest stores the rows but does not summarise them again.
SUMMARISED_KEY = b"driftscope.summarised"
SUMMARISED_VALUE = b"1"


def merge_kind(col: str) -> str:
    """How a column merges across rows of the same key: 'sum', 'min', 'max' or 'key'."""
    if col.startswith(("n_", "sum_")):
        return "sum"
    if col.startswith("min_"):
        return "min"
    if col.startswith("max_"):
        return "max"
    return "key"


def merge_sql(table: str, col: str) -> str:
    """SQL merging the partial rows' values of a non-key column of `table` (GROUP BY the key): fsum of DOUBLE
    sums (compensated), sum of counts in the column's type, MIN of min_*, MAX of max_*."""
    kind = merge_kind(col)
    if kind == "key":
        raise ValueError(f"{table}.{col} is a key column")
    if kind == "sum":
        sql_type = next(c.sql_type for c in TABLES[table] if c.name == col)
        return f"fsum({col})" if sql_type == "DOUBLE" else f"sum({col})::{sql_type}"
    return f"{kind}({col})"


def merge_list(table: str, cols=None) -> str:
    """Select-list merging partial rows into `table`'s columns of the same names (default: every non-key column)."""
    cols = [c for c in columns(table) if merge_kind(c) != "key"] if cols is None else cols
    return ", ".join(f"{merge_sql(table, c)} AS {c}" for c in cols)


def columns(table: str) -> list[str]:
    return [c.name for c in TABLES[table]]


# Columns added to a table after databases with it were made: a database opened for writing gains them (null in
# its earlier rows); one opened read-only reads them as null (finalise.token_table_sql, checks=False;
# Store.has_seq_sums).
ADDED: dict[str, tuple[Col, ...]] = {"summary_step": CHECK_SUMS + RESIDUAL_SUMS + TOPK_SUMS,
                                    "summary_seq": SEQ_SUMS + TOPK_SUMS, "summary_layer": WEIGHT_SUMS + MARGIN_SUMS}


def ddl() -> list[str]:
    return [f"CREATE TABLE IF NOT EXISTS {t} ({', '.join(f'{c.name} {c.sql_type}' for c in cols)})"
            for t, cols in TABLES.items()] + [f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS {c.name} {c.sql_type}"
                                              for t, cols in ADDED.items() for c in cols]
