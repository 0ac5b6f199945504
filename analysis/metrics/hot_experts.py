"""Hot experts over time and by domain, and what routing to them costs in drift (METRICS.md, "Expert load").

An expert is hot at (step, layer) when its tokens exceed twice the fair share (mean over all n experts), as
`load_hot_experts` counts. Timelines and persistence read the `expert_load` aggregate only. Two views need the
routing rows and are bounded: the split by sequence tag (where the `sequences` table has a `tag` column with
values) and the drift of tokens routed to hot versus other experts read at most `max_steps` steps, spread evenly
over the selection, and say which.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from analysis.metrics import load as L
from analysis.store import Store
from analysis.summaries.sql import run_filter

MAX_STEPS = 8  # the routing-row views read at most this many steps (evenly spread), so a page stays in budget


def hot_timeline(store: Store, run: str, side: str = "sampler", steps: tuple[int, int] | None = None,
                 n_experts: int | None = None) -> pl.DataFrame:
    """[step, layer, expert, share, hot]: each expert's share of the side's tokens at (step, layer) (0 for an
    expert without tokens), and whether it is hot (tokens > 2 × fair share)."""
    cube = L.counts_cube(store, run, steps, n_experts)
    c = cube.n[side]
    S, Ly, E = c.shape
    total = c.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, c / np.where(total > 0, total, 1), np.nan)
    hot = c > L.HOT_FACTOR * total / E
    return pl.DataFrame({
        "step": np.repeat(cube.steps, Ly * E).astype(np.int64),
        "layer": np.tile(np.repeat(cube.layers, E), S).astype(np.int64),
        "expert": np.tile(np.arange(E), S * Ly).astype(np.int64),
        "share": share.reshape(-1), "hot": hot.reshape(-1)}).with_columns(pl.col("share").fill_nan(None))


def persistence(timeline: pl.DataFrame) -> pl.DataFrame:
    """Per (layer, expert) of a hot_timeline: hot_share = share of the steps with tokens at that layer in which
    the expert was hot, mean_share = its mean share of tokens. Rows with hot_share > 0 first, largest first."""
    t = timeline.filter(pl.col("share").is_not_null())
    return (t.group_by("layer", "expert")
            .agg(hot_share=pl.col("hot").mean(), mean_share=pl.col("share").mean(), n_steps=pl.len())
            .sort(["hot_share", "mean_share", "layer", "expert"], descending=[True, True, False, False]))


def persistence_of(c: np.ndarray, layers: np.ndarray) -> pl.DataFrame:
    """`persistence` straight from counts c[step, layer, expert] (the page's path: no per-cell frame)."""
    S, Ly, E = c.shape
    total = c.sum(-1, keepdims=True)
    live = total[..., 0] > 0  # [step, layer]
    hot = (c > L.HOT_FACTOR * total / E) & live[..., None]
    share = np.where(live[..., None], c / np.where(total > 0, total, 1), 0.0)
    n_steps = live.sum(0)  # [layer]
    keep = np.repeat(n_steps > 0, E)
    with np.errstate(invalid="ignore", divide="ignore"):
        hot_share = (hot.sum(0) / n_steps[:, None]).reshape(-1)
        mean_share = (share.sum(0) / n_steps[:, None]).reshape(-1)
    df = pl.DataFrame({"layer": np.repeat(layers, E).astype(np.int64), "expert": np.tile(np.arange(E), Ly).astype(np.int64),
                       "hot_share": hot_share, "mean_share": mean_share,
                       "n_steps": np.repeat(n_steps, E).astype(np.uint32)}).filter(pl.Series(keep))
    return df.sort(["hot_share", "mean_share", "layer", "expert"], descending=[True, True, False, False])


def side_difference(store: Store, run: str, steps: tuple[int, int] | None = None,
                    n_experts: int | None = None) -> pl.DataFrame:
    """[step, layer, load_tv]: total variation ½ Σ_e |p_s(e) − p_t(e)| between the sampler's and the trainer's load
    shares at (step, layer); only where both sides have tokens. 0: both routers spread tokens alike."""
    cube = L.counts_cube(store, run, steps, n_experts)
    s, t = cube.n["sampler"], cube.n["trainer"]
    ts, tt = s.sum(-1), t.sum(-1)
    ok = (ts > 0) & (tt > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tv = 0.5 * np.abs(s / np.where(ts > 0, ts, 1)[..., None] - t / np.where(tt > 0, tt, 1)[..., None]).sum(-1)
    si, li = np.nonzero(ok)
    return pl.DataFrame({"step": cube.steps[si].astype(np.int64), "layer": cube.layers[li].astype(np.int64),
                         "load_tv": tv[si, li]})


def _spread_steps(store: Store, run: str, steps: tuple[int, int] | None, max_steps: int) -> list[int]:
    where, params = run_filter([run], steps)
    all_steps = [r[0] for r in store.rows(f"SELECT DISTINCT step FROM expert_load WHERE {where} ORDER BY step",
                                          params)]
    if len(all_steps) <= max_steps:
        return all_steps
    idx = np.unique(np.linspace(0, len(all_steps) - 1, max_steps).round().astype(int))
    return [all_steps[i] for i in idx]


def _tag_type(store: Store) -> str | None:
    """The type of sequences.tag, or None where the database has no such column (tags not logged)."""
    rows = store.rows("SELECT data_type FROM duckdb_columns() WHERE table_name = 'sequences' AND column_name = 'tag' "
                      "AND schema_name = 'main' AND database_name = current_database()")
    return rows[0][0] if rows else None


def domain_load(store: Store, run: str, steps: tuple[int, int] | None = None,
                max_steps: int = MAX_STEPS) -> tuple[pl.DataFrame, str]:
    """Sampler load per (tag, layer, expert) over sequences with a tag: [tag, layer, expert, n, share] (share of
    the tag's routed slots at that layer), and a note saying which steps were read or why there is nothing."""
    kind = _tag_type(store)
    empty = pl.DataFrame(schema={"tag": pl.Utf8, "layer": pl.Int64, "expert": pl.Int64, "n": pl.Int64,
                                 "share": pl.Float64})
    if kind is None:
        return empty, "no tags logged (the sequences table has no tag column)"
    tag = "unnest(q.tag)" if kind.endswith("[]") else "q.tag"
    chosen = _spread_steps(store, run, steps, max_steps)
    if not chosen:
        return empty, "no expert load in these steps"
    df = store.sql(f"""
        WITH q AS (SELECT step, sample, {tag} AS tag FROM sequences q WHERE run = $run AND list_contains($steps, step)),
             r AS (SELECT step, sample, layer, unnest(sampler_experts) AS expert FROM routing
                   WHERE run = $run AND list_contains($steps, step))
        SELECT tag::VARCHAR AS tag, layer::BIGINT AS layer, expert::BIGINT AS expert, count(*)::BIGINT AS n
        FROM r JOIN q USING (step, sample) WHERE tag IS NOT NULL GROUP BY ALL""",
                   {"run": run, "steps": chosen})
    if df.is_empty():
        return empty, "no tags logged for this run's sequences"
    df = df.with_columns(share=pl.col("n") / pl.col("n").sum().over("tag", "layer")).sort("tag", "layer", "expert")
    return df, _steps_note(chosen, steps, store, run)


def _steps_note(chosen: list[int], steps, store: Store, run: str) -> str:
    where, params = run_filter([run], steps)
    n = store.scalar(f"SELECT count(DISTINCT step) FROM expert_load WHERE {where}", params) or 0
    return (f"from the routing rows of {len(chosen)} of {n} steps ({', '.join(map(str, chosen))})"
            if len(chosen) < n else f"from the routing rows of all {n} steps")


def hot_drift(store: Store, run: str, steps: tuple[int, int] | None = None, max_steps: int = MAX_STEPS,
              n_experts: int | None = None) -> tuple[pl.DataFrame, str]:
    """Drift of (token, layer) routing rows whose sampler experts include a hot one (hot at that step and layer,
    sampler side) against the rest: [routed_to_hot, n_rows, flip_rate, log_ratio_abs_mean], flip_rate over rows
    with the trainer's side (null without), log_ratio_abs_mean = mean |t − s| of the rows' tokens. Bounded to
    `max_steps` steps; the note says which."""
    chosen = _spread_steps(store, run, steps, max_steps)
    out_schema = {"routed_to_hot": pl.Boolean, "n_rows": pl.Int64, "flip_rate": pl.Float64,
                  "log_ratio_abs_mean": pl.Float64}
    if not chosen:
        return pl.DataFrame(schema=out_schema), "no expert load in these steps"
    n = n_experts or L.counts_cube(store, run, (chosen[0], chosen[0]), n_experts).n_experts
    df = store.sql("""
        WITH c AS (SELECT step, layer, expert, sum(n_sampler) AS ns FROM expert_load
                   WHERE run = $run AND list_contains($steps, step) GROUP BY ALL),
             hot AS (SELECT step, layer, list(expert) AS hot FROM
                        (SELECT *, sum(ns) OVER (PARTITION BY step, layer) AS total FROM c)
                     WHERE ns > 2.0 * total / $n GROUP BY ALL),
             r AS (SELECT r.step, r.sample, r.pos, r.flip,
                          coalesce(len(list_intersect(r.sampler_experts, hot.hot)) > 0, false) AS routed_to_hot
                   FROM routing r LEFT JOIN hot USING (step, layer)
                   WHERE r.run = $run AND list_contains($steps, r.step)),
             t AS (SELECT step, sample, pos, abs(trainer_logprob - sampler_logprob) AS d FROM tokens
                   WHERE run = $run AND list_contains($steps, step))
        SELECT routed_to_hot, count(*)::BIGINT AS n_rows, avg(flip::DOUBLE) AS flip_rate, avg(d) AS log_ratio_abs_mean
        FROM r LEFT JOIN t USING (step, sample, pos) GROUP BY ALL ORDER BY routed_to_hot DESC""",
                   {"run": run, "steps": chosen, "n": float(n)})
    return df, _steps_note(chosen, steps, store, run)
