"""Shift-share decomposition of the change of kl_k3 between two step ranges of one run.

kl_k3 over a range is Σ_c w_c k_c over cells c of a token classification (response length, sampler probability,
routing flip, staleness), with w_c the cell's share of tokens and k_c its mean k3 term. Between ranges A and B
it changes because tokens move between cells (mix) and because cells themselves drift (within). The mix is
split into one term per factor by a chain: the token distribution is written as P(length) · P(prob | length)
· P(flip | length, prob) · P(stale | length, prob, flip), and the factors are switched from A's to B's one at a
time in that order; the within term then switches the cells' k from A's to B's. Each term is the change of
kl_k3 that one switch makes, so the terms add up to kl_k3(B) − kl_k3(A) exactly. Like every sequential
decomposition the split depends on the order (stated here and in the chart); the total does not.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import polars as pl

from analysis.store import Store
from analysis.summaries.finalise import sequences_sql
from analysis.summaries.sql import kl3_sql, ratio_sql, run_filter

FACTORS = ("length", "prob", "flip", "stale")
FACTOR_LABELS = {"length": "mix: response length", "prob": "mix: sampler probability",
                 "flip": "mix: routing flips", "stale": "mix: staleness", "within": "within-bucket drift"}
PROB_FLOOR_DECADE = -8  # sampler probabilities below 1e-8 share the lowest decade

# The tokens with a flip at some MoE layer (token-level, like the rest of the decomposition: its cells cross
# length, probability, flip and staleness, which no summary holds jointly). Tokens without the trainer's routing,
# or without a flip, are unflipped.
_FLIPPED_TOKENS = "SELECT DISTINCT step, sample, pos FROM routing WHERE {where} AND flip"


def kl_cells(store: Store, run: str, steps: tuple[int, int] | None = None,
             only_steps: Sequence[int] | None = None) -> pl.DataFrame:
    """Per (step, cell): n_tokens and kl_sum = Σ of the tokens' k3 terms r − 1 − Δ.

    Cells: length = ⌊log2(response length)⌋ (length = max pos + 1 of the sequence), prob = ⌊log10 exp(s)⌋
    (decade of the sampler probability, p = 1 counted in the top decade, floor 1e-8), flip = some MoE layer
    flipped (false without the trainer's routing), stale = trainer_version > sampler_version (false without
    versions). only_steps: read these steps only (sampled.thin_steps). Returns [step, length, prob, flip, stale,
    n_tokens, kl_sum].
    """
    where, params = run_filter([run], steps, only_steps=only_steps)
    rwhere, rparams = run_filter([run], steps, prefix="r_", only_steps=only_steps)
    params.update(rparams)
    # a sequence's length from its summary rows (every token counted, also where the token rows are a sample)
    return store.sql(f"""
        WITH sq AS (SELECT step, sample, length AS len FROM ({sequences_sql(where)})),
             tok AS (SELECT step, sample, pos, sampler_logprob AS s, trainer_logprob - sampler_logprob AS d,
                            trainer_version - sampler_version AS lag
                     FROM tokens WHERE {where}),
             fl AS ({_FLIPPED_TOKENS.format(where=rwhere)})
        SELECT tok.step, floor(log2(sq.len))::INTEGER AS length,
               greatest(least(floor(s / ln(10)), -1), {PROB_FLOOR_DECADE})::INTEGER AS prob,
               fl.pos IS NOT NULL AS flip, coalesce(lag > 0, false) AS stale,
               count(*)::BIGINT AS n_tokens, sum({kl3_sql(ratio_sql('d'))}) AS kl_sum
        FROM tok JOIN sq USING (step, sample)
             LEFT JOIN fl ON fl.step = tok.step AND fl.sample = tok.sample AND fl.pos = tok.pos
        GROUP BY ALL ORDER BY ALL""", params)


def _side(cells: pl.DataFrame, lo: int, hi: int) -> dict[tuple, tuple[int, float]]:
    part = cells.filter(pl.col("step").is_between(lo, hi)).group_by(list(FACTORS)).agg(
        pl.col("n_tokens").sum(), pl.col("kl_sum").sum())
    return {tuple(r[:4]): (int(r[4]), float(r[5])) for r in part.iter_rows()}


def _prefix_counts(side: dict[tuple, tuple[int, float]]) -> dict[tuple, int]:
    out: dict[tuple, int] = defaultdict(int)
    for cell, (n, _) in side.items():
        for i in range(len(FACTORS) + 1):
            out[cell[:i]] += n
    return out


def shift_share(cells: pl.DataFrame, a: tuple[int, int], b: tuple[int, int]) -> pl.DataFrame:
    """The decomposition of kl_k3(B) − kl_k3(A) from `kl_cells`' table; `a`, `b` inclusive step ranges.

    Returns [term, label, value]: "A" (kl_k3 over A), one "mix_<factor>" row per factor, "within", "B"
    (kl_k3 over B); the middle rows add up to B − A. Empty frame when either range has no tokens.
    A conditional P(factor | earlier factors) that A never saw (the earlier cell is empty in A) is taken from
    B, and a cell's k that A never saw from B, so every intermediate is a distribution and the chain starts
    at kl_k3(A) and ends at kl_k3(B).
    """
    A, B = _side(cells, *a), _side(cells, *b)
    if not A or not B:
        return pl.DataFrame(schema={"term": pl.String, "label": pl.String, "value": pl.Float64})
    pa, pb = _prefix_counts(A), _prefix_counts(B)
    union = sorted(set(A) | set(B))

    def cond(counts: dict, other: dict, cell: tuple, i: int) -> float:
        """P(cell[i] | cell[:i]) from `counts`, or from `other` where `counts` never saw cell[:i]."""
        src = counts if counts.get(cell[:i], 0) > 0 else other
        den = src.get(cell[:i], 0)
        return src.get(cell[:i + 1], 0) / den if den else 0.0

    def k(side: dict, other: dict, cell: tuple) -> float:
        n, s = side.get(cell) or other[cell]
        return s / n

    def value(n_from_b: int, k_from_b: bool) -> float:
        total = 0.0
        for cell in union:
            w = 1.0
            for i in range(len(FACTORS)):
                w *= cond(pb, pa, cell, i) if i < n_from_b else cond(pa, pb, cell, i)
                if w == 0.0:
                    break
            if w:
                total += w * (k(B, A, cell) if k_from_b else k(A, B, cell))
        return total

    chain = [value(j, False) for j in range(len(FACTORS) + 1)] + [value(len(FACTORS), True)]
    terms = [("A", "kl_k3 in A", chain[0])]
    terms += [(f"mix_{f}", FACTOR_LABELS[f], chain[i + 1] - chain[i]) for i, f in enumerate(FACTORS)]
    terms += [("within", FACTOR_LABELS["within"], chain[-1] - chain[-2]), ("B", "kl_k3 in B", chain[-1])]
    return pl.DataFrame(terms, schema={"term": pl.String, "label": pl.String, "value": pl.Float64}, orient="row")


def decompose(store: Store, run: str, a: tuple[int, int], b: tuple[int, int],
              only_steps: Sequence[int] | None = None) -> pl.DataFrame:
    """`shift_share` of one run between step ranges `a` and `b` (one query for both ranges); only_steps: read
    these steps of the ranges only (sampled.thin_steps, for runs too large to read whole)."""
    lo, hi = min(a[0], b[0]), max(a[1], b[1])
    return shift_share(kl_cells(store, run, (lo, hi), only_steps), a, b)


def thirds(steps: list[int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The first and the last third of the distinct steps (at least one step each) as inclusive ranges."""
    steps = sorted(set(steps))
    if len(steps) < 2:
        return None
    n = max(1, len(steps) // 3)
    return (steps[0], steps[n - 1]), (steps[-n], steps[-1])
