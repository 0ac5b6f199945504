"""Single-sequence inspection: the worst sequences of a step, one sequence token by token, its flip grid."""
from __future__ import annotations

import polars as pl

from analysis.metrics import kl3_sql, ratio_sql
from analysis.store import Store

ORDERS = ("seq_log_ratio_abs", "max_log_ratio_abs")


def worst_sequences(store: Store, run: str, step: int, order: str = "seq_log_ratio_abs", n: int = 20) -> pl.DataFrame:
    """The `n` sequences of (run, step) with the largest mismatch, worst first.

    Per sequence, with Δ = t − s over its tokens: seq_log_ratio = ΣΔ = log(π_trainer(y)/π_sampler(y)) of the
    whole response, seq_log_ratio_abs = |ΣΔ|, max_log_ratio_abs = max |Δ|, kl_k3 = mean(r − 1 − Δ)
    (estimates KL(π_sampler ‖ π_trainer), r = exp(clamp(Δ, −20, 20))), n_flips = number of (token, layer)
    routing rows whose expert sets differ (null when the sequence has no trainer routing).
    order: "seq_log_ratio_abs" or "max_log_ratio_abs".
    Returns [sample, n_tokens, seq_log_ratio, seq_log_ratio_abs, max_log_ratio_abs, kl_k3, n_flips].
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    params = {"run": run, "step": int(step), "n": int(n)}
    return store.sql(f"""
        WITH s AS (SELECT sample, count(*) AS n_tokens, sum(d) AS seq_log_ratio, abs(sum(d)) AS seq_log_ratio_abs,
                          max(abs(d)) AS max_log_ratio_abs, avg({kl3_sql(ratio_sql('d'))}) AS kl_k3
                   FROM (SELECT sample, trainer_logprob - sampler_logprob AS d FROM tokens
                         WHERE run = $run AND step = $step)
                   GROUP BY sample),
             f AS (SELECT sample, count_if(flip)::BIGINT AS n_flips FROM routing
                   WHERE run = $run AND step = $step AND flip IS NOT NULL GROUP BY sample)
        SELECT s.*, f.n_flips FROM s LEFT JOIN f USING (sample)
        ORDER BY {order} DESC, sample LIMIT $n""", params)


def sequence_tokens(store: Store, run: str, step: int, sample: int) -> pl.DataFrame:
    """One sequence token by token: delta = Δ = t − s, ratio = r = exp(clamp(Δ, −20, 20)) = π_trainer/π_sampler,
    n_flipped_layers = layers whose expert sets differ at this token (null without trainer routing).

    Returns [pos, token_id, token, sampler_logprob, trainer_logprob, delta, ratio, n_flipped_layers] by pos.
    """
    return store.sql(f"""
        SELECT t.pos, t.token_id, t.token, t.sampler_logprob, t.trainer_logprob,
               t.trainer_logprob - t.sampler_logprob AS delta,
               {ratio_sql('t.trainer_logprob - t.sampler_logprob')} AS ratio, f.n_flipped_layers
        FROM tokens t
        LEFT JOIN (SELECT pos, count_if(flip)::BIGINT AS n_flipped_layers FROM routing
                   WHERE run = $run AND step = $step AND sample = $sample AND flip IS NOT NULL GROUP BY pos) f
          ON f.pos = t.pos
        WHERE t.run = $run AND t.step = $step AND t.sample = $sample
        ORDER BY t.pos""", {"run": run, "step": int(step), "sample": int(sample)})


def sequence_flip_grid(store: Store, run: str, step: int, sample: int) -> pl.DataFrame:
    """Position × layer grid of routing flips (E_s ≠ E_t as sets) for one sequence.

    Returns [pos, layer, flip] for rows with both sides recorded; empty without trainer routing.
    """
    return store.sql("""
        SELECT pos, layer, flip FROM routing
        WHERE run = $run AND step = $step AND sample = $sample AND flip IS NOT NULL
        ORDER BY pos, layer""", {"run": run, "step": int(step), "sample": int(sample)})


def run_steps(store: Store, run: str) -> list[int]:
    """The steps of a run that hold tokens, ascending."""
    return [r[0] for r in store.rows("SELECT DISTINCT step FROM tokens WHERE run = ? ORDER BY step", [run])]
