"""Reading the drift-origin probe (table `probe`, docs/SCHEMA.md): where the divergence first rises above the
noise floor, which layer first flips each token's routing, and one token's path through the layers.

The rule for "above the floor" (docs/lab.md, "Drift origin probe"): at a (layer, op), the mean relative L2 over
the run's tokens exceeds FLOOR_FACTOR times the mean of the same comparison with both sides in fp32, plus
FLOOR_ABS (so that a floor of exactly 0 is not exceeded by 0). Ops are ordered as a block computes them: input,
attention, router, MoE/MLP; the first such (layer, op) in that order is where the drift starts.
"""
from __future__ import annotations

import polars as pl

from analysis import schema
from analysis.store import Store

FLOOR_FACTOR = 4.0
FLOOR_ABS = 1e-9
OP_ORDER = {op: i for i, op in enumerate(schema.PROBE_OPS)}


def probe_runs(store: Store) -> list[str]:
    """Runs with probe rows (none in a database made before the probe, which may lack the table)."""
    exists = store.scalar("SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND schema_name = 'main' "
                          "AND database_name = current_database()", [schema.PROBE_TABLE])
    if not exists:
        return []
    return [r[0] for r in store.rows(f"SELECT DISTINCT run FROM {schema.PROBE_TABLE} ORDER BY run")]


def by_layer_op(store: Store, run: str) -> pl.DataFrame:
    """Per (layer, op), in compute order: tokens, mean / max relative L2 and max |Δa| against the floor's, the
    flip rate (router rows), and whether it is above the floor."""
    df = store.sql(f"""SELECT layer, op, count(*) AS n_tokens,
            avg(rel_l2) AS rel_l2_mean, max(rel_l2) AS rel_l2_max, max(max_abs) AS max_abs,
            avg(floor_rel_l2) AS floor_rel_l2_mean, max(floor_rel_l2) AS floor_rel_l2_max,
            max(floor_max_abs) AS floor_max_abs, avg(flip::DOUBLE) AS flip_rate
        FROM {schema.PROBE_TABLE} WHERE run = ? GROUP BY layer, op""", [run])
    df = df.with_columns(pl.col("op").replace_strict(OP_ORDER, return_dtype=pl.Int32).alias("op_index")) \
        .sort("layer", "op_index")
    return df.with_columns(above_floor=pl.col("rel_l2_mean") > FLOOR_FACTOR * pl.col("floor_rel_l2_mean") + FLOOR_ABS,
                           site=pl.format("L{} {}", pl.col("layer"), pl.col("op")))


def first_above_floor(table: pl.DataFrame) -> dict | None:
    """The first (layer, op) of by_layer_op's table that is above the floor, as a row dict; None if none is."""
    hit = table.filter(pl.col("above_floor"))
    return hit.row(0, named=True) if hit.height else None


def first_flips(store: Store, run: str) -> pl.DataFrame:
    """Per token (sample, pos): the first layer whose router top-k set differs (NULL: none does), how many layers
    flip, the router margin there (min of both sides), and Δ = t − s from the run's token rows."""
    return store.sql(f"""SELECT p.sample, p.pos, min(p.layer) FILTER (WHERE p.flip) AS first_flip_layer,
            count(*) FILTER (WHERE p.flip) AS n_flipped_layers,
            arg_min(least(p.sampler_margin, p.trainer_margin), p.layer) FILTER (WHERE p.flip) AS margin_at_first,
            any_value(t.trainer_logprob - t.sampler_logprob) AS delta
        FROM {schema.PROBE_TABLE} p LEFT JOIN tokens t
          ON t.run = p.run AND t.step = p.step AND t.sample = p.sample AND t.pos = p.pos
        WHERE p.run = ? AND p.op = 'router' GROUP BY p.sample, p.pos ORDER BY p.sample, p.pos""", [run])


def token_path(store: Store, run: str, sample: int, pos: int) -> pl.DataFrame:
    """One token's rows through the layers, in compute order, with its floor and router columns."""
    df = store.sql(f"""SELECT layer, op, rel_l2, floor_rel_l2, max_abs, floor_max_abs, sampler_topk, trainer_topk,
            sampler_margin, trainer_margin, flip
        FROM {schema.PROBE_TABLE} WHERE run = ? AND sample = ? AND pos = ?""", [run, sample, pos])
    return df.with_columns(pl.col("op").replace_strict(OP_ORDER, return_dtype=pl.Int32).alias("op_index")) \
        .sort("layer", "op_index").with_columns(site=pl.format("L{} {}", pl.col("layer"), pl.col("op")))


def token_deltas(store: Store, run: str) -> pl.DataFrame:
    """The run's probed tokens with Δ, largest |Δ| first (to pick one for token_path)."""
    return store.sql(f"""SELECT DISTINCT p.sample, p.pos, t.trainer_logprob - t.sampler_logprob AS delta
        FROM {schema.PROBE_TABLE} p JOIN tokens t
          ON t.run = p.run AND t.step = p.step AND t.sample = p.sample AND t.pos = p.pos
        WHERE p.run = ? ORDER BY abs(delta) DESC, p.sample, p.pos""", [run])
