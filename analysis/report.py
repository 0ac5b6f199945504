"""The CLI's metrics table: one call that picks the right analysis for `--by`."""
from __future__ import annotations

import polars as pl

from analysis import views
from analysis.metrics import check_runs
from analysis.routing import routing_metrics
from analysis.store import Store

FLIP_COLUMNS = ("token_any_flip_rate", "flipped_layers_per_token")


def has_trainer_routing(store: Store, runs: list[str]) -> bool:
    """Whether any of `runs` recorded both sides of the routing (so flip metrics exist)."""
    sides = store.routing_sides()
    return any(sides.get(run, False) for run in check_runs(runs))


def metrics_table(store: Store, runs: list[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                  steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """The table `python -m analysis metrics --by ...` prints; columns use METRICS.md names.

    by="step" / by="run": the tables the pages show (`views.step_metrics` / `views.run_summary`): the token
    metrics plus token_any_flip_rate and flipped_layers_per_token, null for runs without the trainer's
    routing; the two columns are left out when none of the runs has it. by="layer":
    `routing.routing_metrics(by="layer")`. `steps` (inclusive range) restricts every table to those steps.
    """
    runs = check_runs(runs)
    if by == "layer":
        return routing_metrics(store, runs, by="layer", steps=steps)
    tables = {"step": views.step_metrics, "run": views.run_summary}
    if by not in tables:
        raise ValueError(f"by must be 'step', 'layer' or 'run', got {by!r}")
    df = tables[by](store, runs, cap=cap, clip=clip, steps=steps)
    return df if has_trainer_routing(store, runs) else df.drop(FLIP_COLUMNS)
