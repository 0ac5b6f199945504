"""The CLI's metrics table: one call that picks the right analysis for `--by`."""
from __future__ import annotations

import polars as pl

from analysis.metrics.read import token_table
from analysis.store import Store
from analysis.summaries.schema import LATTICE_Q
from analysis.summaries.sql import check_runs


def has_trainer_routing(store: Store, runs: list[str]) -> bool:
    """Whether any of `runs` recorded both sides of the routing (so flip metrics exist)."""
    sides = store.routing_sides()
    return any(sides.get(run, False) for run in check_runs(runs))


def metrics_table(store: Store, runs: list[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                  steps: tuple[int, int] | None = None, q: float | None = None) -> pl.DataFrame:
    """The table `python -m analysis metrics --by ...` prints; columns use METRICS.md names.

    All from the summaries (their cost follows the number of steps, not of tokens).
    by="step" / "run": the METRICS.md token columns (`summaries.read.token_table`), plus token_any_flip_rate and
    flipped_layers_per_token when any of the runs has trainer routing (null for runs without);
    by="layer": `routing.routing_metrics(by="layer")`. `steps` (inclusive range) restricts every table.
    `q`: the quantum of lattice_share_q; the summaries answer schema.LATTICE_Q, another q is counted over the
    token rows (exact where they are complete, over DriftLogger's sample otherwise).
    """
    runs = check_runs(runs)
    if by == "layer":
        from analysis.metrics.routing import routing_metrics  # only this table needs it (a whole CLI process per call)
        return routing_metrics(store, runs, by="layer", steps=steps)
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step', 'layer' or 'run', got {by!r}")
    df = token_table(store, runs, by=by, cap=cap, clip=clip, steps=steps, flips=has_trainer_routing(store, runs))
    if q is None or float(q) == LATTICE_Q:
        return df
    from analysis.metrics.token import residual_metrics  # another quantum: the token rows (summaries hold q = 1/8)
    keys = ["run", "step"] if by == "step" else ["run"]
    other = residual_metrics(store, runs, by=by, q=q, steps=steps).select(keys + ["lattice_share_q"])
    return df.drop("lattice_share_q").join(other, on=keys, how="left", maintain_order="left").select(df.columns)
