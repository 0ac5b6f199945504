"""Read side: the tables the pages and the CLI show, from summary rows only (cost follows steps, not tokens)."""
from __future__ import annotations

from typing import Sequence

import polars as pl

from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import schema as S
from analysis.summaries.sql import check_cap_clip, check_runs, run_filter


def token_table(store: Store, runs: Sequence[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                steps: tuple[int, int] | None = None, flips: bool = False) -> pl.DataFrame:
    """METRICS.md token columns per (run, step) or per run (`finalise.TOKEN_COLUMNS`), plus
    token_any_flip_rate and flipped_layers_per_token with flips=True (null without trainer routing).

    From summaries when C is in schema.CAPS and ε in schema.CLIPS (what the app offers): exact, and every
    token counts even where token rows are a sample. Other values fall back to the token rows
    (`metrics.token_metrics`), exact only where the token rows are complete (`coverage`).
    """
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    check_cap_clip(cap, clip)
    runs = check_runs(runs)
    keys = ["run", "step"] if by == "step" else ["run"]
    if not F.summarised(cap, clip):
        from analysis.metrics import token as metrics
        df = metrics.token_metrics(store, runs, by=by, cap=cap, clip=clip, steps=steps)
        if not flips:
            return df
        where, params = run_filter(runs, steps)
        fl = store.sql(F.token_flip_sql(keys, where), params).drop("n_tokens")
        return df.join(fl, on=keys, how="left") if not df.is_empty() else df.with_columns(
            pl.lit(None, pl.Float64).alias(c) for c in F.FLIP_COLUMNS)
    where, params = run_filter(runs, steps)
    params |= F.threshold_params(cap, clip, S.D_EDGES)
    return store.sql(F.token_table_sql(keys, where, flips=flips, checks=store.has_check_sums,
                                       residual=store.has_residual_sums), params)


def coverage(store: Store, runs: Sequence[str] | None = None) -> pl.DataFrame:
    """Per run: n_tokens the summaries cover, n_token_rows stored, and complete = whether every summarised
    token has its row (False: token-level views show a sample). [run, n_tokens, n_token_rows, complete].

    Read from the summaries alone (a count of the token rows costs a scan of them, ~1 s at 40M tokens): ingest
    summarises a file's token rows itself, so a step's rows are all there unless its summaries came from a
    DriftLogger summary file, whose summary_sample row says how many of the step's tokens it kept as rows."""
    runs = store.run_names() if runs is None else check_runs(runs)
    where, params = run_filter(runs)
    return store.sql(f"""
        WITH s AS (SELECT run, step, sum(n_tokens)::BIGINT AS n FROM summary_step WHERE {where} GROUP BY run, step),
             k AS (SELECT run, step, sum(n_kept)::BIGINT AS kept FROM summary_sample WHERE {where} GROUP BY run, step),
             c AS (SELECT s.run, sum(s.n)::BIGINT AS n_tokens, sum(least(coalesce(k.kept, s.n), s.n))::BIGINT AS n_token_rows
                   FROM s LEFT JOIN k USING (run, step) GROUP BY s.run)
        SELECT run, n_tokens, n_token_rows, n_token_rows >= n_tokens AS complete FROM c ORDER BY run""", params)
