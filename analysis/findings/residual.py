"""What is left of a mismatch has signatures practitioners name one by one
(docs/DIAGNOSIS.md#2026-h2-new-evidence-and-open-questions); two of them need nothing but the token rows, read
here with one query per run set:

- first_token: the share of Σ k3 at response position 0 (METRICS.md v3 `first_token_kl_share`): a mismatch
  concentrated on the first generated token (prefill against decode, a chat template's first token);
- lattice: Δ on multiples of a quantum q = 2^-k (default 0.125, an FP8 step): the share of tokens with Δ ≠ 0
  that sit on a non-zero multiple of q within 1e-6 (`lattice_share_q`, except that Δ rounding to 0·q does not
  count: at |Δ| < 1.25e-7, every fp32 token would).

The token rows may be a sample of the run's tokens (DriftLogger's token_sample): the shares are then estimates
from that sample, as every token-row view is.
"""
from __future__ import annotations

from typing import Sequence

import polars as pl

from analysis.store import Store
from analysis.summaries.sql import run_filter, token_terms_sql

LATTICE_Q = 0.125
LATTICE_TOL = 1e-6


def signature_table(store: Store, runs: Sequence[str], q: float = LATTICE_Q,
                    steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per run, from the token rows (k3: the summaries' own per-token term, summaries/sql.py): n_tokens, kl_k3,
    first_token_kl_share (NULL when Σ k3 is 0), k3 mean at position 0 and elsewhere, n_first, n_nonzero (tokens
    with Δ ≠ 0), lattice_share (of those, on a non-zero multiple of q) and q."""
    if not q > 0:
        raise ValueError(f"lattice quantum q: expected a number > 0, got {q!r}")
    where, params = run_filter(list(runs), steps)
    params["q"] = q
    params["tol"] = LATTICE_TOL
    return store.sql(f"""
        WITH k AS (SELECT run, pos, d, k3, round(d / $q) AS m FROM ({token_terms_sql(
                       f"SELECT run, pos, sampler_logprob AS s, trainer_logprob AS t FROM tokens WHERE {where}")}))
        SELECT run, count(*) AS n_tokens, avg(k3) AS kl_k3,
               CASE WHEN sum(k3) > 0 THEN sum(k3) FILTER (WHERE pos = 0) / sum(k3) END AS first_token_kl_share,
               avg(k3) FILTER (WHERE pos = 0) AS k3_first, avg(k3) FILTER (WHERE pos > 0) AS k3_rest,
               count(*) FILTER (WHERE pos = 0) AS n_first,
               count(*) FILTER (WHERE d <> 0) AS n_nonzero,
               count(*) FILTER (WHERE d <> 0 AND m <> 0 AND abs(d / $q - m) < $tol)::DOUBLE
                   / nullif(count(*) FILTER (WHERE d <> 0), 0) AS lattice_share,
               $q AS q
        FROM k GROUP BY run ORDER BY run""", params)
