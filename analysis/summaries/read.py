"""Read side: the tables the pages and the CLI show, from summary rows only (cost follows steps, not tokens)."""
from __future__ import annotations

from typing import Sequence

import polars as pl

from analysis.metrics import check_cap_clip, check_runs, run_filter
from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import schema as S


def token_table(store: Store, runs: Sequence[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                steps: tuple[int, int] | None = None, flips: bool = False) -> pl.DataFrame:
    """METRICS.md token columns per (run, step) or per run from summaries (`finalise.TOKEN_COLUMNS`, plus
    token_any_flip_rate and flipped_layers_per_token with flips=True: null without trainer routing).
    C and ε must be among schema.CAPS / schema.CLIPS (ValueError otherwise: see `metrics.token_metrics`
    for other values, from token rows)."""
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    check_cap_clip(cap, clip)
    if not F.summarised(cap, clip):
        raise ValueError(f"summaries answer C in {S.CAPS} and ε in {S.CLIPS}; got C={cap}, ε={clip}")
    where, params = run_filter(check_runs(runs), steps)
    keys = ["run", "step"] if by == "step" else ["run"]
    params |= F.threshold_params(cap, clip, S.D_EDGES)
    return store.sql(F.token_table_sql(keys, where, flips=flips), params)
