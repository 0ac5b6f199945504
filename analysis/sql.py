"""SQL fragments every analysis module shares: run and step filters, the clamp, the ratio r and the k3 term.

Only placeholders and column names are formatted into SQL here; run names and values travel as parameters.
"""
from __future__ import annotations

from typing import Sequence

from analysis.store import Store
from analysis.summaries.compute import clamp_sql
from analysis.summaries.schema import CLAMP


def check_runs(runs: Sequence[str] | str) -> list[str]:
    """`runs` as a list; a single string is accepted for convenience."""
    if isinstance(runs, str):
        return [runs]
    runs = list(runs)
    for r in runs:
        if not isinstance(r, str):
            raise TypeError(f"run names are strings, got {r!r}")
    return runs


def run_filter(runs: Sequence[str], steps: tuple[int, int] | None = None, alias: str = "",
               prefix: str = "", by_run: bool = True, only_steps: Sequence[int] | None = None) -> tuple[str, dict]:
    """A WHERE fragment selecting `runs` (and the inclusive step range) plus its named parameters.

    Only placeholders are formatted into the SQL; run names and steps travel as parameters.
    An IN-list of placeholders (rather than a list parameter) lets DuckDB push the filter into the scan.
    `by_run=False` leaves out the run predicate (for callers that know every run of the table is selected).
    `only_steps`: of those steps, only these (sampled.thin_steps on large selections).
    """
    a = f"{alias}." if alias else ""
    params: dict = {}
    if not runs:
        return "FALSE", params
    preds = []
    if by_run:
        names = []
        for i, r in enumerate(runs):
            params[f"{prefix}run{i}"] = r
            names.append(f"${prefix}run{i}")
        preds.append(f"{a}run IN ({', '.join(names)})")
    if steps is not None:
        lo, hi = steps
        if lo is not None:
            params[f"{prefix}step_lo"] = int(lo)
            preds.append(f"{a}step >= ${prefix}step_lo")
        if hi is not None:
            params[f"{prefix}step_hi"] = int(hi)
            preds.append(f"{a}step <= ${prefix}step_hi")
    if only_steps is not None:
        params[f"{prefix}only_steps"] = [int(x) for x in only_steps]
        preds.append(f"{a}step IN (SELECT unnest(${prefix}only_steps))")
    return " AND ".join(preds) or "TRUE", params


def check_cap_clip(cap: float, clip: float) -> None:
    if not cap > 1.0:
        raise ValueError(f"cap C must be > 1, got {cap}")
    if not clip > 0.0:
        raise ValueError(f"clip epsilon must be > 0, got {clip}")


def token_filter(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None,
                 alias: str = "", only_steps: Sequence[int] | None = None) -> tuple[str, dict]:
    """`run_filter` for the tokens table, without the run predicate when `runs` names every run of the
    database (the usual selection): comparing the VARCHAR run of every token cost 10-30% of a query.
    Exact because ingest records each run in `runs` in the same transaction as its tokens."""
    covers = bool(runs) and set(store.run_names()) <= set(runs)
    return run_filter(runs, steps, alias=alias, by_run=not covers, only_steps=only_steps)


def clamp_log_ratio_sql(d: str = "d") -> str:
    """SQL for clamp(Δ, −CLAMP, CLAMP) given the SQL of Δ (or of a sum of Δ)."""
    return clamp_sql(d, f"-{CLAMP}::DOUBLE", f"{CLAMP}::DOUBLE")


def ratio_sql(d: str = "d") -> str:
    """SQL for r = exp(clamp(Δ, −20, 20)) given the SQL of Δ."""
    return f"exp({clamp_log_ratio_sql(d)})"


def kl3_sql(r: str = "r", d: str = "d") -> str:
    """SQL for one token's k3 term r − 1 − Δ. It is ≥ 0 exactly (e^Δ ≥ 1 + Δ), but rounding makes it about
    −1e-17 when |Δ| is tiny (exp rounds to 1); such values are set to 0 so that kl_k3 keeps its sign.
    (The summaries and the token tables use the stabler `k3` column of summaries.compute.token_terms_sql.)"""
    return f"(CASE WHEN {r} - 1.0 - {d} > 0 THEN {r} - 1.0 - {d} ELSE 0.0 END)"
