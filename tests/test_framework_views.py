"""`metrics --as FRAMEWORK`: every column against a numpy reference written from the framework's cited lines.

The references work on padded [B, L] arrays with a mask, as the frameworks' tensors are, and follow each line
literally in float64 (their masked means' + 1e-8, their clamps, their reducers). Data: equal- and unequal-length
sequences, tokens with |Δ| > 20 and with r < 1e-4, per step and per run; |Δ| ≥ 0.01 elsewhere so that the
literal e^Δ − 1 − Δ of the references keeps its digits.
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics.frameworks import framework_table, resolve_params

RTOL, ATOL = 1e-9, 1e-13


def make_tokens(seed: int, equal: bool, steps=(0, 1, 2), n_seq=6) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for step in steps:
        for sample in range(n_seq):
            n = 16 if equal else int(rng.integers(1, 41))
            d = rng.normal(0.0, 0.5, n)
            d = np.where(np.abs(d) < 0.01, np.copysign(0.01, d), d)
            if sample == 1:
                d[0] = -10.0                  # r = 4.5e-5 < 1e-4
            if sample == 2 and step != 1:
                d[-1] = 23.0 if step == 0 else -25.0   # |Δ| > 20
            s = -rng.exponential(1.5, n) - np.maximum(d, 0.0) - 0.05   # keeps t = s + Δ < 0
            t = s + d
            rows.append(pl.DataFrame({"run": "a", "step": step, "sample": sample, "pos": np.arange(n),
                                      "sampler_logprob": s, "trainer_logprob": t}))
    return pl.concat(rows)


def rewards_of(tokens: pl.DataFrame) -> dict:
    """A reward of 0 or 1 per sequence (seeded by its keys)."""
    return {(r, st, sa): float((st * 7 + sa * 3) % 5 < 2) for r, st, sa in
            tokens.select("run", "step", "sample").unique().iter_rows()}


def load_with_rewards(folder, tokens: pl.DataFrame):
    """The tokens as sequence JSON Lines with a reward each, through the real ingest path."""
    import json

    from analysis.ingest import ingest_paths
    from analysis.store import Store
    folder.mkdir(parents=True, exist_ok=True)
    rw = rewards_of(tokens)
    with open(folder / "seqs.jsonl", "w") as f:
        for (run, step, sample), g in tokens.sort("run", "step", "sample", "pos").group_by(
                ["run", "step", "sample"], maintain_order=True):
            f.write(json.dumps({"run": run, "step": step, "sample": sample, "reward": rw[(run, step, sample)],
                                "sampler_logprobs": g["sampler_logprob"].to_list(),
                                "trainer_logprobs": g["trainer_logprob"].to_list()}) + "\n")
    store = Store(folder / "t.duckdb")
    outcomes = ingest_paths(store, [folder / "seqs.jsonl"])
    assert [o.status for o in outcomes] == ["loaded"], [o.line() for o in outcomes]
    return store


@pytest.fixture(scope="module", params=["equal", "unequal"])
def data(request, tmp_path_factory):
    tokens = make_tokens(11 if request.param == "equal" else 12, request.param == "equal")
    store = load_with_rewards(tmp_path_factory.mktemp(f"fw_{request.param}"), tokens)
    yield store, tokens
    store.close()


def batches(tokens: pl.DataFrame, by: str, with_rewards: bool = False):
    """(key, S, T, M) per group: [B, L] sampler and trainer log-probs, zero-padded, and the mask (and with
    with_rewards the [B] rewards of `rewards_of`)."""
    keys = ["run", "step"] if by == "step" else ["run"]
    rw = rewards_of(tokens)
    for key, g in tokens.sort("run", "step", "sample", "pos").group_by(keys, maintain_order=True):
        seqs = [(x["sampler_logprob"].to_numpy(), x["trainer_logprob"].to_numpy(), rw[k])
                for k, x in g.group_by(["run", "step", "sample"], maintain_order=True)]
        L = max(len(s) for s, _, _ in seqs)
        S, T, M = (np.zeros((len(seqs), L)) for _ in range(3))
        for i, (s, t, _) in enumerate(seqs):
            S[i, :len(s)], T[i, :len(t)], M[i, :len(s)] = s, t, 1.0
        if with_rewards:
            yield key, S, T, M, np.array([r for _, _, r in seqs])
        else:
            yield key, S, T, M


def compare(ours: pl.DataFrame, refs: list[dict], by: str):
    assert ours.height == len(refs)
    for row, ref in zip(ours.iter_rows(named=True), refs):
        for name, value in ref.items():
            assert name in row, f"missing column {name}"
            if isinstance(value, float) and math.isnan(value):
                assert row[name] is None or math.isnan(row[name]), name
                continue
            np.testing.assert_allclose(row[name], value, rtol=RTOL, atol=ATOL, err_msg=f"{name} ({by})")
        extra = set(row) - set(ref) - {"run", "step", "n_tokens", "n_sequences"}
        assert not extra, f"columns without a reference: {sorted(extra)}"


# -- verl @ b178a3cd: verl/trainer/ppo/rollout_corr_helper.py (RC), verl/utils/debug/metrics.py -----------------

def v_mean(x, m, axis=None):  # verl/utils/torch_functional.py:266-301
    return (np.where(m > 0, x, 0.0) * m).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def ref_offpolicy(old, roll, m):  # RC:834-940
    mlt = v_mean(old, m, -1)
    out = {"training_ppl": np.exp(-mlt).mean(), "training_log_ppl": (-mlt).mean(),
           "kl": v_mean(roll - old, m)}
    lr = old - roll
    out["k3_kl"] = v_mean(np.exp(lr) - lr - 1, m)
    mlr = v_mean(roll, m, -1)
    out |= {"rollout_ppl": np.exp(-mlr).mean(), "rollout_log_ppl": (-mlr).mean()}
    lpd = mlr - mlt
    out |= {"log_ppl_diff": lpd.mean(), "log_ppl_abs_diff": np.abs(lpd).mean(), "log_ppl_diff_max": lpd.max(),
            "log_ppl_diff_min": lpd.min(), "ppl_ratio": np.exp(lpd).mean()}
    rho = np.exp(np.clip(lr, -20, 20))
    out["chi2_token"] = v_mean(rho ** 2, m) - 1.0
    lrs = (np.where(m > 0, lr, 0) * m).sum(-1)
    out["chi2_seq"] = np.exp(2.0 * np.clip(lrs, -20, 20)).mean() - 1.0
    return out


def ref_is(lr, m, level, C):  # RC:481-713
    out = {}
    if level == "token":
        w = np.exp(np.clip(lr, -20, 20)) * m
        out["rollout_is_mean"] = v_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = v_mean((w > C).astype(float), m)
        out["rollout_is_ratio_fraction_low"] = v_mean((w < 1 / C).astype(float), m)
        out["rollout_is_max"] = np.where(m > 0, w, -np.inf).max()
        out["rollout_is_min"] = np.where(m > 0, w, np.inf).min()
    else:
        lrs = (np.where(m > 0, lr, 0) * m).sum(-1)[:, None]
        w = np.exp(np.clip(lrs, -20, 20)) * np.ones_like(lr) * m
        out["rollout_is_max"] = math.exp(min(lrs.max(), 20.0))
        out["rollout_is_min"] = math.exp(lrs.min())
        out["rollout_is_mean"] = v_mean(w, m)
        out["rollout_is_ratio_fraction_high"] = (lrs > math.log(C)).mean()
        out["rollout_is_ratio_fraction_low"] = (lrs < math.log(1 / C)).mean()
    wc = np.clip(w, 1 / C, C)
    mc = v_mean(wc, m)
    out["rollout_is_std"] = math.sqrt(max(v_mean(wc ** 2, m) - mc ** 2, 0.0)) if m.sum() > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / v_mean((wc / (mc + 1e-8)) ** 2, m)
    sm = v_mean(w, m, -1)
    out |= {"rollout_is_seq_mean": sm.mean(), "rollout_is_seq_std": sm.std(ddof=1) if sm.size > 1 else 0.0,
            "rollout_is_seq_max": sm.max(), "rollout_is_seq_min": sm.min(),
            "rollout_is_seq_max_deviation": np.abs(sm - 1).max(),
            "rollout_is_seq_fraction_high": (sm > C).mean(), "rollout_is_seq_fraction_low": (sm < 1 / C).mean()}
    return out


def ref_rs(lr, m, options):  # RC:156-478, token and sequence options
    c = np.clip(lr, -20, 20)
    terms = {"k1": -c, "k2": 0.5 * c ** 2, "k3": np.exp(c) - 1.0 - c}
    combined = np.ones_like(lr)
    mb = m > 0
    out = {}
    for opt, lo, hi in options:
        kind, k = opt.rsplit("_", 1)
        x = terms[k]
        k1 = k == "k1"
        up, low = (math.log(hi), math.log(lo)) if k1 else (hi, 0.0)
        p = f"rollout_rs_{opt}"
        if kind == "token":   # RC:271-281, level token
            tok = x
            keep_tok = ((x >= low) & (x <= up)) if k1 else x <= hi
            stat = v_mean(x, m, -1)                    # RC:411
            out[f"{p}_max"] = np.where(mb, x, -np.inf).max()
            out[f"{p}_min"] = np.where(mb, x, np.inf).min()
            out[f"{p}_fraction_high"] = v_mean((x > up).astype(float), m)
            out[f"{p}_fraction_low"] = v_mean((x < low).astype(float), m) if k1 else 0.0
        else:
            if kind == "seq_sum":
                stat = (np.where(mb, x, 0) * m).sum(-1)
            elif kind == "seq_mean":
                stat = v_mean(x, m, -1)
            else:
                stat = np.where(mb, x, -np.inf).max(-1)
            keep = ((stat >= low) & (stat <= up)) if k1 else stat <= hi
            tok = np.broadcast_to(stat[:, None], lr.shape)
            keep_tok = np.broadcast_to(keep[:, None], lr.shape)
            out[f"{p}_max"], out[f"{p}_min"] = stat.max(), stat.min()
            out[f"{p}_fraction_high"] = (stat > up).mean()
            out[f"{p}_fraction_low"] = (stat < low).mean() if k1 else 0.0
        out[f"{p}_mean"] = v_mean(tok, m)
        cl = np.clip(tok, low if k1 else 0.0, up)
        mc = v_mean(cl, m)
        out[f"{p}_std"] = math.sqrt(max(v_mean(cl ** 2, m) - mc ** 2, 0.0))
        out |= {f"{p}_seq_mean": stat.mean(), f"{p}_seq_std": stat.std(ddof=1), f"{p}_seq_max": stat.max(),
                f"{p}_seq_min": stat.min(), f"{p}_seq_max_deviation": np.abs(stat).max(),
                f"{p}_seq_fraction_high": (stat > up).mean()}
        if k1:
            out[f"{p}_seq_fraction_low"] = (stat < low).mean()
        keep_f = keep_tok.astype(float)
        combined = combined * keep_f
        out[f"{p}_masked_fraction"] = v_mean(1 - keep_f, m)
        out[f"{p}_seq_masked_fraction"] = (~(keep_tok | ~mb)).any(-1).mean()   # RC:340, 356-361
    out["rollout_rs_masked_fraction"] = v_mean(1 - combined, m)
    out["rollout_rs_seq_masked_fraction"] = ((combined < 0.5) & (m > 0)).any(-1).mean()
    return out


def ref_veto(lr, m, tau):  # RC:656-674@9b718e1a, Δ unclamped
    cat = (lr < math.log(tau)) & (m > 0)
    return {"rollout_is_veto_fraction": cat.any(-1).mean(),
            "rollout_is_catastrophic_token_fraction": v_mean(cat.astype(float), m)}


def ref_debug(old, roll, m):  # verl/utils/debug/metrics.py:48-109
    mb = m > 0
    pa, pr = np.exp(old)[mb], np.exp(roll)[mb]
    diff = np.abs(pa - pr)
    return {"training/rollout_probs_diff_valid": 1.0, "training/rollout_probs_diff_max": diff.max(),
            "training/rollout_probs_diff_mean": diff.mean(), "training/rollout_probs_diff_std": diff.std(ddof=1),
            "training/rollout_actor_probs_pearson_corr": np.corrcoef(np.stack([pa, pr]))[0, 1]}


@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("params", [
    {}, {"rollout_is": "sequence", "rollout_is_threshold": "3"},
    {"rollout_is": "none", "rollout_rs": "seq_mean_k1,seq_sum_k2,seq_max_k3,seq_max_k2,seq_sum_k1,seq_mean_k3",
     "rollout_rs_threshold": "0.97_1.0,2.5,4,1.5,0.5_2,0.2"},
    {"rollout_rs": "seq_sum_k3,seq_mean_k2", "rollout_rs_threshold": "3"},
    {"rollout_is": "none", "rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "0.5_1.6,0.3,0.2"},
    {"rollout_rs": "token_k3,seq_max_k2,token_k1", "rollout_rs_threshold": "0.4,3,2.5",
     "rollout_token_veto_threshold": "1e-4"},
])
def test_verl(data, by, params):
    store, tokens = data
    p = resolve_params("verl", params)
    refs = []
    for _, S, T, M in batches(tokens, by):
        lr = T - S
        out = {}
        if p["rollout_is"] != "none":
            out |= ref_is(lr, M, p["rollout_is"], p["rollout_is_threshold"])
        if "_rs" in p:
            out |= ref_rs(lr, M, p["_rs"])
        if "_veto" in p:
            out |= ref_veto(lr, M, p["_veto"])
        out |= ref_offpolicy(T, S, M)
        refs.append({f"rollout_corr/{k}": float(v) for k, v in out.items()} | ref_debug(T, S, M))
    compare(framework_table(store, ["a"], "verl", by=by, params=params), refs, by)


@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_verl_actor_micro_batches(data, by, size):
    """dp_actor.py:619-663 + reduce_metrics (verl/utils/metric/utils.py:49-57): per micro-batch, then max for
    names with "max", min for "min", mean otherwise."""
    store, tokens = data
    refs = []
    keys = ["run", "step"] if by == "step" else ["run"]
    for _, g in tokens.group_by(keys, maintain_order=True):
        parts = []
        for _, S, T, M in batches(g, "step"):
            for i in range(0, S.shape[0], size):
                parts.append(ref_offpolicy(T[i:i + size], S[i:i + size], M[i:i + size]))
        ref = {}
        for k in parts[0]:
            xs = np.array([x[k] for x in parts])
            ref[f"rollout_corr/{k}"] = float(xs.max() if "max" in k else xs.min() if "min" in k else xs.mean())
        refs.append(ref)
    compare(framework_table(store, ["a"], "verl-actor", by=by, params={"micro_batch_seqs": str(size)}), refs, by)


# -- NeMo RL @ 7ea279ab: nemo_rl/algorithms/loss/loss_functions.py (LF), grpo.py (G), utils.py -----------------

def n_mean(x, m):  # nemo_rl/algorithms/utils.py:212-224, global normalisation = the batch's tokens
    return (x * m).sum() / (m.sum() + 1e-8)


def n_kl(logprobs, ref, kl_type):  # nemo_rl/algorithms/utils.py:72-90, no clamps (LF:416-437)
    logr = ref - logprobs
    return {"k1": -logr, "k2": logr ** 2 / 2, "k3": np.exp(logr) - 1 - logr}[kl_type]


@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("params", [
    {}, {"kl_type": "k1"}, {"kl_type": "k2", "seq_logprob_error_threshold": "1.4"},
    {"tis_type": "tis", "tis_ratio": "2"}, {"tis_type": "tis", "tis_ratio": "5", "tis_ratio_min": "0.5"},
    {"tis_type": "icepop", "tis_ratio": "5", "tis_ratio_min": "0.5", "seq_logprob_error_threshold": "1.4"},
    {"tis_type": "seq-mask-tis", "tis_ratio": "1.25", "tis_ratio_min": "0.8"}])
def test_nemo(data, by, params):
    store, tokens = data
    p = resolve_params("nemo", params)
    refs = []
    for _, S, T, M, R in batches(tokens, by, with_rewards=True):
        prev, gen = T, S
        lm = np.log(0.5 * np.exp(prev) + 0.5 * np.exp(gen))
        kp = np.exp(prev - lm) - (prev - lm) - 1
        kg = np.exp(gen - lm) - (gen - lm) - 1
        ref = {"token_mult_prob_error": n_mean(np.exp(np.abs(gen - prev) * M), M),
               "gen_kl_error": n_mean(n_kl(gen, prev, p["kl_type"]), M),
               "policy_kl_error": n_mean(n_kl(prev, gen, p["kl_type"]), M),
               "js_divergence_error": n_mean(0.5 * kp + 0.5 * kg, M),
               "approx_entropy": -n_mean(np.exp(prev - gen) * prev, M)}
        w = np.nan_to_num(np.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)   # LF:579-584
        if p["tis_type"] != "none":   # LF:596-660
            lo = 0.0 if params.get("tis_ratio_min") is None else float(params["tis_ratio_min"])
            hi = float(params["tis_ratio"])
            if p["tis_type"] == "tis":
                ref["is_oob_ratio"] = n_mean(((w > hi) | (w < lo)).astype(float), M)
                w = np.clip(w, lo, hi)
            elif p["tis_type"] == "icepop":
                kept = (w >= lo) & (w <= hi)
                ref["is_oob_ratio"] = n_mean((~kept).astype(float), M)
                w = np.where(kept, w, 0.0)
            else:
                geo = np.exp((np.nan_to_num(prev - gen) * M).sum(-1) / (M.sum(-1) + 1e-8))
                kept = ((geo >= lo) & (geo <= hi)).astype(float)
                ref["is_oob_ratio"] = (1.0 - kept).sum() / (M.shape[0] + 1e-8)   # global_valid_seqs
                w = w * kept[:, None]
        ref["sampling_importance_ratio"] = n_mean(w, M)                       # LF:704-708
        err = (np.exp(np.abs(gen - prev) * M) * M).sum(-1) / np.maximum(M.sum(-1), 1)   # G:2552-2566
        ref |= {"max_seq_mult_prob_error": err.max(), "mean_seq_mult_prob_error": err.mean(),
                "min_seq_mult_prob_error": err.min()}
        kept = err
        if p["seq_logprob_error_threshold"] != "none":
            keep = err <= p["seq_logprob_error_threshold"]
            ref["num_masked_seqs"] = float((~keep).sum())
            ref["masked_correct_pct"] = (R[~keep] == 1).sum() / (~keep).sum() if (~keep).any() else 0.0  # G:2597-2602
            kept = err[keep]
        ref |= {"max_seq_mult_prob_error_after_mask": kept.max() if kept.size else 0.0,
                "mean_seq_mult_prob_error_after_mask": kept.mean() if kept.size else 0.0,
                "min_seq_mult_prob_error_after_mask": kept.min() if kept.size else 0.0}
        refs.append({k: float(v) for k, v in ref.items()})
    ours = framework_table(store, ["a"], "nemo", by=by, params=params)
    compare(ours, refs, by)
    if "seq_logprob_error_threshold" in params:   # the data masks some sequences, not all
        assert 0 < ours["num_masked_seqs"].sum() < ours["n_sequences"].sum()
        assert ours["masked_correct_pct"].max() > 0


# -- slime @ 624b824a: slime/backends/megatron_utils/loss.py (L), cp_utils.py (CP) ----------------------------

def ref_mis(train, roll, a: dict):
    """examples/train_infer_mismatch_helper/mis.py:150-307, 383-451@624b824a on one sequence (1-D, every token
    trained): {key: per-token values} as metrics_append collects them."""
    out = {}
    mt, mr = train.mean(), roll.mean()
    n = train.size
    full = lambda v: np.full(n, v)
    out |= {"training_log_ppl": full(-mt), "training_ppl": full(np.exp(-mt)), "rollout_log_ppl": full(-mr),
            "rollout_ppl": full(np.exp(-mr)), "kl": roll - train}
    lr = train - roll
    out["k3_kl"] = np.exp(lr) - lr - 1
    lpd = mr - mt
    out |= {"log_ppl_diff": full(lpd), "log_ppl_abs_diff": full(abs(lpd)), "ppl_ratio": full(np.exp(lpd))}
    rho = np.exp(np.clip(lr, -20, 20))
    out["chi2_token"] = full((rho ** 2).mean() - 1.0)
    out["chi2_seq"] = full(np.exp(2.0 * np.clip(lr.sum(), -20, 20)) - 1.0)
    if not a["use_tis"]:
        return out
    level = lambda lv: lr if lv == "token" else full(lr.sum()) if lv == "sequence" else full(lr.mean())
    U = a["tis_upper_bound"]
    L = a["tis_lower_bound"] if a["tis_lower_bound"] is not None else 1.0 / U
    rs_L = a["rs_lower_bound"] if a["rs_lower_bound"] is not None else L
    rs_U = a["rs_upper_bound"] if a["rs_upper_bound"] is not None else U
    w = np.exp(np.clip(level(a["tis_level"]), -20, 20))
    out["tis_weight_before_bound"] = w
    if a["tis_mode"] == "truncate":
        out["tis_truncate_fraction"] = (w > U).astype(float)
        w = np.clip(w, 0, U)
    elif a["tis_mode"] == "clip":
        out["tis_clip_fraction_low"], out["tis_clip_fraction_high"] = (w < L).astype(float), (w > U).astype(float)
        w = np.clip(w, L, U)
    else:
        out["tis_mask_fraction_low"], out["tis_mask_fraction_high"] = (w < L).astype(float), (w > U).astype(float)
    out["tis_weight_after_bound"] = w
    if a["use_rs"]:
        rw = np.exp(np.clip(level(a["rs_level"]), -20, 20))
        out["rs_mask_fraction_low"], out["rs_mask_fraction_high"] = (rw < rs_L).astype(float), (rw > rs_U).astype(float)
        if a["rs_veto_threshold"] is not None:
            cat = lr < math.log(a["rs_veto_threshold"])
            out["rs_catastrophic_token_fraction"] = cat.astype(float)
            out["rs_catastrophic_seq_fraction"] = full(float(cat.any()))
    out["is_ratio_mean_after_tis_rs"] = w
    out |= {"is_ratio_mean_final": full(w.mean()), "is_ratio_min_final": full(w.min()),
            "is_ratio_max_final": full(w.max())}
    return out


MIS = {"use_tis": True, "tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0,
       "tis_lower_bound": None, "use_rs": False, "rs_level": "token", "rs_lower_bound": None,
       "rs_upper_bound": None, "rs_veto_threshold": None}


@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("params", [
    {}, {"per_token_loss": "true"}, {"tis_clip": "1.5", "tis_clip_low": str(1 / 1.5)},
    {"tis_function": "icepop", "tis_clip": "5", "tis_clip_low": "0.2"},
    {"tis_function": "mis", "use_tis": "false"},
    {"tis_function": "mis"},
    {"tis_function": "mis", "per_token_loss": "true", "tis_mode": "clip", "tis_upper_bound": "5",
     "tis_lower_bound": "0.5", "use_rs": "true", "rs_veto_threshold": "1e-4"},
    {"tis_function": "mis", "tis_mode": "mask", "tis_upper_bound": "3", "use_rs": "true", "rs_level": "geometric",
     "rs_lower_bound": "0.9", "rs_upper_bound": "1.1", "rs_veto_threshold": "1e-3"},
    {"tis_function": "mis", "tis_level": "sequence", "tis_mode": "clip", "tis_upper_bound": "4",
     "tis_lower_bound": "0.3", "use_rs": "true", "rs_level": "token", "rs_lower_bound": "0.5", "rs_upper_bound": "2"},
    {"tis_function": "mis", "tis_level": "geometric", "tis_upper_bound": "1.3", "use_rs": "true",
     "rs_level": "sequence", "rs_lower_bound": "0.2", "rs_upper_bound": "7"},
])
def test_slime(data, by, params):
    store, tokens = data
    p = resolve_params("slime", params)
    refs = []
    for _, S, T, M in batches(tokens, by):
        if p["per_token_loss"]:   # CP:83-89 sum over tokens; train_metric_utils.py:53-55 ÷ Σ clamp_min(n, 1)
            red = lambda x: (x * M).sum() / np.maximum(M.sum(-1), 1).sum()
        else:                     # CP:73-81 per-sample means summed; ÷ the number of samples
            red = lambda x: ((x * M).sum(-1) / np.maximum(M.sum(-1), 1)).sum() / M.shape[0]
        ref = {"train_rollout_logprob_abs_diff": float(red(np.abs(T - S)))}
        if p["tis_function"] == "mis":
            a = dict(MIS)
            for key in MIS:
                if key in params:
                    v = params[key]
                    text = key.endswith("level") or key == "tis_mode"
                    a[key] = v == "true" if v in ("true", "false") else v if text else float(v)
            per = [ref_mis(T[i, M[i] > 0], S[i, M[i] > 0], a) for i in range(M.shape[0])]
            for key in per[0]:
                X = np.zeros_like(M)
                for i, vals in enumerate(per):
                    X[i, :vals[key].size] = vals[key]
                ref[f"mis_{key}"] = float(red(X))
        else:
            tis = np.exp(T - S)
            lo, hi = float(params.get("tis_clip_low", 0.0)), float(params.get("tis_clip", 2.0))
            if p["tis_function"] == "vanilla":   # L:884-905
                w = np.clip(tis, lo, hi)
            else:                                # L:908-931
                w = np.where((tis >= lo) & (tis <= hi), tis, 0.0)
            ref |= {"tis": float(red(tis)), "tis_clipfrac": float(red((w != tis).astype(float))),
                    "tis_abs": float(red(np.abs(tis - 1)))}
        refs.append(ref)
    compare(framework_table(store, ["a"], "slime", by=by, params=params), refs, by)


# -- prime-rl @ 559b4477: loss.py:100-106, trainer/utils.py:245-281 -------------------------------------------

@pytest.mark.parametrize("by", ["step", "run"])
def test_primerl(data, by):
    store, tokens = data
    refs = []
    for _, S, T, M in batches(tokens, by):
        lr = (T - S)[M > 0]
        k = np.exp(lr) - lr - 1
        refs.append({"mismatch_kl/all/mean": k.mean(), "mismatch_kl/all/median": float(np.sort(k)[(k.size - 1) // 2]),
                     "mismatch_kl/all/std": k.std(ddof=1), "mismatch_kl/all/min": k.min(),
                     "mismatch_kl/all/max": k.max()})
    compare(framework_table(store, ["a"], "prime-rl", by=by), refs, by)


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    from helpers.data import metrics_load, metrics_make_routing
    tokens = make_tokens(13, False, steps=(0, 1), n_seq=4)
    routing = metrics_make_routing(tokens, 5, layers=3, k=2, n_experts=8)
    store = metrics_load(tmp_path_factory.mktemp("fw_routed"), tokens, routing)
    yield store, tokens, routing
    store.close()


def ref_max_vio(counts: np.ndarray, k: int, avoid: bool) -> float:  # prime-rl model.py:561-590
    t = np.sort(counts)[::-1]
    t = t[k:] if avoid else t
    return (t.max() - t.mean()) / t.mean()


@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("params", [{}, {"try_to_avoid_padding_experts": "false"}, {"num_experts": "12"},
                                    {"load_side": "sampler", "num_experts": "10"}])
def test_primerl_max_vio(routed, by, params):
    store, _, routing = routed
    p = resolve_params("prime-rl", params)
    side = "trainer_experts" if p["load_side"] == "trainer" else "sampler_experts"
    n_exp = p["num_experts"] or 1 + max(max(x) for x in routing[side].to_list())
    per = {}
    for (step, layer), g in routing.group_by(["step", "layer"]):
        counts = np.bincount(np.concatenate(g[side].to_list()), minlength=n_exp).astype(float)
        per[(step, layer)] = ref_max_vio(counts, 2, p["try_to_avoid_padding_experts"])
    ours = framework_table(store, ["a"], "prime-rl", by=by, params=params)
    for row in ours.iter_rows(named=True):
        xs = np.array([v for (st, _), v in sorted(per.items()) if by == "run" or st == row["step"]])
        ref = {"max_vio/mean": xs.mean(), "max_vio/median": np.sort(xs)[(xs.size - 1) // 2],
               "max_vio/std": xs.std(ddof=1), "max_vio/min": xs.min(), "max_vio/max": xs.max()}
        for name, value in ref.items():
            np.testing.assert_allclose(row[name], value, rtol=RTOL, atol=ATOL, err_msg=name)


def test_sequences_split_over_files(data, tmp_path):
    """A sequence whose tokens came in two files has two summary rows: merged, every view gives the numbers of
    the single-file load (one file holds the first half of each sequence of steps 0 and 2, the other the rest)."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    one, tokens = data
    half = (pl.col("pos") < pl.col("pos").max().over("step", "sample") // 2) & (pl.col("step") != 1)
    tokens.filter(half).write_parquet(tmp_path / "a.parquet")
    tokens.filter(~half).write_parquet(tmp_path / "b.parquet")
    two = Store(tmp_path / "t.duckdb")
    assert {o.status for o in ingest_paths(two, [tmp_path / "a.parquet", tmp_path / "b.parquet"])} == {"loaded"}
    assert two.scalar("SELECT count(*) FROM summary_seq") > two.scalar(
        "SELECT count(DISTINCT (step, sample)) FROM summary_seq")
    for name, params in (("verl", {"rollout_rs": "seq_max_k3,token_k2", "rollout_rs_threshold": "3,0.3"}),
                         ("verl-actor", {}), ("nemo", {"tis_type": "tis", "tis_ratio": "5", "tis_ratio_min": "0.2"}),
                         ("slime", {"tis_function": "mis", "use_rs": "true", "rs_veto_threshold": "1e-4"})):
        for by in ("step", "run"):
            a_, b_ = (framework_table(s_, ["a"], name, by=by, params=params) for s_ in (one, two))
            assert a_.columns == b_.columns and a_.height == b_.height
            for col in a_.columns[1:]:
                np.testing.assert_allclose(b_[col].to_numpy().astype(float), a_[col].to_numpy().astype(float),
                                           rtol=1e-12, atol=1e-13, err_msg=f"{name} {by} {col}")
    two.close()


def test_several_runs(data, tmp_path):
    """Two runs in one database: each run's rows equal those of the run alone, in run-name order."""
    from helpers.data import metrics_load
    _, tokens = data
    other = make_tokens(31, False, steps=(0, 2), n_seq=3).with_columns(run=pl.lit("B"))
    both = metrics_load(tmp_path / "both", pl.concat([tokens, other]))
    alone = metrics_load(tmp_path / "alone", other)
    for name, params in (("verl", {"rollout_token_veto_threshold": "1e-4"}), ("nemo", {}), ("slime", {}),
                         ("verl-actor", {}), ("prime-rl", {})):
        for by in ("step", "run"):
            got = framework_table(both, ["a", "B"], name, by=by, params=params)
            assert got["run"].to_list()[0] == "B" and got["run"].to_list()[-1] == "a"
            for run, store in (("B", alone), ("a", data[0])):
                want = framework_table(store, [run], name, by=by, params=params)
                mine = got.filter(pl.col("run") == run)
                assert mine.columns == want.columns and mine.height == want.height
                for col in want.columns[1:]:
                    np.testing.assert_allclose(mine[col].to_numpy().astype(float), want[col].to_numpy().astype(float),
                                               rtol=1e-12, atol=1e-13, err_msg=f"{name} {by} {run} {col}")
    both.close()
    alone.close()


def test_max_vio_refuses_fewer_experts_than_routed(routed):
    store, _, _ = routed
    with pytest.raises(ValueError, match="num_experts 4: run 'a' routes to expert 7"):
        framework_table(store, ["a"], "prime-rl", params={"num_experts": "4"})


def test_routing_rows_change_nothing(routed, tmp_path):
    """A routing file adds summary rows without tokens (null minima and maxima) to each sequence: the views of
    the tokens are those of a load without routing."""
    from helpers.data import metrics_load
    store, tokens, _ = routed
    plain = metrics_load(tmp_path / "plain", tokens)
    for name in ("verl", "nemo", "slime", "verl-actor"):
        a_, b_ = (framework_table(s_, ["a"], name, by="step") for s_ in (store, plain))
        assert a_.columns == b_.columns
        for col in a_.columns[1:]:
            np.testing.assert_allclose(a_[col].to_numpy().astype(float), b_[col].to_numpy().astype(float),
                                       rtol=1e-12, atol=1e-13, err_msg=f"{name} {col}")
    plain.close()


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown framework 'openrlhf'"):
        resolve_params("openrlhf")
    with pytest.raises(ValueError, match="no parameter 'C'"):
        resolve_params("verl", {"C": "2"})
    with pytest.raises(ValueError, match="token_k4"):
        resolve_params("verl", {"rollout_rs": "token_k4", "rollout_rs_threshold": "2"})
    with pytest.raises(ValueError, match="one upper bound"):
        resolve_params("verl", {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.1_2"})
    with pytest.raises(ValueError, match="cap must be one of"):
        framework_table(None, ["a"], "verl", params={"rollout_is_threshold": "2.5"})
    with pytest.raises(ValueError, match="rollout_token_veto_threshold must be positive"):
        resolve_params("verl", {"rollout_token_veto_threshold": "0"})
    with pytest.raises(ValueError, match="tis_ratio: the summaries' ratio bands answer a token-level bound"):
        resolve_params("nemo", {"tis_type": "tis", "tis_ratio": "2.5"})
    with pytest.raises(ValueError, match="icepop needs tis_ratio_min"):
        resolve_params("nemo", {"tis_type": "icepop"})
    resolve_params("nemo", {"tis_type": "seq-mask-tis", "tis_ratio": "1.002", "tis_ratio_min": "0.999"})  # any
    with pytest.raises(ValueError, match="rs_level token: the summaries' ratio bands answer one pair"):
        resolve_params("slime", {"tis_function": "mis", "use_rs": "true", "rs_upper_bound": "5"})
    with pytest.raises(ValueError, match="tis_function: expected one of vanilla, icepop, mis"):
        resolve_params("slime", {"tis_function": "gspo"})
    with pytest.raises(ValueError, match="load_side: trainer or sampler"):
        resolve_params("prime-rl", {"load_side": "both"})


def test_cli_as_and_its_errors(metrics_store_from, capsys):
    from analysis.__main__ import main
    store = metrics_store_from(make_tokens(5, False, steps=(0,), n_seq=3))
    db = str(store.path)
    store.close()
    assert main(["metrics", "--db", db, "--run", "a", "--by", "run", "--as", "slime",
                 "--param", "per_token_loss=true"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "run,n_tokens,n_sequences,train_rollout_logprob_abs_diff,tis,tis_clipfrac,tis_abs")
    assert main(["metrics", "--db", db, "--param", "x=1"]) == 1
    assert "--param needs --as FRAMEWORK" in capsys.readouterr().err
    assert main(["metrics", "--db", db, "--as", "nemo", "--param", "kl_type=k4"]) == 1
    assert "kl_type: expected k1, k2 or k3" in capsys.readouterr().err
    assert main(["metrics", "--db", db, "--as", "verl", "--by", "layer"]) == 1
    assert "--as takes --by step or --by run" in capsys.readouterr().err
    # chained rejection options and their thresholds, comma-separated as verl's config spells them
    assert main(["metrics", "--db", db, "--run", "a", "--by", "run", "--as", "verl", "--param", "rollout_is=none",
                 "--param", "rollout_rs=token_k2,seq_mean_k1", "--param", "rollout_rs_threshold=0.3,0.97_1.03"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split(",")
    assert "rollout_corr/rollout_rs_token_k2_mean" in header and "rollout_corr/rollout_rs_masked_fraction" in header
    assert main(["metrics", "--db", db, "--as", "prime-rl", "--param", "num_experts=x"]) == 1
    assert "--param num_experts=x" in capsys.readouterr().err


# -- our own version 3 columns (METRICS.md "More token columns"), r = e^clamp(Δ, ±20), plain means ------------

@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("cap", [2.0, 1.5])
def test_our_v3_columns(data, by, cap):
    from analysis.metrics.frameworks.ours import V3_COLUMNS, more_token_columns
    store, tokens = data
    refs = []
    for _, S, T, M in batches(tokens, by):
        n = M.sum(-1)
        mb = M > 0
        d = (T - S)[mb]
        cd = np.clip(d, -20, 20)
        r = np.exp(cd)
        w = np.clip(r, 1 / cap, cap)
        k3 = r - 1 - d
        seq_mpe = (np.exp(np.abs(np.clip(T - S, -20, 20))) * M).sum(-1) / n
        refs.append({"training_ppl": np.exp(-(T * M).sum(-1) / n).mean(),
                     "sampler_ppl": np.exp(-(S * M).sum(-1) / n).mean(),
                     "log_ppl_abs_diff": np.abs(((S - T) * M).sum(-1) / n).mean(),
                     "ratio_std_clamped": w.std(), "ratio_abs_dev_mean": np.abs(r - 1).mean(),
                     "js_divergence": np.log(np.cosh(d / 2)).mean(),
                     "seq_mult_prob_error_max": seq_mpe.max(), "seq_mult_prob_error_mean": seq_mpe.mean(),
                     "seq_mult_prob_error_min": seq_mpe.min(), "kl_k3_std": k3.std(ddof=1),
                     "kl_k3_median": float(np.median(k3))})
    ours = more_token_columns(store, ["a"], by=by, cap=cap)
    assert ours.columns == (["run", "step"] if by == "step" else ["run"]) + list(V3_COLUMNS)
    compare(ours, refs, by)
