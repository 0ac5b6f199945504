"""Compare runs: which config keys differ, and how each metric moves against a baseline run."""
from __future__ import annotations

import json

import polars as pl

from analysis.metrics.report import has_trainer_routing, metrics_table
from analysis.metrics.routing import routing_metrics
from analysis.store import Store

ROUTING_RUN_METRICS = ("flip_rate", "top1_flip_rate", "overlap", "load_max_vio_sampler", "load_max_vio_trainer")


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config as {"a.b.c": value}; values as text (strings as-is, everything else as JSON).

    >>> flatten({"model": {"dtype": "bf16", "layers": 2}, "lr": 1e-5})
    {'model.dtype': 'bf16', 'model.layers': '2', 'lr': '1e-05'}
    """
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return out


def config_diff(store: Store, runs: list[str], all_keys: bool = False) -> pl.DataFrame:
    """Config keys (flattened with dots) whose values differ between `runs` (every key with all_keys=True).

    A key missing from a run's config is null there and counts as different.
    Returns [key, <one String column per run>], keys sorted.
    """
    if "key" in runs:
        raise ValueError("a run named 'key' collides with the key column; rename the run to compare it")
    configs = {run: flatten(store.run_config(run)) for run in runs}
    keys = sorted(set().union(*configs.values())) if configs else []
    if not all_keys:
        keys = [k for k in keys if len({configs[r].get(k) for r in runs}) > 1]
    data = {"key": keys} | {run: [configs[run].get(k) for k in keys] for run in runs}
    return pl.DataFrame(data, schema={"key": pl.String} | {run: pl.String for run in runs})


def metric_deltas(store: Store, runs: list[str], baseline: str, cap: float = 2.0, clip: float = 0.2,
                  steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Every per-run metric of `runs` next to the baseline run's, with the difference run − baseline.

    Metrics: `report.metrics_table(by="run")` (token metrics, plus token_any_flip_rate and
    flipped_layers_per_token when routing exists) and, with trainer routing, the run-level routing columns
    flip_rate, top1_flip_rate, overlap, load_max_vio_sampler, load_max_vio_trainer.
    Returns [metric, baseline, <run>... (runs other than the baseline, in order), <run>_delta...]; a run
    without tokens has null values. `steps` (inclusive range) restricts every metric to those steps.
    """
    everyone = _everyone(runs, baseline)
    table = metrics_table(store, everyone, by="run", cap=cap, clip=clip, steps=steps)
    return deltas_table(table, routing_rates(store, everyone, steps=steps), runs, baseline)


def routing_rates(store: Store, runs: list[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, flip_rate, top1_flip_rate, overlap, load_max_vio_sampler, load_max_vio_trainer] per run with
    trainer routing (`routing.routing_metrics(by="run")`); no rows when none of `runs` has it."""
    if not has_trainer_routing(store, runs):
        return pl.DataFrame(schema={"run": pl.String} | {m: pl.Float64 for m in ROUTING_RUN_METRICS})
    return routing_metrics(store, runs, by="run", steps=steps, token_flips=False).select("run", *ROUTING_RUN_METRICS)


def deltas_table(table: pl.DataFrame, rates: pl.DataFrame, runs: list[str], baseline: str) -> pl.DataFrame:
    """`metric_deltas`' pivot from its parts: `table` one row per run (token metrics, with or without the
    token flip columns, e.g. `dashboard.run_summary`), `rates` from `routing_rates`. Flip columns that are null
    for every run (no trainer routing) are left out, as are the routing rates when `rates` is empty."""
    everyone = _everyone(runs, baseline)
    table = table.drop([c for c in ("token_any_flip_rate", "flipped_layers_per_token")
                        if c in table.columns and table[c].null_count() == table.height])
    if not rates.is_empty():
        table = table.join(rates, on="run", how="left")
    metrics = [c for c in table.columns if c != "run"]
    values = {row["run"]: row for row in table.iter_rows(named=True)}

    def column(run: str) -> list[float | None]:
        row = values.get(run)
        return [None if row is None or row[m] is None else float(row[m]) for m in metrics]

    others = [r for r in everyone if r != baseline]
    base = column(baseline)
    data: dict[str, list] = {"metric": metrics, "baseline": base}
    for run in others:
        data[run] = column(run)
    for run in others:
        data[f"{run}_delta"] = [None if a is None or b is None else a - b for a, b in zip(data[run], base)]
    return pl.DataFrame(data, schema={"metric": pl.String} | {c: pl.Float64 for c in data if c != "metric"})


def _everyone(runs: list[str], baseline: str) -> list[str]:
    """The baseline first, then the other runs in order; refuses run names that would clash with columns."""
    everyone = list(dict.fromkeys([baseline, *runs]))
    reserved = {"metric", "baseline"} | {f"{r}_delta" for r in everyone}
    if clash := [r for r in everyone if r != baseline and r in reserved]:
        raise ValueError(f"run name(s) {', '.join(map(repr, clash))} collide with the table's own columns "
                         "(metric, baseline, <run>_delta); rename the run to compare it")
    return everyone
