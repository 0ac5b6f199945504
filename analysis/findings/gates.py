"""The published bands and CI gates of docs/DIAGNOSIS.md ("Published bands and gates"), checked per run.

Each band names the metric it reads, its rule, how serious breaking it is (a framework's CI gate or a
"severe" band: alert; a documented warning band: warn) and its source, so a user can judge the threshold.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import polars as pl

PRIME_RL_STEPS = 20  # prime-rl: mean mismatch KL over 20 steps


@dataclass(frozen=True)
class Band:
    gate: str        # short id
    metric: str      # a column of the run summary (kl_k3_first_20_steps: see run_values)
    rule: str        # "lt", "le", "ge", "in", "abs_le"
    threshold: tuple[float, ...]
    severity: str    # of breaking it: "warn" | "alert"
    source: str
    framework: str

    def text(self) -> str:
        t = self.threshold
        if self.rule == "in":
            return f"in [{t[0]:g}, {t[1]:g}]"
        return {"lt": f"< {t[0]:g}", "le": f"≤ {t[0]:g}", "ge": f"≥ {t[0]:g}", "abs_le": f"|·| ≤ {t[0]:g}"}[self.rule]

    def passes(self, v: float) -> bool:
        t = self.threshold
        if self.rule == "in":
            return t[0] <= v <= t[1]
        return {"lt": v < t[0], "le": v <= t[0], "ge": v >= t[0], "abs_le": abs(v) <= t[0]}[self.rule]


VERL = "verl docs/algo/rollout_corr.md"
BANDS: tuple[Band, ...] = (
    Band("prime-rl mismatch KL", "kl_k3_first_20_steps", "lt", (0.015,), "alert", "prime-rl docs/development.md",
         "prime-rl"),
    Band("NeMo mult_prob_error 1.05", "mult_prob_error", "lt", (1.05,), "warn",
         "NeMo RL test suites, docs/adding-new-models.md", "NeMo RL"),
    Band("NeMo mult_prob_error 1.1", "mult_prob_error", "lt", (1.1,), "alert", "NeMo RL test suites (CI gate)",
         "NeMo RL"),
    Band("NeMo gen_kl", "kl_k3", "lt", (1e-3,), "warn", "NeMo RL docs/guides/grpo.md (< 1e-3 acceptable)", "NeMo RL"),
    Band("slime log_ratio_abs_mean", "log_ratio_abs_mean", "le", (0.1,), "alert", "slime CI", "slime"),
    Band("verl IS weight mean", "ratio_mean", "in", (0.5, 2.0), "warn", VERL, "verl"),
    Band("verl IS weight std", "ratio_std", "le", (1.0,), "warn", VERL, "verl"),
    Band("verl ESS", "ess", "ge", (0.3,), "warn", VERL, "verl"),
    Band("verl |kl_k1|", "kl_k1", "abs_le", (0.1,), "warn", VERL, "verl"),
    Band("verl chi2_token", "chi2_token", "le", (1.0,), "alert", VERL + " (> 1: severe distribution shift)", "verl"),
)


def run_values(run_row: dict, steps_of_run: pl.DataFrame) -> dict[str, float | None]:
    """The values the bands read for one run: its summary row, plus kl_k3_first_20_steps = the mean of the
    per-step kl_k3 over the first 20 steps (all of them when fewer), and the number of those steps."""
    first = steps_of_run.sort("step").head(PRIME_RL_STEPS)
    out = dict(run_row)
    out["kl_k3_first_20_steps"] = float(first["kl_k3"].mean()) if first.height else None
    out["n_gate_steps"] = first.height
    return out


def gate_table(summary: pl.DataFrame, per_step: pl.DataFrame, runs: Sequence[str]) -> pl.DataFrame:
    """Pass/fail of every band per run, from `dashboard.run_and_step_tables`' run and step frames.

    Returns [run, framework, gate, metric, value, band, passed, severity, source]; a band whose metric is null
    (e.g. one token) gives passed = null.
    """
    rows = []
    for run in runs:
        srow = summary.filter(pl.col("run") == run)
        if srow.is_empty():
            continue
        values = run_values(srow.row(0, named=True), per_step.filter(pl.col("run") == run))
        for b in BANDS:
            v = values.get(b.metric)
            metric = b.metric if b.metric != "kl_k3_first_20_steps" else \
                f"mean kl_k3 over the first {values['n_gate_steps']} steps"
            rows.append({"run": run, "framework": b.framework, "gate": b.gate, "metric": metric,
                         "value": None if v is None else float(v), "band": b.text(),
                         "passed": None if v is None else b.passes(float(v)),
                         "severity": b.severity, "source": b.source})
    schema = {"run": pl.String, "framework": pl.String, "gate": pl.String, "metric": pl.String, "value": pl.Float64,
              "band": pl.String, "passed": pl.Boolean, "severity": pl.String, "source": pl.String}
    return pl.DataFrame(rows, schema=schema)
