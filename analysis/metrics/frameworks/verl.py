"""verl's mismatch metrics (`rollout_corr/*`, `training/rollout_*`) by its own conventions, from sequence sums.

Read at volcengine/verl b178a3cd (2026-01-29); "RC" below is verl/trainer/ppo/rollout_corr_helper.py there.
Conventions that differ from ours: every masked mean divides by (count + 1e-8) (verl/utils/torch_functional.py
:287-301); k3_kl exponentiates Δ unclamped, the IS and χ² terms clamp it at ±20 per token; rejection statistics
clamp Δ per token before summing (RC:221-224) and bound k1 on −log r (RC:271-275); rollout_is_std is the std of
r clamped to [1/C, C] (RC:674-684). Per-sequence means count only sequences with trained tokens (verl's batch also
holds fully masked rows, which add exp(0) = 1 to its per-sequence perplexity means).
Fractions of sequences verl takes as `(...).float().mean()`, in float32 whatever its inputs: its logged
fractions differ from these (float64) by float32 rounding, up to ~6e-8 relative; everything else agrees with
verl's own functions run in float64 to ~1e-13 (checked on the data of tests/test_framework_views.py).
"""
from __future__ import annotations

import math

import numpy as np

from analysis.metrics.frameworks import inputs as I
from analysis.summaries.sql import clamp_log_ratio_sql

EPS = 1e-8  # verl_F.masked_mean: sum / (mask.sum() + 1e-8) (verl/utils/torch_functional.py:301@b178a3cd)
SAFETY_BOUND = 20.0  # RC:75@b178a3cd
SEQ_OPTIONS = ("seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
               "seq_max_k2", "seq_max_k3")  # RC:77-89@b178a3cd
TOKEN_OPTIONS = ("token_k1", "token_k2", "token_k3")  # RC:90@b178a3cd: per-token statistics, from the token rows
DEFAULTS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "none", "rollout_rs_threshold": "",
            "rollout_token_veto_threshold": "none", "micro_batch_seqs": 4}


# the TOKEN_SUMS of summary_seq the trainer view reads (besides inputs.ALWAYS): the rejection terms and the
# probability moments of calculate_debug_metrics
READS = ("sum_d2", "sum_k3", "sum_adp", "max_adp", "sum_ps", "sum_pt", "sum_ps2", "sum_pt2", "sum_pspt", "sum_qs",
         "sum_qt", "sum_qs2", "sum_qt2", "sum_qsqt")


def _mean(total, count):
    return total / (count + EPS)


def offpolicy_batches(q, g: I.Groups) -> dict[str, np.ndarray]:
    """compute_offpolicy_metrics (RC:834-940@b178a3cd) of every group of `g` at once, one value per group."""
    n, N = q["n"], g.add(q["n"])
    mlt = _mean(q["sum_t"], n)                                        # RC:877 per-sequence mean of t
    mlr = _mean(q["sum_s"], n)                                        # RC:899
    lpd = _mean(-q["sum_d"], n)                                       # RC:909 mean s − mean t per sequence
    return {
        "training_ppl": g.mean(np.exp(-mlt)),                         # RC:878
        "training_log_ppl": g.mean(-mlt),                             # RC:882
        "kl": _mean(g.add(-q["sum_d"]), N),                           # RC:889 mean(s − t)
        "k3_kl": _mean(g.add(I.sum_k3_unclamped(q)), N),              # RC:894-896 exp(Δ) − Δ − 1, unclamped
        "rollout_ppl": g.mean(np.exp(-mlr)),                          # RC:900
        "rollout_log_ppl": g.mean(-mlr),                              # RC:902
        "log_ppl_diff": g.mean(lpd),                                  # RC:910
        "log_ppl_abs_diff": g.mean(np.abs(lpd)),                      # RC:911
        "log_ppl_diff_max": g.max(lpd),                               # RC:912
        "log_ppl_diff_min": g.min(lpd),                               # RC:913
        "ppl_ratio": g.mean(np.exp(lpd)),                             # RC:920
        "chi2_token": _mean(g.add(I.sum_ratio_sq(q)), N) - 1.0,       # RC:927-930 r = exp(clamp(Δ, ±20))
        # RC:934-937: exp(2 · clamp(Σ Δ, ±20)) per sequence, mean over sequences
        "chi2_seq": g.mean(np.exp(2.0 * np.clip(q["sum_d"], -SAFETY_BOUND, SAFETY_BOUND))) - 1.0,
    }


def is_metrics(q, g: I.Groups, level: str, cap: float) -> dict[str, np.ndarray]:
    """compute_is_metrics (RC:601-713@b178a3cd) for rollout_is = level, rollout_is_threshold = cap."""
    n, N = q["n"], g.add(q["n"])
    lo = 1.0 / cap
    out: dict[str, np.ndarray] = {}
    if level == "sequence":
        w = np.exp(np.clip(q["sum_d"], -SAFETY_BOUND, SAFETY_BOUND))   # RC:538-544 per-sequence weight
        out["rollout_is_max"] = np.exp(np.minimum(g.max(q["sum_d"]), SAFETY_BOUND))  # RC:641-643
        out["rollout_is_min"] = np.exp(g.min(q["sum_d"]))               # RC:644 unclamped
        out["rollout_is_mean"] = _mean(g.add(n * w), N)                 # RC:647
        out["rollout_is_ratio_fraction_high"] = g.mean(q["sum_d"] > math.log(cap))   # RC:650-652
        out["rollout_is_ratio_fraction_low"] = g.mean(q["sum_d"] < math.log(lo))     # RC:651-653
        wc = np.clip(w, lo, cap)
        sum_w, sum_w2 = g.add(n * wc), g.add(n * wc * wc)
        seq_mean = n * w / (n + EPS)                                    # RC:698 masked_mean per sequence
    else:
        out["rollout_is_mean"] = _mean(g.add(n + q["sum_rm1"]), N)                # RC:657
        out["rollout_is_ratio_fraction_high"] = _mean(g.add(q["n_hi"]), N)       # RC:660-664 r > C
        out["rollout_is_ratio_fraction_low"] = _mean(g.add(q["n_lo"]), N)        # RC:661-667 r < 1/C
        out["rollout_is_max"] = np.exp(np.minimum(g.max(q["max_d"]), SAFETY_BOUND))  # RC:671
        out["rollout_is_min"] = np.exp(np.maximum(g.min(q["min_d"]), -SAFETY_BOUND))  # RC:672
        sw, sw2 = I.clamped_weight_sums(q, cap)
        sum_w, sum_w2 = g.add(sw), g.add(sw2)
        seq_mean = (n + q["sum_rm1"]) / (n + EPS)                     # RC:698
    mean_c = _mean(sum_w, N)
    # RC:675-686: std of w clamped to [1/C, C], E[w²] − E[w]², 0 for a single token
    out["rollout_is_std"] = np.where(N > 1, np.sqrt(np.maximum(_mean(sum_w2, N) - mean_c * mean_c, 0.0)), 0.0)
    # RC:689-694: 1 / mean((w / (mean w + 1e-8))²) over the clamped weights
    out["rollout_is_eff_sample_size"] = 1.0 / _mean(sum_w2 / (mean_c + EPS) ** 2, N)
    out["rollout_is_seq_mean"] = g.mean(seq_mean)                                  # RC:700
    out["rollout_is_seq_std"] = g.std(seq_mean)                                    # RC:701 torch std (n − 1)
    out["rollout_is_seq_max"] = g.max(seq_mean)                                    # RC:702
    out["rollout_is_seq_min"] = g.min(seq_mean)                                    # RC:703
    out["rollout_is_seq_max_deviation"] = g.max(np.abs(seq_mean - 1.0))            # RC:706-707
    out["rollout_is_seq_fraction_high"] = g.mean(seq_mean > cap)                   # RC:710
    out["rollout_is_seq_fraction_low"] = g.mean(seq_mean < lo)                     # RC:711
    return out


def parse_rs(options: str, spec: str) -> list[tuple[str, float | None, float]]:
    """[(option, lower, upper)] as _parse_rollout_rs_thresholds (RC:93-153@b178a3cd): one spec shared by all
    options or one per option; k1 options take 'lo_hi' or 'hi' (lo = 1/hi), the others one upper bound."""
    opts: list[str] = []
    for o in (x.strip() for x in options.split(",")):
        if o and o not in opts:
            opts.append(o)
    if not opts:
        raise ValueError("rollout_rs: at least one option, e.g. seq_mean_k1 or token_k2,seq_max_k3")
    for o in opts:
        if o not in SEQ_OPTIONS + TOKEN_OPTIONS:
            raise ValueError(f"rollout_rs option {o!r}: expected one of {', '.join(TOKEN_OPTIONS + SEQ_OPTIONS)}")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(opts)):
        raise ValueError(f"rollout_rs_threshold: one threshold for all options or {len(opts)}, got {spec!r}")
    specs = specs * len(opts) if len(specs) == 1 else specs
    out = []
    for o, sp in zip(opts, specs):
        try:
            if o.endswith("k1"):
                lo_s, _, hi_s = sp.partition("_") if "_" in sp else (str(1.0 / float(sp)), "", sp)
                lo, hi = float(lo_s), float(hi_s)
            else:
                if "_" in sp:
                    raise ValueError(f"rollout_rs_threshold for {o} takes one upper bound, got {sp!r}")
                lo, hi = None, float(sp)
        except ValueError as e:
            if "takes one upper bound" in str(e):
                raise
            raise ValueError(f"rollout_rs_threshold for {o}: not a number: {sp!r}") from None
        if hi <= 0 or (lo is not None and lo <= 0):
            raise ValueError(f"rollout_rs_threshold for {o} must be positive, got {sp!r}")
        out.append((o, lo, hi))
    return out


def _bounds(option: str, lower: float | None, upper: float) -> tuple[float, float]:
    """(low, up) the statistic is compared with: ln of the bounds for k1 (RC:259-260), else (0, upper)
    (RC:335-336)."""
    if option.endswith("k1"):
        return math.log(lower), math.log(upper)
    return 0.0, upper


def _seq_stat(q, option: str) -> np.ndarray:
    """The per-sequence statistic of a sequence option (RC:282-331), token terms on Δ clamped at ±20 (RC:221-224):
    k1 = −c, k2 = c²/2, k3 = e^c − 1 − c."""
    n = q["n"]
    if option.endswith("k1"):
        total = -I.sum_clamped_d(q)
    elif option.endswith("k2"):
        total = 0.5 * I.sum_clamped_d2(q)
    else:
        total = I.sum_clamped_k3(q)
    if option.startswith("seq_sum"):
        return total
    if option.startswith("seq_mean"):
        return _mean(total, n)
    # seq_max (RC:238-243): the largest token term; k2 and k3 grow with |c|, so it sits at min or max Δ
    hi = np.clip(q["max_d"], -SAFETY_BOUND, SAFETY_BOUND)
    lo = np.clip(q["min_d"], -SAFETY_BOUND, SAFETY_BOUND)
    if option.endswith("k2"):
        return 0.5 * np.maximum(hi * hi, lo * lo)
    return np.maximum(I.k3_of(hi), I.k3_of(lo))


def token_term_sql(option: str, c: str = "c") -> str:
    """SQL of a token option's per-token statistic over the clamped log-ratio `c` (RC:222-224), written as verl
    writes it (k3 = exp(c) − 1 − c, not a series)."""
    return {"token_k1": f"(-{c})", "token_k2": f"(0.5 * {c} * {c})", "token_k3": f"(exp({c}) - 1.0 - {c})"}[option]


def token_option_sql(where: str, options: list[tuple[str, float | None, float]]) -> tuple[str, dict]:
    """Per sequence, from the token rows, what the token options' statistics need (x = the option's token
    statistic, [low, up] its bounds): tk<i>_sum = Σ x, tk<i>_max, tk<i>_min, tk<i>_hi = #(x > up),
    tk<i>_lo = #(x < low) (k1), tk<i>_sc / tk<i>_sc2 = Σ clamp(x, low, up) and its square (RC:444-453), and
    tk_fail = tokens that fail any token option (RC:339: the options' keep masks multiply)."""
    cols, fails, params = [], [], {}
    for i, (option, lower, upper) in enumerate(options):
        if option not in TOKEN_OPTIONS:
            continue
        low, up = _bounds(option, lower, upper)
        params |= {f"tk{i}_low": low, f"tk{i}_up": up}
        x = token_term_sql(option)
        fail = f"({x} > $tk{i}_up" + (f" OR {x} < $tk{i}_low)" if option.endswith("k1") else ")")
        fails.append(fail)
        xc = f"least(greatest({x}, $tk{i}_low), $tk{i}_up)"
        cols.append(f"""sum({x}) AS tk{i}_sum, max({x}) AS tk{i}_max, min({x}) AS tk{i}_min,
            count_if({x} > $tk{i}_up)::DOUBLE AS tk{i}_hi, count_if({x} < $tk{i}_low)::DOUBLE AS tk{i}_lo,
            sum({xc}) AS tk{i}_sc, sum({xc} * {xc}) AS tk{i}_sc2""")
    sql = f"""SELECT run, step, sample, {', '.join(cols)}, count_if({' OR '.join(fails)})::DOUBLE AS tk_fail
        FROM (SELECT run, step, sample, {clamp_log_ratio_sql('trainer_logprob - sampler_logprob')} AS c
              FROM tokens WHERE {where}) c_
        GROUP BY run, step, sample"""
    return sql, params


def rs_metrics(q, g: I.Groups, options: list[tuple[str, float | None, float]]) -> dict[str, np.ndarray]:
    """compute_rollout_rejection_mask + compute_rs_metrics (RC:156-478@b178a3cd), token options from the
    columns of `token_option_sql`."""
    n, N = q["n"], g.add(q["n"])
    out: dict[str, np.ndarray] = {}
    seq_fail = np.zeros(n.size, dtype=bool)     # some sequence option masks the whole sequence
    for i, (option, lower, upper) in enumerate(options):
        k1 = option.endswith("k1")
        low, up = _bounds(option, lower, upper)
        p = f"rollout_rs_{option}"
        if option in TOKEN_OPTIONS:
            # level "token" (RC:265, 271-281): token max/min, token fractions; per-sequence values are the
            # masked means of the token statistic (RC:411)
            stat = _mean(q[f"tk{i}_sum"], n)
            out[f"{p}_mean"] = _mean(g.add(q[f"tk{i}_sum"]), N)                      # RC:417
            out[f"{p}_max"] = g.max(q[f"tk{i}_max"])                                  # RC:424-425
            out[f"{p}_min"] = g.min(q[f"tk{i}_min"])
            out[f"{p}_fraction_high"] = _mean(g.add(q[f"tk{i}_hi"]), N)               # RC:434
            out[f"{p}_fraction_low"] = _mean(g.add(q[f"tk{i}_lo"]), N) if k1 else np.zeros(N.size)  # RC:435-439
            sc, sc2 = g.add(q[f"tk{i}_sc"]), g.add(q[f"tk{i}_sc2"])
            masked_tok = q[f"tk{i}_hi"] + (q[f"tk{i}_lo"] if k1 else 0.0)             # RC:275-281 keep masks
        else:
            stat = _seq_stat(q, option)
            out[f"{p}_mean"] = _mean(g.add(n * stat), N)                              # RC:417 (broadcast)
            out[f"{p}_max"] = g.max(stat)                                             # RC:420-422
            out[f"{p}_min"] = g.min(stat)
            out[f"{p}_fraction_high"] = g.mean(stat > up)                             # RC:428-432
            out[f"{p}_fraction_low"] = g.mean(stat < low) if k1 else np.zeros(N.size)
            c = np.clip(stat, low if k1 else 0.0, up)                                 # RC:444-453
            sc, sc2 = g.add(n * c), g.add(n * c * c)
            keep = ((stat >= low) & (stat <= up)) if k1 else (stat <= upper)          # RC:289, 292, 308, 323
            masked_tok = np.where(keep, 0.0, n)
            seq_fail |= ~keep
        mc = _mean(sc, N)
        out[f"{p}_std"] = np.where(N > 1, np.sqrt(np.maximum(_mean(sc2, N) - mc * mc, 0.0)), 0.0)
        out[f"{p}_seq_mean"] = g.mean(stat)                                           # RC:458-468
        out[f"{p}_seq_std"] = g.std(stat)
        out[f"{p}_seq_max"] = g.max(stat)
        out[f"{p}_seq_min"] = g.min(stat)
        out[f"{p}_seq_max_deviation"] = g.max(np.abs(stat))
        out[f"{p}_seq_fraction_high"] = g.mean(stat > up)
        if k1:
            out[f"{p}_seq_fraction_low"] = g.mean(stat < low)
        out[f"{p}_masked_fraction"] = _mean(g.add(masked_tok), N)                    # RC:355, 362
        out[f"{p}_seq_masked_fraction"] = g.mean(masked_tok > 0)                      # RC:356-363
    # RC:365-369: a token is masked when any option masks it; a sequence when any of its tokens is
    tok_fail = q["tk_fail"] if "tk_fail" in q else np.zeros(n.size)
    masked_all = np.where(seq_fail, n, tok_fail)
    out["rollout_rs_masked_fraction"] = _mean(g.add(masked_all), N)
    out["rollout_rs_seq_masked_fraction"] = g.mean(masked_all > 0)
    return out


def veto_metrics(q, g: I.Groups) -> dict[str, np.ndarray]:
    """The token veto of verl 9b718e1a (RC:656-681@9b718e1a, gone at b178a3cd): a token is catastrophic when
    its unclamped Δ < ln τ; a sequence with one is vetoed. `n_below` counts them per sequence."""
    return {"rollout_is_veto_fraction": g.mean(q["n_below"] > 0),                  # RC:671@9b718e1a
            "rollout_is_catastrophic_token_fraction": _mean(g.add(q["n_below"]), g.add(q["n"]))}  # RC:672-674


def debug_metrics(q, g: I.Groups) -> dict[str, np.ndarray]:
    """calculate_debug_metrics (verl/utils/debug/metrics.py:63-109@b178a3cd): |exp t − exp s| over tokens (torch
    mean, std with n − 1) and the Pearson correlation of exp t and exp s (torch.corrcoef)."""
    N = g.add(q["n"])
    total = g.add(q["sum_adp"])
    # Σ (p_t − p_s)² from the moments around p = 0 or p = 1, whichever the sampler's mean is nearer (finalise.py)
    near0 = g.add(q["sum_ps"]) <= 0.5 * N
    pick = lambda a, b: np.where(near0, g.add(q[a]), g.add(q[b]))
    sa, sb, sab = pick("sum_ps", "sum_qs"), pick("sum_pt", "sum_qt"), pick("sum_pspt", "sum_qsqt")
    sa2, sb2 = pick("sum_ps2", "sum_qs2"), pick("sum_pt2", "sum_qt2")
    sq = np.maximum(sa2 + sb2 - 2.0 * sab, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        var = (sq - total * total / N) / (N - 1)
        va, vb, cov = sa2 - sa * sa / N, sb2 - sb * sb / N, sab - sa * sb / N
        pearson = np.where((va > 0) & (vb > 0), np.clip(cov / np.sqrt(va * vb), -1.0, 1.0), np.nan)
    return {
        "training/rollout_probs_diff_valid": np.ones(N.size),
        "training/rollout_probs_diff_max": g.max(q["max_adp"]),
        "training/rollout_probs_diff_mean": total / N,
        "training/rollout_probs_diff_std": np.where(N > 1, np.sqrt(np.maximum(var, 0.0)), np.nan),
        "training/rollout_actor_probs_pearson_corr": pearson,
    }


def check(p: dict) -> dict:
    if p["rollout_is"] not in ("token", "sequence", "none"):
        raise ValueError(f"rollout_is: expected token, sequence or none, got {p['rollout_is']!r}")
    I.band_params(float(p["rollout_is_threshold"]))  # a cap the summaries' ratio bands answer
    if p["rollout_rs"] != "none":
        p["_rs"] = parse_rs(p["rollout_rs"], p["rollout_rs_threshold"])
    if p["rollout_token_veto_threshold"] != "none":
        try:
            tau = float(p["rollout_token_veto_threshold"])
        except ValueError:
            raise ValueError(f"rollout_token_veto_threshold: a number or none, got "
                             f"{p['rollout_token_veto_threshold']!r}") from None
        if not tau > 0:
            raise ValueError(f"rollout_token_veto_threshold must be positive, got {tau:g}")  # RC:658@9b718e1a
        p["_veto"] = tau
    if int(p["micro_batch_seqs"]) < 1:
        raise ValueError(f"micro_batch_seqs must be ≥ 1, got {p['micro_batch_seqs']}")
    return p


def token_sql(p: dict, where: str) -> tuple[str, dict] | None:
    """The per-sequence token-row sums this view needs beyond the summaries (token rejection options), or None."""
    if any(o in TOKEN_OPTIONS for o, _, _ in p.get("_rs", ())):
        return token_option_sql(where, p["_rs"])
    return None


def below(p: dict) -> float | None:
    """ln τ of the veto: tokens with Δ below it are counted per sequence (`n_below`), or None."""
    return math.log(p["_veto"]) if "_veto" in p else None


def trainer_view(q, g: I.Groups, p: dict) -> dict[str, np.ndarray]:
    """What verl's trainer logs for one batch (ray_trainer: compute_rollout_correction_and_add_to_batch, then
    calculate_debug_metrics at verl/trainer/ppo/ray_trainer.py:1527-1531@b178a3cd)."""
    out: dict[str, np.ndarray] = {}
    if p["rollout_is"] != "none":
        out |= is_metrics(q, g, p["rollout_is"], float(p["rollout_is_threshold"]))
    if "_rs" in p:
        out |= rs_metrics(q, g, p["_rs"])
    if "_veto" in p:
        out |= veto_metrics(q, g)
    out |= offpolicy_batches(q, g)
    return {f"rollout_corr/{k}": v for k, v in out.items()} | debug_metrics(q, g)


def actor_view(q, g: I.Groups, p: dict) -> dict[str, np.ndarray]:
    """What verl's actor logs (verl/workers/actor/dp_actor.py:619-631, 663@b178a3cd): the off-policy metrics of
    every micro-batch (`micro_batch_seqs` consecutive sequences of a step, in sample order), reduced over each
    group's micro-batches by reduce_metrics (verl/utils/metric/utils.py:49-57@b178a3cd: a key containing "max"
    by max, "min" by min, else mean)."""
    size = int(p["micro_batch_seqs"])
    steps = q["_step"]
    change = np.ones(steps.size, bool)
    change[1:] = steps[1:] != steps[:-1]
    first = np.flatnonzero(change)                                    # each step's first sequence
    offset = np.arange(steps.size) - first[np.cumsum(change) - 1]     # a sequence's place in its step
    micro = np.append(np.flatnonzero(offset % size == 0), steps.size)
    parts = offpolicy_batches(q, I.Groups(micro))
    # every group (a step or a run) starts a step, so it starts a micro-batch: its micro-batches are a slice
    mg = I.Groups(np.append(np.searchsorted(micro[:-1], g.first), micro.size - 1))
    return {f"rollout_corr/{k}": (mg.max(v) if "max" in k else mg.min(v) if "min" in k else mg.mean(v))
            for k, v in parts.items()}
