"""MoE routing agreement between sampler and trainer (METRICS.md, "Routing").

Every set comparison was paid once at ingest: `routing.flip` = 𝟙[E_s ≠ E_t] (as sets), `top1_flip` =
𝟙[first-ranked experts differ], `n_common` = |E_s ∩ E_t|, all NULL where the trainer side was not recorded.
Queries here only aggregate those small columns and the per-expert `expert_load` table.
"""
from __future__ import annotations

import polars as pl

from analysis.metrics import check_runs, kl3_sql, ratio_sql, run_filter, token_filter
from analysis.store import Store

# Per (run, step, layer): counts over rows with both sides, so that coarser groups can re-aggregate exactly.
_LAYER_COUNTS = """
    SELECT run, step, layer, count(flip) AS n, count_if(flip) AS n_flip, count_if(top1_flip) AS n_top1,
           sum(n_common::DOUBLE / k) AS sum_overlap
    FROM routing WHERE {where} GROUP BY run, step, layer"""

# load_max_vio per side: (max − mean) / mean of token counts over the experts seen on that side
# (count > 0) at this (step, layer); NULL when that side has no rows. expert_load holds one row per
# file and expert, hence the SUM first.
_LAYER_LOAD = """
    SELECT run, step, layer,
           (max(ns) FILTER (WHERE ns > 0) - avg(ns) FILTER (WHERE ns > 0)) / avg(ns) FILTER (WHERE ns > 0)
               AS load_max_vio_sampler,
           (max(nt) FILTER (WHERE nt > 0) - avg(nt) FILTER (WHERE nt > 0)) / avg(nt) FILTER (WHERE nt > 0)
               AS load_max_vio_trainer
    FROM (SELECT run, step, layer, expert, sum(n_sampler) AS ns, sum(n_trainer) AS nt
          FROM expert_load WHERE {where} GROUP BY run, step, layer, expert)
    GROUP BY run, step, layer"""

# One row per token with trainer routing: did any layer flip, how many, and the first one that did.
_TOKEN_FLIPS = """
    SELECT run, step, sample, pos, bool_or(flip) AS any_flip, count_if(flip)::BIGINT AS n_flipped,
           min(layer) FILTER (WHERE flip) AS first_flip
    FROM routing WHERE {where} AND flip IS NOT NULL GROUP BY run, step, sample, pos"""

_RATES = """sum(n)::BIGINT AS n_rows,
           sum(n_flip)::DOUBLE / nullif(sum(n), 0) AS flip_rate,
           sum(n_top1)::DOUBLE / nullif(sum(n), 0) AS top1_flip_rate,
           sum(sum_overlap) / nullif(sum(n), 0) AS overlap,
           avg(load_max_vio_sampler) AS load_max_vio_sampler,
           avg(load_max_vio_trainer) AS load_max_vio_trainer"""


def _filter(store: Store, runs: list[str], steps: tuple[int, int] | None) -> tuple[str, dict]:
    """run_filter for the routing table, without the run predicate when every run with routing is selected.

    Comparing the VARCHAR run of 8M rows is most of a by-layer query's time; `Store.routing_sides` says
    cheaply which runs have routing at all.
    """
    have = set(store.routing_sides())
    return run_filter(runs, steps, by_run=not (runs and have <= set(runs)))


def _check_by(by: str, allowed: tuple[str, ...]) -> None:
    if by not in allowed:
        raise ValueError(f"by must be one of {', '.join(map(repr, allowed))}, got {by!r}")


def routing_metrics(store: Store, runs: list[str], by: str = "layer",
                    steps: tuple[int, int] | None = None, token_flips: bool = True) -> pl.DataFrame:
    """Router agreement per (run, step, layer) (`by="layer"`), per (run, step) or per run.

    Over routing rows where both sides were recorded (E_s, E_t = top-k expert sets):
    flip_rate = mean 𝟙[E_s ≠ E_t]; top1_flip_rate = mean 𝟙[first-ranked experts differ];
    overlap = mean |E_s ∩ E_t| / k. load_max_vio_<side> = (max_e n_e − mean_e n_e) / mean_e n_e over the
    experts e with n_e > 0 tokens on that side (prime-rl `max_vio`); rows with the sampler side only still
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
    where, params = _filter(store, runs, steps)
    layers = f"""
        WITH c AS ({_LAYER_COUNTS.format(where=where)}),
             l AS ({_LAYER_LOAD.format(where=where)})
        SELECT c.run, c.step, c.layer, c.n, c.n_flip, c.n_top1, c.sum_overlap,
               l.load_max_vio_sampler, l.load_max_vio_trainer
        FROM c LEFT JOIN l ON c.run = l.run AND c.step = l.step AND c.layer = l.layer"""
    if by == "layer":
        return store.sql(f"""
            SELECT run, step, layer, n AS n_tokens,
                   n_flip::DOUBLE / nullif(n, 0) AS flip_rate,
                   n_top1::DOUBLE / nullif(n, 0) AS top1_flip_rate,
                   sum_overlap / nullif(n, 0) AS overlap,
                   load_max_vio_sampler, load_max_vio_trainer
            FROM ({layers}) ORDER BY run, step, layer""", params)
    keys = "run, step" if by == "step" else "run"
    pooled = f"SELECT {keys}, {_RATES} FROM ({layers}) GROUP BY {keys}"
    if not token_flips:  # the pooled rates only, without the per-token pass
        return store.sql(f"""
            SELECT {keys}, flip_rate, top1_flip_rate, overlap, load_max_vio_sampler, load_max_vio_trainer, n_rows
            FROM ({pooled}) ORDER BY {keys}""", params)
    on = " AND ".join(f"g.{k} = tf.{k}" for k in keys.split(", "))
    return store.sql(f"""
        WITH g AS ({pooled}),
             tf AS (SELECT {keys}, count(*) AS n_tokens, avg(any_flip::DOUBLE) AS token_any_flip_rate,
                           avg(n_flipped::DOUBLE) AS flipped_layers_per_token
                    FROM ({_TOKEN_FLIPS.format(where=where)}) GROUP BY {keys})
        SELECT {', '.join('g.' + k for k in keys.split(', '))}, coalesce(tf.n_tokens, 0) AS n_tokens,
               g.flip_rate, g.top1_flip_rate, g.overlap, g.load_max_vio_sampler, g.load_max_vio_trainer,
               tf.token_any_flip_rate, tf.flipped_layers_per_token, g.n_rows
        FROM g LEFT JOIN tf ON {on} ORDER BY {keys}""", params)


def layer_profile(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """flip_rate, top1_flip_rate and overlap per (run, layer), pooled over steps (rows with both sides only).

    Same definitions as `routing_metrics`; layers without trainer routing give no row.
    Returns [run, layer, n_tokens, flip_rate, top1_flip_rate, overlap].
    """
    runs = check_runs(runs)
    where, params = _filter(store, runs, steps)
    return store.sql(f"""
        SELECT run, layer, count(*) AS n_tokens, avg(flip::DOUBLE) AS flip_rate,
               avg(top1_flip::DOUBLE) AS top1_flip_rate, avg(n_common::DOUBLE / k) AS overlap
        FROM routing WHERE {where} AND flip IS NOT NULL
        GROUP BY run, layer ORDER BY run, layer""", params)


# The flip views share one per-token pass; each view is one grouping set of it.
FLIP_VIEWS = {"step": ("run", "step"), "run": ("run",), "first_flip": ("run", "first_flip"),
              "mismatch": ("run", "any_flip")}


def flip_views(store: Store, runs: list[str], steps: tuple[int, int] | None = None,
               views: tuple[str, ...] = ("step", "first_flip", "mismatch")) -> dict[str, pl.DataFrame]:
    """Several per-token flip tables from one pass over the routing rows (a GROUP BY GROUPING SETS).

    views: "step" / "run" = `token_flip_stats(by=...)`, "first_flip" = `first_flip_layer`, "mismatch" =
    `flip_mismatch` (only this one joins the tokens table, for Δ). Returns {view: the frame that function
    returns}: the same columns, dtypes, order and aggregates.
    """
    unknown = [v for v in views if v not in FLIP_VIEWS]
    if unknown or not views:
        raise ValueError(f"views must be some of {', '.join(FLIP_VIEWS)}, got {views!r}")
    runs = check_runs(runs)
    where, params = _filter(store, runs, steps)
    flips = _TOKEN_FLIPS.format(where=where)
    if "mismatch" in views:
        twhere, tparams = token_filter(store, runs, steps, alias="t")
        params.update(tparams)
        # An inner join loses no token: ingest refuses routing rows without their token (OrphanRouting). It
        # lets DuckDB filter the tokens scan by the routed keys: 0.17 s where a LEFT JOIN took 0.25 s.
        flips = f"""
            SELECT f.*, t.d FROM ({flips}) f
            JOIN (SELECT run, step, sample, pos, trainer_logprob - sampler_logprob AS d FROM tokens t
                       WHERE {twhere}) t
              ON f.run = t.run AND f.step = t.step AND f.sample = t.sample AND f.pos = t.pos"""
    else:
        flips = f"SELECT *, NULL::DOUBLE AS d FROM ({flips})"
    cols = [c for c in ("step", "first_flip", "any_flip") if any(c in FLIP_VIEWS[v] for v in views)]
    sets = ", ".join(f"({', '.join(FLIP_VIEWS[v])})" for v in views)
    df = store.sql(f"""
        SELECT {', '.join(['run', *cols])}, {f"GROUPING({', '.join(cols)})" if cols else "0"} AS g,
               count(*) AS n_tokens,
               avg(any_flip::DOUBLE) AS token_any_flip_rate, avg(n_flipped::DOUBLE) AS flipped_layers_per_token,
               count(d) AS n_d, avg(abs(d)) AS log_ratio_abs_mean, avg({kl3_sql(ratio_sql('d'))}) AS kl_k3
        FROM ({flips}) GROUP BY GROUPING SETS ({sets})""", params)

    def rows(view: str) -> pl.DataFrame:  # GROUPING() sets a bit for each column left out of the set
        g = sum(1 << (len(cols) - 1 - i) for i, c in enumerate(cols) if c not in FLIP_VIEWS[view])
        return df.filter(pl.col("g") == g)

    out: dict[str, pl.DataFrame] = {}
    for view in views:
        part = rows(view)
        if view in ("step", "run"):
            keys = list(FLIP_VIEWS[view])
            out[view] = part.select(*keys, "n_tokens", "token_any_flip_rate", "flipped_layers_per_token").sort(keys)
        elif view == "first_flip":  # tokens without a flip have no first flipped layer: the NULL group
            part = part.filter(pl.col("first_flip").is_not_null())
            out[view] = (part.select("run", pl.col("first_flip").alias("first_flip_layer"), "n_tokens")
                         .with_columns(frac=pl.col("n_tokens").cast(pl.Float64)
                                       / pl.col("n_tokens").sum().over("run"))
                         .sort("run", "first_flip_layer"))
        else:  # tokens with a log-prob pair only (d is never null once ingested; kept for safety)
            out[view] = (part.filter(pl.col("n_d") > 0)
                         .select("run", pl.col("any_flip").alias("flipped"), pl.col("n_d").alias("n_tokens"),
                                 "log_ratio_abs_mean", "kl_k3")
                         .sort("run", "flipped"))
    return out


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
