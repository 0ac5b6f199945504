"""Small combinations of the analysis functions that the dashboard pages show together.

Pure like the rest of analysis/: a Store and parameters in, polars out; no SQL of its own and no formula
beyond a display smoothing (a trailing moving average).
"""
from __future__ import annotations

import json
from typing import Sequence

import polars as pl

from analysis.metrics.read import token_table
from analysis.run_names import run_name_slug
from analysis.store import Store


def routing_kinds(store: Store, runs: Sequence[str]) -> dict[str, str]:
    """{run: "both" | "sampler" | "none"}: which sides of MoE routing a run recorded (runs that do not
    exist are left out)."""
    sides = store.routing_sides()
    known = set(store.run_names())
    return {run: ("both" if sides[run] else "sampler") if run in sides else "none" for run in runs if run in known}


FULL_DISTRIBUTION = ("kl_k3", "topk_overlap", "top1_agree", "topk_kl_shared", "topk_tv_lower", "topk_tv_upper")


def full_distribution(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per (run, step) of the runs that logged top-k log-probs of both sides: the sampled-token kl_k3 beside the
    full-distribution columns (METRICS.md v3), from the summaries; no rows for runs (and steps) without top-k.
    Returns [run, step, kl_k3, topk_overlap, top1_agree, topk_kl_shared, topk_tv_lower, topk_tv_upper]."""
    df = token_table(store, list(runs), by="step", steps=steps)
    return df.filter(pl.col("topk_overlap").is_not_null()).select("run", "step", *FULL_DISTRIBUTION)


def routing_weight_runs(store: Store, runs: Sequence[str]) -> list[str]:
    """The runs (of `runs`) whose summaries hold routing-weight sums: both sides' combine weights were logged."""
    if not store.has_weight_sums:
        return []
    have = {r for (r,) in store.rows("SELECT DISTINCT run FROM summary_layer WHERE n_weight_rows > 0 "
                                     "AND list_contains(?, run)", [list(runs)])}
    return [r for r in runs if r in have]


def run_summary(store: Store, runs: Sequence[str], cap: float = 2.0, clip: float = 0.2,
                steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """One row per run: the METRICS.md token columns plus token_any_flip_rate and flipped_layers_per_token
    (null for runs without the trainer's routing), from the summaries."""
    return token_table(store, list(runs), by="run", cap=cap, clip=clip, steps=steps, flips=True)


def step_metrics(store: Store, runs: Sequence[str], cap: float = 2.0, clip: float = 0.2,
                 steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """The per-step token columns plus the per-step flip columns (null where the trainer's routing is missing)."""
    return token_table(store, list(runs), by="step", cap=cap, clip=clip, steps=steps, flips=True)


def run_and_step_tables(store: Store, runs: Sequence[str], cap: float = 2.0, clip: float = 0.2,
                        steps: tuple[int, int] | None = None) -> dict[str, pl.DataFrame]:
    """{"run": run_summary(...), "step": step_metrics(...)}: what the Overview and Compare pages show."""
    return {"run": run_summary(store, runs, cap, clip, steps), "step": step_metrics(store, runs, cap, clip, steps)}


def smooth(df: pl.DataFrame, columns: Sequence[str], window: int, by: str = "run",
           order: str = "step") -> pl.DataFrame:
    """Trailing moving average of `columns` over `window` rows per `by` group (window 1: unchanged).

    >>> smooth(pl.DataFrame({"run": ["a"] * 3, "step": [0, 1, 2], "x": [0.0, 2.0, 4.0]}), ["x"], 2)["x"].to_list()
    [0.0, 1.0, 3.0]
    """
    if window <= 1 or df.is_empty():
        return df
    cols = [c for c in columns if c in df.columns]
    return df.sort(by, order).with_columns(
        pl.col(c).rolling_mean(window, min_samples=1).over(by) for c in cols)


def run_values(deltas: pl.DataFrame, runs: Sequence[str]) -> pl.DataFrame:
    """compare.metric_deltas' table ([metric, baseline, <run>..., <run>_delta]) turned to one row per run and
    one column per metric (the runs' own values, not the deltas): charts reuse it instead of a second query.

    >>> d = pl.DataFrame({"metric": ["kl_k3"], "baseline": [0.1], "b": [0.3], "b_delta": [0.2]})
    >>> run_values(d, ["a", "b"]).rows()
    [('a', 0.1), ('b', 0.3)]
    """
    if deltas.is_empty():
        return pl.DataFrame({"run": list(runs)})
    metrics_ = deltas["metric"].to_list()
    rows = []
    for i, run in enumerate(runs):
        col = "baseline" if i == 0 else run
        rows.append([run] + deltas[col].cast(pl.Float64).to_list())
    return pl.DataFrame(rows, schema=["run"] + metrics_, orient="row")


def parse_config(text: str) -> dict:
    """A run's config from the user's JSON text; ValueError says what is wrong and where."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object like {{\"sampler_dtype\": \"bf16\"}}, got {type(value).__name__}")
    return value


def config_text(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True)


def unique_run_name(existing: Sequence[str], base: str) -> str:
    """`base`, or `base-2`, `base-3`, … : the first name not in `existing`."""
    base = run_name_slug(base)
    taken = set(existing)
    if base not in taken:
        return base
    n = 2
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"
