"""verl's mismatch metrics (`rollout_corr/*`, `training/rollout_*`) by its own conventions, from sequence sums.

Read at volcengine/verl b178a3cd (2026-01-29); "RC" below is verl/trainer/ppo/rollout_corr_helper.py there.
Conventions that differ from ours: every masked mean divides by (count + 1e-8) (verl/utils/torch_functional.py
:287-301); k3_kl exponentiates Δ unclamped, the IS and χ² terms clamp it at ±20 per token; rejection statistics
clamp Δ per token before summing (RC:221-224) and bound k1 on −log r (RC:271-275); rollout_is_std is the std of
r clamped to [1/C, C] (RC:674-684). Per-sequence means count only sequences with trained tokens (verl's batch also
holds fully masked rows, which add exp(0) = 1 to its per-sequence perplexity means).
"""
from __future__ import annotations

import math

import numpy as np

from analysis.metrics.frameworks import inputs as I

EPS = 1e-8  # verl_F.masked_mean: sum / (mask.sum() + 1e-8) (verl/utils/torch_functional.py:301@b178a3cd)
SAFETY_BOUND = 20.0  # RC:75@b178a3cd
SEQ_OPTIONS = ("seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
               "seq_max_k2", "seq_max_k3")  # RC:77-89@b178a3cd (token_k1|k2|k3 are not offered here yet)
DEFAULTS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "none", "rollout_rs_threshold": "",
            "micro_batch_seqs": 4}


def _mean(total, count):
    return total / (count + EPS)


def offpolicy(q) -> dict[str, float]:
    """compute_offpolicy_metrics (RC:834-940@b178a3cd) over the sequences of `q` (one batch)."""
    return {k: float(v[0]) for k, v in offpolicy_batches(q, np.zeros(1, np.int64)).items()}


def offpolicy_batches(q, starts: np.ndarray) -> dict[str, np.ndarray]:
    """compute_offpolicy_metrics of every batch at once: the batches are the sequences of `q` from each of
    `starts` (sorted, starting at 0) to the next; one value per batch."""
    add = lambda x: np.add.reduceat(x, starts)
    count = np.diff(np.append(starts, q["n"].size)).astype(np.float64)   # sequences per batch
    mean = lambda x: add(x) / count                                        # a plain mean over sequences
    n, N = q["n"], add(q["n"])
    mlt = _mean(q["sum_t"], n)                                        # RC:877 per-sequence mean of t
    mlr = _mean(q["sum_s"], n)                                        # RC:899
    lpd = _mean(-q["sum_d"], n)                                       # RC:909 mean s − mean t per sequence
    return {
        "training_ppl": mean(np.exp(-mlt)),                           # RC:878
        "training_log_ppl": mean(-mlt),                               # RC:882
        "kl": _mean(add(-q["sum_d"]), N),                             # RC:889 mean(s − t)
        "k3_kl": _mean(add(I.sum_k3_unclamped(q)), N),                # RC:894-896 exp(Δ) − Δ − 1, unclamped
        "rollout_ppl": mean(np.exp(-mlr)),                            # RC:900
        "rollout_log_ppl": mean(-mlr),                                # RC:902
        "log_ppl_diff": mean(lpd),                                    # RC:910
        "log_ppl_abs_diff": mean(np.abs(lpd)),                        # RC:911
        "log_ppl_diff_max": np.maximum.reduceat(lpd, starts),         # RC:912
        "log_ppl_diff_min": np.minimum.reduceat(lpd, starts),         # RC:913
        "ppl_ratio": mean(np.exp(lpd)),                               # RC:920
        "chi2_token": _mean(add(I.sum_ratio_sq(q)), N) - 1.0,         # RC:927-930 r = exp(clamp(Δ, ±20))
        # RC:934-937: exp(2 · clamp(Σ Δ, ±20)) per sequence, mean over sequences
        "chi2_seq": mean(np.exp(2.0 * np.clip(q["sum_d"], -SAFETY_BOUND, SAFETY_BOUND))) - 1.0,
    }


def is_metrics(q, level: str, cap: float) -> dict[str, float]:
    """compute_is_metrics (RC:601-713@b178a3cd) for rollout_is = level, rollout_is_threshold = cap."""
    n, N = q["n"], q["n"].sum()
    lo = 1.0 / cap
    out: dict[str, float] = {}
    if level == "sequence":
        w = np.exp(np.clip(q["sum_d"], -SAFETY_BOUND, SAFETY_BOUND))   # RC:538-544 per-sequence weight
        out["rollout_is_max"] = float(math.exp(min(q["sum_d"].max(), SAFETY_BOUND)))  # RC:641-643
        out["rollout_is_min"] = float(np.exp(q["sum_d"].min()))         # RC:644 unclamped
        out["rollout_is_mean"] = float(_mean((n * w).sum(), N))         # RC:647
        out["rollout_is_ratio_fraction_high"] = float((q["sum_d"] > math.log(cap)).mean())  # RC:650-652
        out["rollout_is_ratio_fraction_low"] = float((q["sum_d"] < math.log(lo)).mean())    # RC:651-653
        wc = np.clip(w, lo, cap)
        sum_w, sum_w2 = (n * wc).sum(), (n * wc * wc).sum()
        seq_mean = n * w / (n + EPS)                                    # RC:698 masked_mean per sequence
    else:
        out["rollout_is_mean"] = float(_mean((n + q["sum_rm1"]).sum(), N))           # RC:657
        out["rollout_is_ratio_fraction_high"] = float(_mean(q["n_hi"].sum(), N))    # RC:660-664 r > C
        out["rollout_is_ratio_fraction_low"] = float(_mean(q["n_lo"].sum(), N))     # RC:661-667 r < 1/C
        out["rollout_is_max"] = float(math.exp(min(q["max_d"].max(), SAFETY_BOUND)))     # RC:671
        out["rollout_is_min"] = float(math.exp(max(q["min_d"].min(), -SAFETY_BOUND)))    # RC:672
        sw, sw2 = I.clamped_weight_sums(q, cap)
        sum_w, sum_w2 = sw.sum(), sw2.sum()
        seq_mean = (n + q["sum_rm1"]) / (n + EPS)                     # RC:698
    mean_c = _mean(sum_w, N)
    # RC:675-686: std of w clamped to [1/C, C], E[w²] − E[w]², 0 for a single token
    out["rollout_is_std"] = float(math.sqrt(max(_mean(sum_w2, N) - mean_c * mean_c, 0.0))) if N > 1 else 0.0
    # RC:689-694: 1 / mean((w / (mean w + 1e-8))²) over the clamped weights
    out["rollout_is_eff_sample_size"] = float(1.0 / _mean(sum_w2 / (mean_c + EPS) ** 2, N))
    out["rollout_is_seq_mean"] = float(seq_mean.mean())                              # RC:700
    out["rollout_is_seq_std"] = float(seq_mean.std(ddof=1)) if seq_mean.size > 1 else 0.0  # RC:701 torch std
    out["rollout_is_seq_max"] = float(seq_mean.max())                                # RC:702
    out["rollout_is_seq_min"] = float(seq_mean.min())                                # RC:703
    out["rollout_is_seq_max_deviation"] = float(np.abs(seq_mean - 1.0).max())        # RC:706-707
    out["rollout_is_seq_fraction_high"] = float((seq_mean > cap).mean())             # RC:710
    out["rollout_is_seq_fraction_low"] = float((seq_mean < lo).mean())               # RC:711
    return out


def parse_rs(options: str, spec: str) -> list[tuple[str, float | None, float]]:
    """[(option, lower, upper)] as _parse_rollout_rs_thresholds (RC:93-153@b178a3cd): one spec shared by all
    options or one per option; k1 options take 'lo_hi' or 'hi' (lo = 1/hi), the others one upper bound."""
    opts: list[str] = []
    for o in (x.strip() for x in options.split(",")):
        if o and o not in opts:
            opts.append(o)
    for o in opts:
        if o not in SEQ_OPTIONS:
            raise ValueError(f"rollout_rs option {o!r}: expected one of {', '.join(SEQ_OPTIONS)} "
                             "(token_k1|k2|k3 read per-token thresholds the summaries do not keep)")
    specs = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(specs) not in (1, len(opts)):
        raise ValueError(f"rollout_rs_threshold: one threshold for all options or {len(opts)}, got {spec!r}")
    specs = specs * len(opts) if len(specs) == 1 else specs
    out = []
    for o, sp in zip(opts, specs):
        if o.endswith("k1"):
            lo_s, _, hi_s = sp.partition("_") if "_" in sp else (str(1.0 / float(sp)), "", sp)
            lo, hi = float(lo_s), float(hi_s)
            if lo <= 0 or hi <= 0:
                raise ValueError(f"rollout_rs_threshold for {o} must be positive, got {sp!r}")
            out.append((o, lo, hi))
        else:
            if "_" in sp:
                raise ValueError(f"rollout_rs_threshold for {o} takes one upper bound, got {sp!r}")
            if float(sp) <= 0:
                raise ValueError(f"rollout_rs_threshold for {o} must be positive, got {sp!r}")
            out.append((o, None, float(sp)))
    return out


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


def rs_metrics(q, options: list[tuple[str, float | None, float]]) -> dict[str, float]:
    """compute_rollout_rejection_mask + compute_rs_metrics (RC:156-478@b178a3cd) for sequence options."""
    n, N = q["n"], q["n"].sum()
    out: dict[str, float] = {}
    keep_all = np.ones(n.size, dtype=bool)
    for option, lower, upper in options:
        stat = _seq_stat(q, option)
        k1 = option.endswith("k1")
        up = math.log(upper) if k1 else upper                         # RC:335
        low = math.log(lower) if k1 else 0.0                          # RC:336
        keep = ((stat >= low) & (stat <= up)) if k1 else (stat <= upper)  # RC:289, 292, 308, 323
        keep_all &= keep
        p = f"rollout_rs_{option}"
        out[f"{p}_mean"] = float(_mean((n * stat).sum(), N))           # RC:417 over tokens (broadcast)
        out[f"{p}_max"] = float(stat.max())                            # RC:420-422
        out[f"{p}_min"] = float(stat.min())
        out[f"{p}_fraction_high"] = float((stat > up).mean())          # RC:428-432
        out[f"{p}_fraction_low"] = float((stat < low).mean()) if k1 else 0.0
        c = np.clip(stat, low if k1 else 0.0, up)                      # RC:444-453
        mc = _mean((n * c).sum(), N)
        out[f"{p}_std"] = float(math.sqrt(max(_mean((n * c * c).sum(), N) - mc * mc, 0.0))) if N > 1 else 0.0
        out[f"{p}_seq_mean"] = float(stat.mean())                      # RC:458-468
        out[f"{p}_seq_std"] = float(stat.std(ddof=1)) if stat.size > 1 else 0.0
        out[f"{p}_seq_max"] = float(stat.max())
        out[f"{p}_seq_min"] = float(stat.min())
        out[f"{p}_seq_max_deviation"] = float(np.abs(stat).max())
        out[f"{p}_seq_fraction_high"] = float((stat > up).mean())
        if k1:
            out[f"{p}_seq_fraction_low"] = float((stat < low).mean())
        out[f"{p}_masked_fraction"] = float(_mean((n * ~keep).sum(), N))  # RC:355, 362
        out[f"{p}_seq_masked_fraction"] = float((~keep).mean())           # RC:356-363
    out["rollout_rs_masked_fraction"] = float(_mean((n * ~keep_all).sum(), N))  # RC:366
    out["rollout_rs_seq_masked_fraction"] = float((~keep_all).mean())           # RC:367-369
    return out


def debug_metrics(q) -> dict[str, float]:
    """calculate_debug_metrics (verl/utils/debug/metrics.py:63-109@b178a3cd): |exp t − exp s| over tokens (torch
    mean, std with n − 1) and the Pearson correlation of exp t and exp s (torch.corrcoef)."""
    N = q["n"].sum()
    total = q["sum_adp"].sum()
    # Σ (p_t − p_s)² from the moments around p = 0 or p = 1, whichever the sampler's mean is nearer (finalise.py)
    near0 = q["sum_ps"].sum() <= 0.5 * N
    a, b, ab, xa, xb = (("sum_ps", "sum_pt", "sum_pspt", "sum_ps2", "sum_pt2") if near0
                        else ("sum_qs", "sum_qt", "sum_qsqt", "sum_qs2", "sum_qt2"))
    sa, sb, sab, sa2, sb2 = (q[k].sum() for k in (a, b, ab, xa, xb))
    sq = max(sa2 + sb2 - 2.0 * sab, 0.0)
    var = (sq - total * total / N) / (N - 1) if N > 1 else math.nan
    va, vb, cov = sa2 - sa * sa / N, sb2 - sb * sb / N, sab - sa * sb / N
    pearson = (max(-1.0, min(1.0, cov / math.sqrt(va * vb))) if va > 0 and vb > 0 else math.nan)
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(q["max_adp"].max()),
        "training/rollout_probs_diff_mean": float(total / N),
        "training/rollout_probs_diff_std": float(math.sqrt(max(var, 0.0))) if N > 1 else math.nan,
        "training/rollout_actor_probs_pearson_corr": float(pearson),
    }


def check(p: dict) -> dict:
    if p["rollout_is"] not in ("token", "sequence", "none"):
        raise ValueError(f"rollout_is: expected token, sequence or none, got {p['rollout_is']!r}")
    I.band_params(float(p["rollout_is_threshold"]))  # a cap the summaries' ratio bands answer
    if p["rollout_rs"] != "none":
        p["_rs"] = parse_rs(p["rollout_rs"], p["rollout_rs_threshold"])
    if int(p["micro_batch_seqs"]) < 1:
        raise ValueError(f"micro_batch_seqs must be ≥ 1, got {p['micro_batch_seqs']}")
    return p


def trainer_view(q, p: dict) -> dict[str, float]:
    """What verl's trainer logs for one batch (ray_trainer: compute_rollout_correction_and_add_to_batch, then
    calculate_debug_metrics at verl/trainer/ppo/ray_trainer.py:1527-1531@b178a3cd)."""
    out: dict[str, float] = {}
    if p["rollout_is"] != "none":
        out |= is_metrics(q, p["rollout_is"], float(p["rollout_is_threshold"]))
    if "_rs" in p:
        out |= rs_metrics(q, p["_rs"])
    out |= offpolicy(q)
    return {f"rollout_corr/{k}": v for k, v in out.items()} | debug_metrics(q)


def reduce_metrics(values: dict[str, np.ndarray]) -> dict[str, float]:
    """verl/utils/metric/utils.py:49-57@b178a3cd: a key containing "max" reduces by max, "min" by min, else mean
    (`values`: each key's values over the micro-batches)."""
    return {key: float(xs.max() if "max" in key else xs.min() if "min" in key else xs.mean())
            for key, xs in values.items()}


def actor_view(q, p: dict) -> dict[str, float]:
    """What verl's actor logs (verl/workers/actor/dp_actor.py:619-631, 663@b178a3cd): the off-policy metrics of
    every micro-batch (`micro_batch_seqs` consecutive sequences of a step, in sample order), reduced by
    reduce_metrics."""
    size = int(p["micro_batch_seqs"])
    steps = q["_step"]
    change = np.ones(steps.size, bool)
    change[1:] = steps[1:] != steps[:-1]
    first = np.flatnonzero(change)                                    # each step's first sequence
    offset = np.arange(steps.size) - first[np.cumsum(change) - 1]     # a sequence's place in its step
    parts = offpolicy_batches(q, np.flatnonzero(offset % size == 0))
    return reduce_metrics({f"rollout_corr/{k}": v for k, v in parts.items()})
