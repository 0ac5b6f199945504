"""MoE routing agreement between sampler and trainer (METRICS.md, "Routing").

Every set comparison was paid once at ingest: `routing.flip` = 𝟙[E_s ≠ E_t] (as sets), `top1_flip` =
𝟙[first-ranked experts differ], `n_common` = |E_s ∩ E_t|, all NULL where the trainer side was not recorded;
ingest also summed them per (step, layer) and per token (summaries). Queries here read those summaries and the
per-expert `expert_load` table, never the routing rows.
"""
from __future__ import annotations

import polars as pl

from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import margins as M
from analysis.summaries.sql import check_runs, run_filter


def _check_by(by: str, allowed: tuple[str, ...]) -> None:
    if by not in allowed:
        raise ValueError(f"by must be one of {', '.join(map(repr, allowed))}, got {by!r}")


def routing_metrics(store: Store, runs: list[str], by: str = "layer",
                    steps: tuple[int, int] | None = None, token_flips: bool = True) -> pl.DataFrame:
    """Router agreement per (run, step, layer) (`by="layer"`), per (run, step) or per run.

    Over routing rows where both sides were recorded (E_s, E_t = top-k expert sets):
    flip_rate = mean 𝟙[E_s ≠ E_t]; top1_flip_rate = mean 𝟙[first-ranked experts differ];
    overlap = mean |E_s ∩ E_t| / k. load_max_vio_<side> = (max_e n_e − mean_e n_e) / mean_e n_e over the
    experts e with n_e > 0 tokens on that side (every other definition: metrics/load.py); rows with the sampler side only still
    count here. by="layer": n_tokens = tokens with both sides at this layer (0 for sampler-only layers, whose
    flip columns are then null).

    by="step" / "run": flip_rate, top1_flip_rate and overlap pool all (token, layer) rows (n_rows of them);
    load_max_vio_* is the mean of the per-(step, layer) values; n_tokens = tokens with trainer routing;
    token_any_flip_rate = mean over those tokens of 𝟙[some layer flips]; flipped_layers_per_token = mean
    number of flipped layers. token_flips=False (by="step" / "run"): without n_tokens and those two per-token
    columns, which cost a pass over the routing rows per token.

    Example: a token whose sampler picked [3, 7] and trainer [7, 3] is not a flip (same set) but a top-1 flip;
    trainer [3, 5] gives a flip with overlap 1/2.
    """
    _check_by(by, ("layer", "step", "run"))
    runs = check_runs(runs)
    where, params = run_filter(runs, steps)
    if by == "layer":
        return store.sql(F.routing_by_layer_sql(where, weights=store.has_weight_sums,
                                                margins=store.has_margin_sums), params)
    keys = ["run", "step"] if by == "step" else ["run"]
    return store.sql(F.routing_pooled_sql(keys, where, token_flips), params)


def layer_profile(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """flip_rate, top1_flip_rate and overlap per (run, layer), pooled over steps (rows with both sides only).

    Same definitions as `routing_metrics`; layers without trainer routing give no row.
    Returns [run, layer, n_tokens, flip_rate, top1_flip_rate, overlap].
    """
    runs = check_runs(runs)
    where, params = run_filter(runs, steps)
    return store.sql(F.layer_profile_sql(where), params)


FLIP_VIEWS = ("step", "run", "first_flip", "mismatch")


def flip_views(store: Store, runs: list[str], steps: tuple[int, int] | None = None,
               views: tuple[str, ...] = ("step", "first_flip", "mismatch")) -> dict[str, pl.DataFrame]:
    """Several per-token flip tables at once, from the summaries (per-token flips were counted at ingest).

    views: "step" / "run" = `token_flip_stats(by=...)`, "first_flip" = `first_flip_layer`, "mismatch" =
    `flip_mismatch`. Returns {view: the frame that function returns}.
    """
    unknown = [v for v in views if v not in FLIP_VIEWS]
    if unknown or not views:
        raise ValueError(f"views must be some of {', '.join(FLIP_VIEWS)}, got {views!r}")
    runs = check_runs(runs)
    where, params = run_filter(runs, steps)
    sql = {"step": lambda: F.token_flip_sql(["run", "step"], where), "run": lambda: F.token_flip_sql(["run"], where),
           "first_flip": lambda: F.first_flip_sql(where), "mismatch": lambda: F.flip_mismatch_sql(where)}
    return {view: store.sql(sql[view](), params) for view in views}


def token_flip_stats(store: Store, runs: list[str], by: str = "step",
                     steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per-token flip statistics per (run, step) or per run, over tokens with trainer routing.

    token_any_flip_rate = mean over tokens of 𝟙[∃ layer: E_s ≠ E_t] (R3 reports 94%);
    flipped_layers_per_token = mean over tokens of #{layers with E_s ≠ E_t} (R3: ~6).
    Returns [run, (step,) n_tokens, token_any_flip_rate, flipped_layers_per_token]; groups without trainer
    routing give no row.

    Example: two tokens over 4 layers, one flipping at layers 1 and 3, the other never:
    token_any_flip_rate = 0.5, flipped_layers_per_token = 1.0.
    """
    _check_by(by, ("step", "run"))
    return flip_views(store, runs, steps, views=(by,))[by]


def first_flip_layer(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Distribution of the first (lowest-index) flipped layer over tokens with at least one flip.

    frac = n_tokens / (tokens of the run with a flip), so the fracs of a run sum to 1.
    Returns [run, first_flip_layer, n_tokens, frac].
    """
    return flip_views(store, runs, steps, views=("first_flip",))["first_flip"]


def expert_load(store: Store, run: str, step: int, layer: int) -> pl.DataFrame:
    """Tokens routed to each expert at one (run, step, layer), per side.

    frac_<side> = n_<side> / Σ_e n_<side> (share of that side's top-k slots; null when the side has no rows).
    Returns [expert, n_sampler, n_trainer, frac_sampler, frac_trainer], experts ascending.
    """
    return store.sql("""
        SELECT expert, n_sampler, n_trainer,
               n_sampler::DOUBLE / nullif(sum(n_sampler) OVER (), 0) AS frac_sampler,
               n_trainer::DOUBLE / nullif(sum(n_trainer) OVER (), 0) AS frac_trainer
        FROM (SELECT expert, sum(n_sampler)::BIGINT AS n_sampler, sum(n_trainer)::BIGINT AS n_trainer
              FROM expert_load WHERE run = $run AND step = $step AND layer = $layer GROUP BY expert)
        ORDER BY expert""", {"run": run, "step": int(step), "layer": int(layer)})


def flip_mismatch(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Token mismatch of tokens whose routing flipped at some layer versus tokens that never flipped.

    Over tokens with trainer routing, split by flipped = 𝟙[∃ layer: E_s ≠ E_t]:
    log_ratio_abs_mean = mean |Δ|, kl_k3 = mean(r − 1 − Δ) (estimates KL(π_sampler ‖ π_trainer)),
    Δ = t − s, r = exp(clamp(Δ, −20, 20)). Returns [run, flipped, n_tokens, log_ratio_abs_mean, kl_k3];
    an empty group gives no row.
    """
    return flip_views(store, runs, steps, views=("mismatch",))["mismatch"]


def flip_rate_by_margin(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """METRICS.md v3 flip_rate_by_margin: per (run, margin bin) of the (token, layer) rows with both sides'
    experts and a router margin, flip_rate = share of rows with E_s ≠ E_t and log_ratio_abs_mean = mean |Δ| of
    their tokens (a token counts once per layer), by the sampler's margin where the run recorded it, else by
    the trainer's (`side` says which; summaries/margins.py). From the summaries (summary_margin): exact whatever
    the token sample. Returns summaries/margins.BY_MARGIN_COLUMNS, a row per non-empty bin; empty without
    margins."""
    runs = check_runs(runs)
    if not store.has_margin_sums:
        return _by_margin_frame(pl.DataFrame(schema=_BY_MARGIN_SCHEMA))
    where, params = run_filter(runs, steps)
    return _by_margin_frame(store.sql(M.by_margin_sql(where), params))


def flip_rate_by_margin_rows(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """`flip_rate_by_margin` from the routing rows joined with their token rows (the drill-down path; exact for
    every token only where the rows are complete, e.g. not for a DriftLogger token sample)."""
    runs = check_runs(runs)
    if not store.has_columns("routing", ["sampler_margin", "trainer_margin"]):
        return _by_margin_frame(pl.DataFrame(schema=_BY_MARGIN_SCHEMA))
    where, params = run_filter(runs, steps, alias="r")
    side = "CASE WHEN bool_or(sampler_margin IS NOT NULL) OVER (PARTITION BY run) THEN 'sampler' ELSE 'trainer' END"
    return _by_margin_frame(store.sql(f"""
        WITH r AS (SELECT r.run, r.step, r.sample, r.pos, r.flip, r.sampler_margin, r.trainer_margin
                   FROM routing r WHERE {where} AND r.flip IS NOT NULL
                     AND (r.sampler_margin IS NOT NULL OR r.trainer_margin IS NOT NULL)),
             s AS (SELECT *, {side} AS side FROM r),
             b AS (SELECT run, step, sample, pos, flip, side,
                          CASE WHEN side = 'sampler' THEN sampler_margin ELSE trainer_margin END AS m FROM s)
        SELECT b.run, b.side, {M.margin_bin_sql('b.m')}::BIGINT AS margin_bin, count(*) AS n_tokens,
               count_if(b.flip)::DOUBLE / count(*) AS flip_rate,
               fsum(abs(t.trainer_logprob - t.sampler_logprob)) / count(*) AS log_ratio_abs_mean
        FROM b JOIN tokens t USING (run, step, sample, pos) WHERE b.m IS NOT NULL
        GROUP BY ALL ORDER BY b.run, margin_bin""", params))


_BY_MARGIN_SCHEMA = {"run": pl.String, "side": pl.String, "margin_bin": pl.Int64, "n_tokens": pl.Int64,
                     "flip_rate": pl.Float64, "log_ratio_abs_mean": pl.Float64}


def _by_margin_frame(df: pl.DataFrame) -> pl.DataFrame:
    """The bins' edges and label added: [run, side, margin_bin, margin_lo, margin_hi, label, n_tokens, ...]."""
    from analysis.summaries.schema import MARGIN_EDGES
    b = df["margin_bin"].cast(pl.Int64)
    df = df.with_columns(margin_bin=b, margin_lo=b.map_elements(lambda i: MARGIN_EDGES[i], pl.Float64),
                         margin_hi=b.map_elements(lambda i: MARGIN_EDGES[i + 1], pl.Float64),
                         label=b.map_elements(M.margin_label, pl.String))
    return df.select(*M.BY_MARGIN_COLUMNS[:5], "label", *M.BY_MARGIN_COLUMNS[5:])
