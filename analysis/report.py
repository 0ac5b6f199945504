"""The CLI's metrics table: one call that picks the right analysis for `--by`."""
from __future__ import annotations

import polars as pl

from analysis.metrics import check_runs, token_metrics
from analysis.routing import routing_metrics, token_flip_stats
from analysis.store import Store


def has_trainer_routing(store: Store, runs: list[str]) -> bool:
    """Whether any of `runs` recorded both sides of the routing (so flip metrics exist)."""
    sides = store.routing_sides()
    return any(sides.get(run, False) for run in check_runs(runs))


def metrics_table(store: Store, runs: list[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                  steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """The table `python -m analysis metrics --by ...` prints; columns use METRICS.md names.

    by="step": `metrics.token_metrics(by="step")`; by="layer": `routing.routing_metrics(by="layer")`;
    by="run": `metrics.token_metrics(by="run")` plus token_any_flip_rate and flipped_layers_per_token
    (see `routing.token_flip_stats`) when any of the runs has trainer routing, null for runs without.
    `steps` (inclusive range) restricts every table to those steps.
    """
    runs = check_runs(runs)
    if by == "step":
        return token_metrics(store, runs, by="step", cap=cap, clip=clip, steps=steps)
    if by == "layer":
        return routing_metrics(store, runs, by="layer", steps=steps)
    if by != "run":
        raise ValueError(f"by must be 'step', 'layer' or 'run', got {by!r}")
    df = token_metrics(store, runs, by="run", cap=cap, clip=clip, steps=steps)
    if not has_trainer_routing(store, runs):
        return df
    flips = token_flip_stats(store, runs, by="run", steps=steps).select("run", "token_any_flip_rate", "flipped_layers_per_token")
    return df.join(flips, on="run", how="left").sort("run")
