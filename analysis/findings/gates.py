"""The published bands and CI gates of docs/DIAGNOSIS.md ("Published bands and gates"), checked per run.

Each band names the metric it reads, its rule, how serious breaking it is (a framework's CI gate or a
"severe" band: alert; a documented warning band: warn) and its source, so a user can judge the threshold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import polars as pl

from analysis.summaries import schema as S

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


# -- corridors around trusted baseline runs -----------------------------------------------------------------------
# miles gates each CI metric on its own history: value within [ref − max(rel_down·|ref|, floor_down),
# ref + max(rel_up·|ref|, floor_up)], ref the mean of the trusted earlier values, the bands scaled from the
# reference only (so a deviating value cannot widen its own tolerance), NaN an error, no history: inactive.
# radixark/miles tests/ci/metric_history/constraints.py:50-54, gate.py:206-210, defaults register.py:96-106
# (train_rollout_logprob_abs_diff, train_rollout_kl) at commit 31f1ca961a94cb860cec3b2dea34ec332bfa8f76.
# Our own code below; a run's value is compared with the mean of the baseline runs' values.

@dataclass(frozen=True)
class Corridor:
    rel_up: float = 0.5
    rel_down: float = 0.8
    floor: float = 0.02

    def __post_init__(self):
        for name in ("rel_up", "rel_down", "floor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"corridor {name}: expected a finite number >= 0, got {v!r}")

    def bounds(self, ref: float) -> tuple[float, float]:
        return ref - max(self.rel_down * abs(ref), self.floor), ref + max(self.rel_up * abs(ref), self.floor)

    def text(self) -> str:
        return f"ref − max({self.rel_down:g}·|ref|, {self.floor:g}) … ref + max({self.rel_up:g}·|ref|, {self.floor:g})"


def parse_corridor(params: Sequence[str]) -> Corridor:
    """['rel_up=0.3', 'floor=0.01', ...] -> Corridor (the others at their defaults); ValueError naming the bad one."""
    values: dict[str, float] = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep or key not in ("rel_up", "rel_down", "floor"):
            raise ValueError(f"--corridor {p!r}: expected rel_up=X, rel_down=X or floor=X")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--corridor {p!r}: {value!r} is not a number") from None
    return Corridor(**values)


# The run metrics gated against a baseline: the mismatch KL and log-prob differences miles gates (and their maxima),
# the NeMo error, and the routing flip rate where both sides of routing were logged.
CORRIDOR_METRICS = ("kl_k3", "kl_k1", "log_ratio_abs_mean", "log_ratio_abs_max", "mult_prob_error", "chi2_token",
                    "ratio_min", "ratio_max", "token_any_flip_rate")
# Max-type gates (a maximum or minimum over tokens): which tokens stand behind a value beyond the corridor.
#   abs: |Δ| > x;  high: Δ > ln x;  low: Δ < ln x   (x the corridor edge the value crossed)
MAX_TYPE = {"log_ratio_abs_max": "abs", "ratio_max": "high", "ratio_min": "low"}


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def corridor_table(summary: pl.DataFrame, runs: Sequence[str], baselines: Sequence[str],
                   corridor: Corridor = Corridor(), metrics: Sequence[str] = CORRIDOR_METRICS) -> pl.DataFrame:
    """Each run's metric against the corridor around the baseline runs' mean, from a run summary frame holding
    every run and baseline. status: pass | fail | error (the run's value or a baseline's is NaN/inf, or the run
    lacks a value the baselines have) | inactive (no baseline value). Returns [run, metric, value, ref,
    n_baseline, lo, hi, status, passed, detail]."""
    rows = []
    by_run = {r["run"]: r for r in summary.iter_rows(named=True)}
    for run in runs:
        if run not in by_run:
            continue
        for m in metrics:
            if m not in summary.columns:
                continue
            mine = [b for b in baselines if b in by_run and b != run]  # a run is no baseline of itself
            base = [by_run[b][m] for b in mine if by_run[b][m] is not None]
            v = by_run[run][m]
            row = {"run": run, "metric": m, "value": v if _finite(v) else None, "ref": None,
                   "n_baseline": len(base), "lo": None, "hi": None, "status": "inactive", "passed": None,
                   "detail": "no baseline value (cold start)"}
            if base:
                bad = [b for b in mine if by_run[b][m] is not None and not _finite(by_run[b][m])]
                if bad:
                    row.update(status="error", detail=f"baseline {bad[0]} has {m} = {by_run[bad[0]][m]}")
                elif not _finite(v):
                    row.update(status="error", detail=f"{m} is {'missing' if v is None else v} in this run")
                else:
                    ref = sum(base) / len(base)
                    lo, hi = corridor.bounds(ref)
                    ok = lo <= v <= hi
                    row.update(ref=ref, lo=lo, hi=hi, status="pass" if ok else "fail", passed=ok,
                               detail=f"{v:.4g} {'within' if ok else 'outside'} [{lo:.4g}, {hi:.4g}] around the "
                                      f"mean {ref:.4g} of {len(base)} baseline run{'s' if len(base) > 1 else ''}")
            rows.append(row)
    schema = {"run": pl.String, "metric": pl.String, "value": pl.Float64, "ref": pl.Float64, "n_baseline": pl.Int64,
              "lo": pl.Float64, "hi": pl.Float64, "status": pl.String, "passed": pl.Boolean, "detail": pl.String}
    return pl.DataFrame(rows, schema=schema)


def delta_bin_counts(store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, bin, n]: every token's Δ in the fine bins of the summaries (summaries/schema.py, D_EDGES)."""
    from analysis.summaries.sql import run_filter
    where, params = run_filter(list(runs), steps)
    return store.sql(f"SELECT run, bin, sum(n_tokens)::BIGINT AS n FROM summary_hist WHERE {where} GROUP BY ALL",
                     params)


def _bin_bounds(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each fine bin's lowest and highest Δ (bin 2k: the open interval (E[k−1], E[k]); 2k+1: E[k] itself)."""
    edges = np.concatenate([[-np.inf], np.asarray(S.D_EDGES, dtype=np.float64), [np.inf]])
    k = bins // 2
    odd = bins % 2 == 1
    lo = np.where(odd, edges[k + 1], edges[k])
    hi = edges[k + 1]
    return lo, hi


def tokens_beyond(counts: pl.DataFrame, kind: str, x: float) -> tuple[int, int, int]:
    """(at least, at most, of all) tokens beyond the edge x of a max-type gate (MAX_TYPE kind), from fine Δ bin
    counts [bin, n]: a bin wholly beyond counts in both, a bin that straddles x only in the second."""
    if counts.is_empty():
        return 0, 0, 0
    b, n = counts["bin"].to_numpy().astype(np.int64), counts["n"].to_numpy().astype(np.int64)
    lo, hi = _bin_bounds(b)
    total = int(n.sum())
    if kind == "abs":  # |Δ| > x: Δ > x or Δ < −x
        sure = (lo > x) | ((lo == x) & (b % 2 == 0)) | (hi < -x) | ((hi == -x) & (b % 2 == 0))
        maybe = (hi > x) | (lo < -x)
    elif kind == "high":  # ratio above x: Δ > ln x
        t = math.log(x) if x > 0 else -math.inf
        sure = (lo > t) | ((lo == t) & (b % 2 == 0))
        maybe = hi > t
    elif kind == "low":  # ratio below x: Δ < ln x (none when x <= 0)
        if x <= 0:
            return 0, 0, total
        t = math.log(x)
        sure = (hi < t) | ((hi == t) & (b % 2 == 0))
        maybe = lo < t
    else:
        raise ValueError(f"max-type kind: abs, high or low, got {kind!r}")
    return int(n[sure].sum()), int(n[maybe | sure].sum()), total


def with_token_shares(table: pl.DataFrame, counts: pl.DataFrame) -> pl.DataFrame:
    """corridor_table's rows of max-type metrics get the tokens beyond the edge they crossed (hi for a value above
    the corridor, lo below; none for a value inside): n_beyond_min/max (a bound from the fine Δ bins: equal unless
    a bin straddles the edge), n_tokens, share_beyond = n_beyond_max / n_tokens. Other rows: null."""
    out = []
    for r in table.iter_rows(named=True):
        r = dict(r, n_beyond_min=None, n_beyond_max=None, n_tokens=None, share_beyond=None)
        kind = MAX_TYPE.get(r["metric"])
        if kind is not None and r["status"] in ("pass", "fail"):
            v = r["value"]
            if v > r["hi"]:
                edge, side = r["hi"], kind if kind != "low" else None
            elif v < r["lo"]:
                edge, side = r["lo"], kind if kind == "low" else None
            else:
                edge, side = None, None
            mine = counts.filter(pl.col("run") == r["run"])
            total = int(mine["n"].sum()) if mine.height else 0
            a = b = 0
            if side is not None:
                a, b, total = tokens_beyond(mine, side, edge)
            r.update(n_beyond_min=a, n_beyond_max=b, n_tokens=total, share_beyond=b / total if total else None)
        out.append(r)
    schema = dict(table.schema) | {"n_beyond_min": pl.Int64, "n_beyond_max": pl.Int64, "n_tokens": pl.Int64,
                                   "share_beyond": pl.Float64}
    return pl.DataFrame(out, schema=schema)


def corridor_gates(store, runs: Sequence[str], baselines: Sequence[str], corridor: Corridor = Corridor(),
                   steps: tuple[int, int] | None = None, cap: float = 2.0, clip: float = 0.2) -> pl.DataFrame:
    """corridor_table + with_token_shares for `runs` against `baselines` (both read from the summaries)."""
    from analysis.metrics import dashboard
    summary = dashboard.run_summary(store, list(dict.fromkeys([*runs, *baselines])), cap=cap, clip=clip, steps=steps)
    table = corridor_table(summary, runs, baselines, corridor)
    return with_token_shares(table, delta_bin_counts(store, runs, steps))


# -- "normal for this configuration" -------------------------------------------------------------------------------
CONFIG_KEYS = ("model", "engine", "dtype", "sampler_dtype", "trainer_dtype")  # what makes two runs comparable
BAND_METRICS = ("kl_k3", "log_ratio_abs_mean", "log_ratio_abs_max", "mult_prob_error", "token_any_flip_rate")
MIN_PEERS = 3  # fewer runs of a configuration make no band


def config_key(config: dict | None) -> tuple | None:
    """The values of CONFIG_KEYS in a run's config (strings as given; a missing key is None), or None when the
    config has none of them or is a rerun paired with another run (pair_of): such runs are compared with nothing."""
    config = config or {}
    if config.get("pair_of") is not None:  # a trainer-vs-trainer rerun (ingest --pair-of) is no run of the config
        return None
    key = tuple(None if config.get(k) is None else str(config.get(k)) for k in CONFIG_KEYS)
    return None if all(v is None for v in key) else key


def normal_band(summary: pl.DataFrame, configs: dict[str, dict], runs: Sequence[str],
                metrics: Sequence[str] = BAND_METRICS) -> pl.DataFrame:
    """Per run and metric: the distribution of the metric over the *other* runs with the same config_key (its
    peers): n_peers, min, median, max, and where the run's value lies: below / within / above [min, max], or
    null with fewer than MIN_PEERS peers holding a value. Returns [run, metric, value, config, n_peers, peer_min,
    peer_median, peer_max, position]."""
    keys = {r: config_key(configs.get(r)) for r in summary["run"].to_list()}
    by_run = {r["run"]: r for r in summary.iter_rows(named=True)}
    rows = []
    for run in runs:
        key = keys.get(run)
        if key is None:
            continue
        peers = [p for p, k in keys.items() if k == key and p != run]
        label = ", ".join(f"{n}={v}" for n, v in zip(CONFIG_KEYS, key) if v is not None)
        for m in metrics:
            if m not in summary.columns:
                continue
            vals = sorted(by_run[p][m] for p in peers if _finite(by_run[p][m]))
            v = by_run[run][m]
            if not vals and not _finite(v):  # a metric nobody here has (routing flips of runs without routing)
                continue
            pos = None
            if len(vals) >= MIN_PEERS and _finite(v):
                pos = "below" if v < vals[0] else "above" if v > vals[-1] else "within"
            rows.append({"run": run, "metric": m, "value": v if _finite(v) else None, "config": label,
                         "n_peers": len(vals), "peer_min": vals[0] if vals else None,
                         "peer_median": float(np.median(vals)) if vals else None,
                         "peer_max": vals[-1] if vals else None, "position": pos})
    schema = {"run": pl.String, "metric": pl.String, "value": pl.Float64, "config": pl.String, "n_peers": pl.Int64,
              "peer_min": pl.Float64, "peer_median": pl.Float64, "peer_max": pl.Float64, "position": pl.String}
    return pl.DataFrame(rows, schema=schema)


def config_bands(store, runs: Sequence[str], steps: tuple[int, int] | None = None, cap: float = 2.0,
                 clip: float = 0.2) -> pl.DataFrame:
    """normal_band for `runs` over every run of the database (their configs from the runs table)."""
    from analysis.metrics import dashboard
    every = store.run_names()
    configs = {r: store.run_config(r) for r in every}
    wanted = {r for r in every if config_key(configs[r]) is not None and config_key(configs[r]) in
              {config_key(configs.get(x)) for x in runs}}
    if not wanted:
        return normal_band(pl.DataFrame({"run": []}, schema={"run": pl.String}), {}, [])
    summary = dashboard.run_summary(store, sorted(wanted | set(runs)), cap=cap, clip=clip, steps=steps)
    return normal_band(summary, configs, runs)
