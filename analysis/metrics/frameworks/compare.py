"""Your framework's numbers: per run, our METRICS.md value beside what each framework's dashboard shows for the
same quantity, and one line on why they differ (reducer, clamp, micro-batch, kl type, + 1e-8).

Ours: `read.token_table` and `ours.more_token_columns` (r = e^clamp(Δ, ±20), plain token means, C = 2). Theirs:
`framework_table(..., by="run")` with each view's defaults (verl: rollout_is token, threshold 2; verl-actor:
micro-batches of 4 sequences; slime: per-sample means) unless a pair names a parameter (NeMo's kl_type, slime's
mis.py metrics). Routing pairs (prime-rl max_vio) only for runs with routing: ours from routing.routing_metrics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import polars as pl

from analysis.metrics import read, routing
from analysis.metrics.frameworks import framework_table, ours
from analysis.store import Store
from analysis.summaries.sql import check_runs

CAP = 2.0                  # our C, the verl and slime views' default threshold / tis_clip
SAME = "same definition"   # the reason where the two values agree to REL
REL = 1e-9

EPS_VERL = "verl divides by n + 1e-8"
EPS_NEMO = "NeMo divides by n + 1e-8"
UNCLAMPED = "; Δ not clamped at ±20"
ACTOR = "verl-actor: mean over micro-batches of 4 sequences"
PER_SAMPLE = "slime averages per sample first (ours: over tokens)"
MIS = {"tis_function": "mis"}  # slime with examples/train_infer_mismatch_helper/mis.py


@dataclass(frozen=True)
class Pair:
    quantity: str
    ours: str                  # a column of token_table or more_token_columns
    framework: str             # a name in FRAMEWORKS
    theirs: str                # a column of its framework_table
    reason: str                # why the two can differ, shown where they do
    params: dict = field(default_factory=dict)
    routing: bool = False      # a routing quantity: only for runs with routing (ours from routing_metrics)

    @property
    def label(self) -> str:
        """The framework as the table shows it, with the parameters that differ from its defaults."""
        return self.framework + "".join(f" ({k} {v})" for k, v in self.params.items())


def _verl(quantity, ours_col, name, reason=EPS_VERL, actor=True):
    col = f"rollout_corr/{name}"
    out = [Pair(quantity, ours_col, "verl", col, reason)]
    return out + ([Pair(quantity, ours_col, "verl-actor", col, ACTOR)] if actor else [])


PAIRS: tuple[Pair, ...] = (
    *_verl("KL k3", "kl_k3", "k3_kl", EPS_VERL + UNCLAMPED),
    Pair("KL k3", "kl_k3", "nemo", "gen_kl_error", EPS_NEMO + UNCLAMPED),
    Pair("KL k3", "kl_k3", "prime-rl", "mismatch_kl/all/mean", "prime-rl: Δ not clamped at ±20"),
    Pair("KL k3 std", "kl_k3_std", "prime-rl", "mismatch_kl/all/std", "prime-rl: Δ not clamped at ±20"),
    Pair("KL k3 median", "kl_k3_median", "prime-rl", "mismatch_kl/all/median",
         "prime-rl takes the lower middle value (ours: the mean of the two); Δ not clamped"),
    *_verl("KL k1", "kl_k1", "kl"),
    Pair("KL k1", "kl_k1", "nemo", "gen_kl_error", EPS_NEMO, {"kl_type": "k1"}),
    Pair("KL k2", "kl_k2", "nemo", "gen_kl_error", EPS_NEMO, {"kl_type": "k2"}),
    Pair("reverse KL k3", "kl_k3_reverse", "nemo", "policy_kl_error", EPS_NEMO + UNCLAMPED),
    *_verl("χ² token", "chi2_token", "chi2_token"),
    *_verl("χ² sequence", "chi2_seq", "chi2_seq"),
    *_verl("perplexity ratio", "ppl_ratio", "ppl_ratio"),
    *_verl("training perplexity", "training_ppl", "training_ppl"),
    *_verl("sampler perplexity", "sampler_ppl", "rollout_ppl"),
    *_verl("|Δ log perplexity|", "log_ppl_abs_diff", "log_ppl_abs_diff"),
    *_verl("IS mean", "ratio_mean", "rollout_is_mean", actor=False),
    Pair("IS mean", "ratio_mean", "nemo", "sampling_importance_ratio", EPS_NEMO + UNCLAMPED),
    Pair("IS mean", "ratio_mean", "slime", "tis", PER_SAMPLE + UNCLAMPED),
    *_verl("IS std", "ratio_std", "rollout_is_std", "verl clamps r to [1/C, C] before the std", actor=False),
    *_verl("IS std", "ratio_std_clamped", "rollout_is_std", actor=False),
    *_verl("IS min", "ratio_min", "rollout_is_min", actor=False),
    *_verl("IS max", "ratio_max", "rollout_is_max", actor=False),
    *_verl("IS effective sample size", "ess", "rollout_is_eff_sample_size",
           "verl adds 1e-8 to n and to mean w", actor=False),
    *_verl("share r > C", "ratio_frac_high", "rollout_is_ratio_fraction_high", actor=False),
    *_verl("share r < 1/C", "ratio_frac_low", "rollout_is_ratio_fraction_low", actor=False),
    Pair("share r > C", "ratio_frac_high", "slime", "tis_clipfrac", PER_SAMPLE),
    Pair("|r − 1| mean", "ratio_abs_dev_mean", "slime", "tis_abs", PER_SAMPLE + UNCLAMPED),
    Pair("|Δ| mean", "log_ratio_abs_mean", "slime", "train_rollout_logprob_abs_diff", PER_SAMPLE),
    Pair("mult-prob error", "mult_prob_error", "nemo", "token_mult_prob_error", EPS_NEMO + UNCLAMPED),
    *(Pair(f"seq mult-prob error {s}", f"seq_mult_prob_error_{s}", "nemo", f"{s}_seq_mult_prob_error",
           "NeMo: Δ not clamped at ±20") for s in ("max", "mean", "min")),
    Pair("JS divergence", "js_divergence", "nemo", "js_divergence_error", EPS_NEMO),
    Pair("KL k3", "kl_k3", "slime", "mis_k3_kl", PER_SAMPLE + UNCLAMPED, MIS),
    Pair("KL k1", "kl_k1", "slime", "mis_kl", PER_SAMPLE, MIS),
    Pair("training perplexity", "training_ppl", "slime", "mis_training_ppl", "rounding only (the same formula)", MIS),
    Pair("sampler perplexity", "sampler_ppl", "slime", "mis_rollout_ppl", "rounding only (the same formula)", MIS),
    Pair("χ² token", "chi2_token", "slime", "mis_chi2_token", PER_SAMPLE, MIS),
    Pair("expert load max_vio", "load_max_vio_trainer", "prime-rl", "max_vio/mean",
         "prime-rl drops the top_k most-loaded experts and counts every expert of the model (ours: the experts "
         "seen)", routing=True),
    Pair("|p_t − p_s| mean", "prob_abs_diff_mean", "verl", "training/rollout_probs_diff_mean", "rounding only (the same formula)"),
    Pair("|p_t − p_s| max", "prob_abs_diff_max", "verl", "training/rollout_probs_diff_max", "rounding only (the same formula)"),
    Pair("Pearson(p_t, p_s)", "prob_pearson", "verl", "training/rollout_actor_probs_pearson_corr",
         "rounding only (the same formula)"),
)
COLUMNS = ("run", "quantity", "ours", "ours_value", "framework", "their_column", "theirs_value", "reason")


def agree(a: float | None, b: float | None, rel: float = REL) -> bool:
    """|a − b| ≤ rel · max(|a|, |b|); two missing (None or NaN) values agree, one does not.

    >>> agree(1.0, 1.0 + 1e-12), agree(0.0, 0.0), agree(None, float("nan")), agree(1.0, 1.01)
    (True, True, True, False)
    """
    missing = [v is None or math.isnan(v) for v in (a, b)]
    if any(missing):
        return all(missing)
    return abs(a - b) <= rel * max(abs(a), abs(b))


def comparison(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, quantity, ours, ours_value, framework, their_column, theirs_value, reason], one row per run and
    PAIRS entry, over the run's tokens (by="run": the run as one batch).

    reason is SAME where the values agree to REL (the pair's differences do not move the number on these tokens,
    e.g. no |Δ| > 20, every sequence as long), else the pair's reason: slime's per-sample mean, verl's
    clamp to [1/C, C], verl-actor's mean over micro-batches, NeMo's kl type and n + 1e-8, an unclamped Δ.
    """
    runs = check_runs(runs)
    tables = [read.token_table(store, runs, by="run", cap=CAP, steps=steps),
              ours.more_token_columns(store, runs, by="run", cap=CAP, steps=steps)]
    routed = {r for r, trainer in store.routing_sides().items() if trainer and r in runs}  # trainer side: ours
    if routed:
        tables.append(routing.routing_metrics(store, sorted(routed), by="run", steps=steps, token_flips=False))
    mine = {r: {} for r in runs}
    for t in tables:
        for row in t.iter_rows(named=True):
            mine[row["run"]] |= row
    theirs: dict[tuple, dict[str, dict]] = {}
    for p in PAIRS:
        key = (p.framework, tuple(sorted(p.params.items())))
        if key not in theirs:
            t = framework_table(store, runs, p.framework, by="run", params=p.params, steps=steps)
            theirs[key] = {row["run"]: row for row in t.iter_rows(named=True)}
    rows = []
    for run in runs:
        for p in PAIRS:
            theirs_row = theirs[(p.framework, tuple(sorted(p.params.items())))].get(run)
            if theirs_row is None or "n_tokens" not in mine[run] or (p.routing and run not in routed):
                continue  # no tokens in the range, or no routing
            a, b = mine[run].get(p.ours), theirs_row.get(p.theirs)
            rows.append((run, p.quantity, p.ours, a, p.label, p.theirs, b, SAME if agree(a, b) else p.reason))
    schema = dict(zip(COLUMNS, (pl.String, pl.String, pl.String, pl.Float64, pl.String, pl.String, pl.Float64,
                                pl.String)))
    return pl.DataFrame(rows, schema=schema, orient="row")
