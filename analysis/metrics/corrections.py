"""What each off-policy correction of METRICS.md (Corrections) would do to the logged tokens.

A correction reweights or masks tokens and sequences by the importance ratio r = exp(clamp(Δ, −20, 20)),
Δ = t − s. Applied to what was logged, each method's rule tells per step and per run how many tokens and
sequences it would have thrown away, how the weights of what it keeps spread (ESS), and, where the trainer logged
rewards and advantages (table `sequences`), whether what it throws away was good data.

Two passes, both in DuckDB: per sequence, the partial sums a group needs; per group (step or run), sums of those
partials. The per-sequence pass reads the per-sequence summaries (analysis/summaries/corrections.py: every token,
cost following sequences rather than tokens) except for tis and for icepop thresholds off the summaries' ratio
bands (`reads_tokens`), which read the token rows.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import polars as pl

from analysis.metrics import quantiles, sampled
from analysis.store import Store
from analysis.summaries import corrections as seq_summaries
from analysis.summaries.schema import BAND_EDGES, CAPS, CLAMP, CLIPS
from analysis.summaries.sql import check_runs, clamp_log_ratio_sql, clamp_sql, run_filter, token_filter

ESS_CAP = 2.0  # C of the ESS weight clamp(r, 1/C, C) for the masking methods (METRICS.md: ess_after)


@dataclass(frozen=True)
class Method:
    name: str
    defaults: dict[str, float]   # parameter -> default, in the order METRICS.md lists them
    rule: str                    # what it does, in words
    source: str                  # where the method comes from


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("tis", {"C": 2.0, "lo": 0.0}, "weight w = clamp(r, lo, C) (min(r, C) for lo = 0); masks nothing",
           "verl token TIS, slime --use-tis (lo: slime --tis-clip-low, NeMo truncated_importance_sampling_ratio_min)"),
    Method("icepop", {"alpha": 0.5, "beta": 5.0}, "masks a token with r < alpha or r > beta",
           "IcePop (Ring-1T), NeMo icepop"),
    Method("geo_rs", {"lo": 0.999, "hi": 1.001}, "masks a sequence whose exp(mean Δ) is outside [lo, hi]",
           "verl seq_mean_k1 rejection"),
    Method("seq_rs", {"lo": 0.5, "hi": 2.0}, "masks a sequence whose exp(clamp(ΣΔ, −20, 20)) is outside [lo, hi]",
           "verl sequence rejection seq_sum_k1"),
    Method("veto", {"tau": 1e-4}, "masks a sequence with any token r < tau",
           "slime --rs-veto-threshold, verl veto"),
)}

# verl's current rejection (verl/trainer/ppo/rollout_corr_helper.py:156-372@b178a3cd): its parameters are text
# (option names chained with commas, thresholds "lo_hi" or "hi"), so it is offered by the command line and the API,
# not among METHODS (the simulator page's number inputs); always from token rows
TEXT_METHODS: dict[str, Method] = {"verl_rs": Method(
    "verl_rs", {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"},
    "masks a token, or a whole sequence, that any of the chained verl rejection options rejects",
    "verl rollout_rs / rollout_rs_threshold (b178a3cd): token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, "
    "seq_max_k2|k3")}
SEQ_EPS = 1e-8  # verl's masked_mean divides by (count + 1e-8) (verl/utils/torch_functional.py:301@b178a3cd)

COLUMNS = ("method", "params", "run", "step", "n_tokens", "n_sequences", "masked_token_frac", "masked_seq_frac",
           "weight_mean", "ess_after", "masked_reward_mean", "kept_reward_mean", "masked_adv_pos_frac",
           "masked_adv_neg_frac")


def resolve_params(method: str, params: Mapping[str, float] | None = None) -> dict[str, float]:
    """The method's parameters: its defaults overridden by `params`. ValueError names an unknown method or
    parameter, and a value that breaks the method's rule (bands must be positive and ordered)."""
    if method in TEXT_METHODS:
        return _resolve_text(method, params)
    if method not in METHODS:
        raise ValueError(f"unknown correction method {method!r}; expected one of "
                         f"{', '.join([*METHODS, *TEXT_METHODS])}")
    m = METHODS[method]
    out = dict(m.defaults)
    for key, value in (params or {}).items():
        if key not in out:
            raise ValueError(f"{method} has no parameter {key!r}; its parameters are "
                             f"{', '.join(f'{k} (default {v:g})' for k, v in m.defaults.items())}")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{method} parameter {key!r} must be a number, got {value!r}") from None
    if not all(v > 0 or (method, k) == ("tis", "lo") and v == 0 for k, v in out.items()):
        raise ValueError(f"{method}: every parameter must be > 0 (tis lo ≥ 0), got {out}")
    if method == "tis" and not out["lo"] <= out["C"]:
        raise ValueError(f"tis: lo must be <= C, got lo={out['lo']:g}, C={out['C']:g}")
    if method == "icepop" and not out["alpha"] < out["beta"]:
        raise ValueError(f"icepop: alpha must be < beta, got alpha={out['alpha']:g}, beta={out['beta']:g}")
    if method in ("geo_rs", "seq_rs") and not out["lo"] <= out["hi"]:
        raise ValueError(f"{method}: lo must be <= hi, got lo={out['lo']:g}, hi={out['hi']:g}")
    return out


def _resolve_text(method: str, params) -> dict:
    """verl_rs's parameters, checked as verl parses them (analysis.metrics.frameworks.verl.parse_rs)."""
    from analysis.metrics.frameworks.verl import parse_rs
    out = dict(TEXT_METHODS[method].defaults)
    for key, value in (params or {}).items():
        if key not in out:
            raise ValueError(f"{method} has no parameter {key!r}; its parameters are "
                             f"{', '.join(f'{k} (default {v})' for k, v in out.items())}")
        out[key] = str(value).strip()
    parse_rs(out["rollout_rs"], out["rollout_rs_threshold"])
    return out


def verl_options(values: Mapping) -> list[tuple[str, float, float]]:
    """[(option, low, up)] of verl_rs: the bounds its statistic is compared with (ln of the ratio bounds for k1
    options, RC:259-260, 335-336@b178a3cd; (0, upper) otherwise)."""
    from analysis.metrics.frameworks.verl import parse_rs
    out = []
    for option, lower, upper in parse_rs(values["rollout_rs"], values["rollout_rs_threshold"]):
        out.append((option, math.log(lower), math.log(upper)) if option.endswith("k1") else (option, 0.0, upper))
    return out


def _verl_rules(p: str, values: Mapping) -> tuple[str, str]:
    """verl_rs's (token rule over cd, sequence rule over the per-sequence sums of `_VERL_AGGREGATES`): each option
    keeps low ≤ x ≤ up for k1 and x ≤ up otherwise (RC:271-331); a token is masked when any option rejects it
    or its sequence (RC:339, 365)."""
    terms = {"k1": "(-cd)", "k2": "(0.5 * cd * cd)", "k3": "(exp(cd) - 1.0 - cd)"}
    tok, seq = [], []
    for j, (option, _, _) in enumerate(verl_options(values)):
        kind, k = option.rsplit("_", 1)
        x = terms[k] if kind == "token" else {
            "seq_sum": f"s_{k}", "seq_mean": f"(s_{k} / (n_tok + {SEQ_EPS}))", "seq_max": f"x_{k}"}[kind]
        fail = f"({x} > ${p}o{j}_up" + (f" OR {x} < ${p}o{j}_low)" if k == "k1" else ")")
        (tok if kind == "token" else seq).append(fail)
    return " OR ".join(tok) or "FALSE", " OR ".join(seq) or "FALSE"


# per-sequence sums verl_rs's sequence options read, over cd = clamp(Δ, ±20) (RC:221-224, 232-243)
_VERL_AGGREGATES = ("sum(-cd) AS s_k1, sum(0.5 * cd * cd) AS s_k2, sum(exp(cd) - 1.0 - cd) AS s_k3, "
                    "max(0.5 * cd * cd) AS x_k2, max(exp(cd) - 1.0 - cd) AS x_k3")


def parse_param_args(items: Sequence[str]) -> dict[str, float]:
    """`--param K=V` strings as a dict (values as given; `resolve_params` checks them)."""
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param takes K=V (e.g. --param alpha=0.5), got {item!r}")
        out[key.strip()] = value.strip()  # type: ignore[assignment]
    return out


def log_threshold(x: float) -> float:
    """ln x as the rules compare it: the band edge of the summaries (schema.BAND_EDGES) when ln x is one up to
    rounding (rel 1e-12: ln 0.8 and log1p(−0.2) differ in the last bit, ln 1.1 and log1p(0.1) in the last three),
    else math.log(x). Token rows and summaries compare Δ with the same number, so both give the same masks."""
    lx = math.log(x)
    for edge in BAND_EDGES:
        if math.isclose(edge, lx, rel_tol=1e-12, abs_tol=0.0):
            return edge
    return lx


def reads_tokens(method: str, params: Mapping[str, float] | None = None) -> bool:
    """Whether the method with these parameters needs token rows: tis (its weights min(r, C) are not clamped
    below, and Σ w² from band sums would cancel where r ≪ 1: analysis/summaries/corrections.py), and icepop with
    alpha or beta whose ln lies strictly inside the clamp and off the summaries' band edges. Sequence rules never
    do."""
    p = resolve_params(method, params)
    if method in ("tis", "verl_rs"):
        return True
    bounds = ("alpha", "beta") if method == "icepop" else ()
    return any(-CLAMP < log_threshold(p[k]) < CLAMP and log_threshold(p[k]) not in BAND_EDGES for k in bounds)


def _rules(method: str, p: str, values: Mapping | None = None) -> tuple[str, str]:
    """(token rule, sequence rule) as SQL, parameters named `$<p><name>`: a token is masked by the token rule
    over its clamped log-ratio cd (icepop: r < alpha ⟺ cd < ln alpha, compared in log space as the summaries
    do); a sequence by the sequence rule over its aggregates sum_d, mean_d, min_r."""
    if method == "icepop":
        return f"(cd < ${p}ln_alpha OR cd > ${p}ln_beta)", "FALSE"
    if method == "geo_rs":
        return "FALSE", f"(exp(mean_d) < ${p}lo OR exp(mean_d) > ${p}hi)"
    if method == "seq_rs":
        seq_ratio = f"exp({clamp_log_ratio_sql('sum_d')})"
        return "FALSE", f"({seq_ratio} < ${p}lo OR {seq_ratio} > ${p}hi)"
    if method == "veto":
        return "FALSE", f"(min_r < ${p}tau)"
    if method == "verl_rs":
        return _verl_rules(p, values)
    return "FALSE", "FALSE"  # tis


def _rule_params(i: int, method: str, values: Mapping[str, float], src: str) -> dict:
    """The query parameters of choice i's rules (`$m<i>_<name>`) on token rows or on summaries, the ones its SQL
    names and no others (DuckDB refuses a parameter the query does not use)."""
    if method == "verl_rs":   # the bounds `_verl_rules` names: low for k1 options only
        out = {}
        for j, (option, low, up) in enumerate(verl_options(values)):
            out[f"m{i}_o{j}_up"] = up
            if option.endswith("k1"):
                out[f"m{i}_o{j}_low"] = low
        return out
    if method == "icepop":
        if src == "summaries":
            return seq_summaries.icepop_params(i, values, log_threshold)
        return {f"m{i}_ln_alpha": log_threshold(values["alpha"]), f"m{i}_ln_beta": log_threshold(values["beta"])}
    return {f"m{i}_{k}": v for k, v in values.items()}


def _union_sql(methods: Sequence[str], values: Sequence[Mapping] | None = None) -> str:
    """Per (method index m, sequence) from `seq` (one row per sequence with sum_d, mean_d, min_r, n_tok and, per
    method i, n_tok_masked<i>, sum_weight<i>, n_kept<i>, sw<i>, sw2<i> over its tokens under the token rule):
    the sequence rule applied on top (a masked sequence masks all its tokens and keeps none)."""
    rows = []
    for i, method in enumerate(methods):
        seq_rule = _rules(method, f"m{i}_", values[i] if values else None)[1]
        rows.append(f"""SELECT {i} AS m, run, step, sample, n_tok,
               CASE WHEN {seq_rule} THEN n_tok ELSE n_tok_masked{i} END AS n_masked,
               CASE WHEN {seq_rule} THEN 0.0 ELSE sum_weight{i} END AS sum_weight,
               CASE WHEN {seq_rule} THEN 0 ELSE n_kept{i} END AS n_kept,
               CASE WHEN {seq_rule} THEN 0.0 ELSE sw{i} END AS sw,
               CASE WHEN {seq_rule} THEN 0.0 ELSE sw2{i} END AS sw2
        FROM seq""")
    return "\n        UNION ALL ".join(rows)


def _sequence_partials_sql(methods: Sequence[str], where: str, values: Sequence[Mapping] | None = None) -> str:
    """Per (method index m, sequence): counts and sums of the sequence's tokens under method m's rule, for every
    method from one pass over the token rows.

    w_ess is the ESS weight of a kept token (clamp(r, lo, C) for tis, clamp(r, 1/C, C) with C = 2 otherwise); weight
    is the correction's weight (clamp(r, lo, C) for tis, r for kept tokens of the masking methods)."""
    masks, seq_cols = [], []
    for i, method in enumerate(methods):
        token_rule = _rules(method, f"m{i}_", values[i] if values else None)[0]
        if method == "tis":
            w_ess = weight = f"greatest(least(r, $m{i}_C), $m{i}_lo)"
        else:
            w_ess, weight = clamp_sql("r", f"1.0 / {ESS_CAP}", str(ESS_CAP)), "r"
        masks.append(f"{token_rule} AS masked{i}")
        seq_cols.append(f"""count_if(masked{i}) AS n_tok_masked{i},
                       sum(CASE WHEN masked{i} THEN 0.0 ELSE {weight} END) AS sum_weight{i},
                       count_if(NOT masked{i}) AS n_kept{i},
                       sum(CASE WHEN masked{i} THEN 0.0 ELSE {w_ess} END) AS sw{i},
                       sum(CASE WHEN masked{i} THEN 0.0 ELSE {w_ess} * {w_ess} END) AS sw2{i}""")
    if "verl_rs" in methods:
        seq_cols.append(_VERL_AGGREGATES)
    return f"""
        WITH tok AS (SELECT run, step, sample, d, cd, exp(cd) AS r, {', '.join(masks)}
                     FROM (SELECT run, step, sample, trainer_logprob - sampler_logprob AS d,
                                  {clamp_log_ratio_sql('trainer_logprob - sampler_logprob')} AS cd
                           FROM tokens WHERE {where})),
        seq AS (SELECT run, step, sample, count(*) AS n_tok, sum(d) AS sum_d, avg(d) AS mean_d, min(r) AS min_r,
                       {', '.join(seq_cols)}
                FROM tok GROUP BY run, step, sample)
        {_union_sql(methods, values)}"""


def corrections(store: Store, runs: Sequence[str] | str, method: str, params: Mapping[str, float] | None = None,
                by: str = "step", steps: tuple[int, int] | None = None, source: str = "auto") -> pl.DataFrame:
    """METRICS.md Corrections columns of one method per (run, step) (`by="step"`) or per run (`by="run"`).

    masked_token_frac = masked tokens / n_tokens; masked_seq_frac = sequences with a masked token / n_sequences;
    weight_mean = mean over all tokens of the weight (clamp(r, lo, C) for tis; r kept, 0 masked otherwise);
    ess_after = (Σw)² / (n_kept · Σw²) over kept tokens (w = clamp(r, lo, C) for tis, clamp(r, 1/2, 2) otherwise),
    NULL when nothing is kept; masked/kept_reward_mean = mean reward of masked/kept sequences (NULL without
    rewards or such sequences); masked_adv_pos/neg_frac = masked tokens / tokens among sequences with advantage
    > 0 / < 0 (NULL without such tokens). Returns COLUMNS (without step for by="run"); empty groups give no row.

    source: "summaries" reads the per-sequence summaries (every token, cost follows sequences), "tokens" the
    token rows, "auto" (default) the summaries unless `reads_tokens` says the parameters need token rows.

    Example: icepop (alpha 0.5, beta 5) on one sequence with r = 1, 0.25 masks 1 of 2 tokens: masked_token_frac
    0.5, masked_seq_frac 1, weight_mean 0.5, ess_after 1.
    """
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    return _grouped(store, runs, [(method, params)], steps, source=source)[0][by]


def corrections_by_step_and_run(store: Store, runs: Sequence[str] | str, method: str,
                                params: Mapping[str, float] | None = None,
                                steps: tuple[int, int] | None = None, source: str = "auto") -> dict[str, pl.DataFrame]:
    """{"step": corrections(by="step"), "run": corrections(by="run")} from one pass (GROUP BY GROUPING SETS)."""
    return _grouped(store, runs, [(method, params)], steps, source=source)[0]


def compare_methods(store: Store, runs: Sequence[str] | str, choices: Sequence[tuple[str, Mapping[str, float]]],
                    steps: tuple[int, int] | None = None, only_steps: Sequence[int] | None = None,
                    thin: bool = False, source: str = "auto") -> dict[str, pl.DataFrame]:
    """`corrections_by_step_and_run` of several (method, params) choices, stacked: {"step": ..., "run": ...}
    with one row per (method, run, step) / (method, run), methods in the order chosen (the simulator's tables).
    One query per source: the summaries (or the token rows) are read once for all choices that use them.
    only_steps: the choices that read token rows read these steps only (sampled.thin_steps, for selections too
    large to read whole; their per-run rows are then over those steps); thin=True: the steps
    `sampled.thin_steps` chooses for this selection (every step unless it is large)."""
    if thin and only_steps is None and any(_source(source, m, p) == "tokens" for m, p in choices):
        only_steps = sampled.thin_steps(store, check_runs(runs), [steps]).steps
    parts = _grouped(store, runs, choices, steps, only_steps, source=source)
    return {by: pl.concat([x[by] for x in parts], how="vertical_relaxed") for by in ("step", "run")} if parts else {}


def _source(source: str, method: str, params: Mapping[str, float] | None) -> str:
    if source not in ("auto", "summaries", "tokens"):
        raise ValueError(f"source must be 'auto', 'summaries' or 'tokens', got {source!r}")
    needs_tokens = reads_tokens(method, params)
    if source == "summaries" and needs_tokens:
        why = ("its weights min(r, C) are not clamped below" if method == "tis" else
               f"they answer a token rule only at thresholds on their band edges (C or 1/C for C in "
               f"{', '.join(f'{c:g}' for c in CAPS)}, 1 ± ε for ε in {', '.join(f'{e:g}' for e in CLIPS)})")
        raise ValueError(f"{method} {dict(params or {})}: the summaries cannot give this correction: {why}; "
                         "use source='tokens'")
    return "tokens" if source == "tokens" or (source == "auto" and needs_tokens) else "summaries"


def _grouped(store: Store, runs, choices: Sequence[tuple[str, Mapping[str, float] | None]],
             steps, only_steps: Sequence[int] | None = None, source: str = "auto") -> list[dict[str, pl.DataFrame]]:
    """Per choice, {"step": ..., "run": ...}: one query for the choices the summaries answer and one for those
    that read token rows (the per-step groups cost little next to the per-sequence pass)."""
    if not choices:
        return []
    resolved = [(m, resolve_params(m, p)) for m, p in choices]
    runs = check_runs(runs)
    by_source: dict[str, list[int]] = {}
    for j, (m, values) in enumerate(resolved):
        by_source.setdefault(_source(source, m, values), []).append(j)
    out: list[dict[str, pl.DataFrame]] = [{}] * len(resolved)
    for src, idx in by_source.items():
        mine = [resolved[j] for j in idx]
        methods = [m for m, _ in mine]
        if src == "tokens":
            where, qp = token_filter(store, runs, steps, only_steps=only_steps)
            partials = _sequence_partials_sql(methods, where, [v for _, v in mine])
        else:
            where, qp = run_filter(runs, steps)
            partials = f"WITH {seq_summaries.seq_ctes(methods, where)}\n        {_union_sql(methods)}"
            qp |= seq_summaries.shared_params()
        for i, (m, values) in enumerate(mine):
            qp |= _rule_params(i, m, values, src)
        for j, part in zip(idx, _finish(store, partials, qp, mine)):
            out[j] = part
    return out


def _finish(store: Store, partials: str, qp: dict, resolved) -> list[dict[str, pl.DataFrame]]:
    """The METRICS.md columns per (run, step) and per run from per-(method, sequence) partials."""
    df = store.sql(f"""
        WITH p AS ({partials})
        SELECT p.m, p.run, p.step, GROUPING(p.step) AS rolled_up,
               sum(p.n_tok)::BIGINT AS n_tokens, count(*)::BIGINT AS n_sequences,
               sum(p.n_masked)::DOUBLE / sum(p.n_tok) AS masked_token_frac,
               count_if(p.n_masked > 0)::DOUBLE / count(*) AS masked_seq_frac,
               sum(p.sum_weight) / sum(p.n_tok) AS weight_mean,
               CASE WHEN sum(p.n_kept) = 0 THEN NULL
                    ELSE sum(p.sw) * sum(p.sw) / (sum(p.n_kept) * sum(p.sw2)) END AS ess_after,
               avg(q.reward) FILTER (WHERE p.n_masked > 0) AS masked_reward_mean,
               avg(q.reward) FILTER (WHERE p.n_masked = 0) AS kept_reward_mean,
               sum(p.n_masked) FILTER (WHERE q.advantage > 0)::DOUBLE
                   / nullif(sum(p.n_tok) FILTER (WHERE q.advantage > 0), 0) AS masked_adv_pos_frac,
               sum(p.n_masked) FILTER (WHERE q.advantage < 0)::DOUBLE
                   / nullif(sum(p.n_tok) FILTER (WHERE q.advantage < 0), 0) AS masked_adv_neg_frac
        FROM p LEFT JOIN sequences q ON q.run = p.run AND q.step = p.step AND q.sample = p.sample
        GROUP BY GROUPING SETS ((p.m, p.run, p.step), (p.m, p.run)) ORDER BY p.m, p.run, p.step""", qp)
    out = []
    for i, (method, values) in enumerate(resolved):
        mine = df.filter(pl.col("m") == i).with_columns(method=pl.lit(method), params=pl.lit(json.dumps(values)))
        # GROUPING(step) is 1 on the per-run rows, where step is rolled up
        out.append({by: mine.filter(pl.col("rolled_up") == (1 if by == "run" else 0))
                    .select([c for c in COLUMNS if c != "step" or by == "step"]) for by in ("step", "run")})
    return out


# -- the noise floor: how wide a band is against the measured spread of what it acts on ---------------------

# what each method's band acts on: token |Δ|, per-sequence |mean Δ| or per-sequence |ΣΔ|
BAND_QUANTITY = {"tis": "token", "icepop": "token", "veto": "token", "geo_rs": "seq_mean", "seq_rs": "seq_sum"}
QUANTITY_LABELS = {"token": "|Δ| per token", "seq_mean": "|mean Δ| per sequence", "seq_sum": "|ΣΔ| per sequence"}


def band_log_width(method: str, params: Mapping[str, float] | None = None) -> float:
    """How far the method's band reaches from Δ = 0 in log units, on its narrower side: ln C for tis (with lo > 0
    min(ln C, −ln lo)),
    min(−ln alpha, ln beta) for icepop, −ln tau for veto, min(−ln lo, ln hi) for geo_rs and seq_rs (0 when the
    band does not contain 1: such a band masks even identical log-probs)."""
    p = resolve_params(method, params)
    if method == "tis":
        return min(math.log(p["C"]), -math.log(p["lo"])) if p["lo"] > 0 else math.log(p["C"])
    if method == "veto":
        return max(0.0, -math.log(p["tau"]))
    lo, hi = (p["alpha"], p["beta"]) if method == "icepop" else (p["lo"], p["hi"])
    return max(0.0, min(-math.log(lo), math.log(hi)))


def log_ratio_quantiles(store: Store, runs: Sequence[str] | str, by: str = "run",
                        steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """p50 and p99 (linear interpolation, as numpy's default) of token |Δ|, per-sequence |mean Δ| and
    per-sequence |ΣΔ|, per run or per (run, step): the measured noise a correction's band is set against.
    From the summaries (analysis/metrics/quantiles.py): sequence quantiles exact; token quantiles exact up to
    quantiles.EXACT_TOKENS selected tokens with complete rows, else interpolated inside one histogram bin
    (token_exact says which).
    Returns [run, (step,) token_p50, token_p99, token_exact, seq_mean_p50, seq_mean_p99, seq_sum_p50, seq_sum_p99]."""
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    runs = check_runs(runs)
    keys = ["run", "step"] if by == "step" else ["run"]
    tok = quantiles.token_abs_quantiles(store, runs, keys, steps, (0.5, 0.99))
    seq = quantiles.sequence_quantiles(store, runs, keys, steps, (0.5, 0.99))
    return tok.join(seq, on=keys, how="inner").sort(keys)
