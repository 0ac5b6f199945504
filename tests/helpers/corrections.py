"""A numpy reference for analysis.metrics.corrections written from METRICS.md (Corrections): loops over sequences
and tokens, per group; the parameter choices the tests sweep; the comparison of a corrections frame with it."""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl

from helpers.reference import assert_close

DEFAULTS = {"tis": {"C": 2.0, "lo": 0.0}, "icepop": {"alpha": 0.5, "beta": 5.0}, "geo_rs": {"lo": 0.999, "hi": 1.001},
            "seq_rs": {"lo": 0.5, "hi": 2.0}, "veto": {"tau": 1e-4},
            "verl_rs": {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001"}}
CHOICES = [("tis", {}), ("tis", {"C": 1.3}), ("tis", {"C": 5.0, "lo": 0.8}), ("icepop", {}),
           ("icepop", {"alpha": 0.8, "beta": 1.25}),
           ("geo_rs", {}), ("geo_rs", {"lo": 0.95, "hi": 1.05}), ("seq_rs", {}), ("seq_rs", {"lo": 0.2, "hi": 3.0}),
           ("veto", {}), ("veto", {"tau": 0.05}),
           ("verl_rs", {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.97_1.03"}),
           ("verl_rs", {"rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "0.3_3,6"}),
           ("verl_rs", {"rollout_rs": "token_k2,token_k3,seq_max_k3,seq_mean_k3",
                        "rollout_rs_threshold": "0.2,0.15,8,0.03"}),
           ("verl_rs", {"rollout_rs": "seq_sum_k1,seq_max_k2,seq_sum_k3", "rollout_rs_threshold": "2,10,4"})]


def ref_verl_rs(d: np.ndarray, rollout_rs: str, spec: str) -> np.ndarray:
    """verl's compute_rollout_rejection_mask (verl/trainer/ppo/rollout_corr_helper.py:156-372@b178a3cd) on one
    sequence: the masked tokens (some option rejects the token or its sequence)."""
    opts = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    specs = [x.strip() for x in spec.split(",") if x.strip()]
    specs = specs * len(opts) if len(specs) == 1 else specs
    c = np.clip(d, -20, 20)
    terms = {"k1": -c, "k2": 0.5 * c ** 2, "k3": np.exp(c) - 1.0 - c}
    keep = np.ones(len(d), bool)
    for o, sp in zip(opts, specs):
        kind, k = o.rsplit("_", 1)
        if k == "k1":
            lo, hi = (float(x) for x in sp.split("_")) if "_" in sp else (1.0 / float(sp), float(sp))
            low, up = math.log(lo), math.log(hi)
        else:
            low, up = 0.0, float(sp)
        x = terms[k]
        stat = x if kind == "token" else {"seq_sum": x.sum(), "seq_mean": x.sum() / (len(x) + 1e-8),
                                           "seq_max": x.max()}[kind]
        ok = (stat >= low) & (stat <= up) if k == "k1" else stat <= up
        keep &= np.broadcast_to(ok, keep.shape)
    return ~keep


def ref_corrections(tokens: pl.DataFrame, seqs: dict, method: str, params: dict, keys: list[str]) -> dict:
    """Per group of `keys`: every Corrections column, by loops over sequences and tokens."""
    p = {**DEFAULTS[method], **params}
    out = {}
    for key, g in tokens.group_by(keys, maintain_order=True):
        masked_tok, weight, w_ess_kept, n_seq, seq_masked = [], [], [], 0, []
        adv_pos, adv_neg = [0, 0], [0, 0]  # [masked tokens, tokens]
        for (run, step, sample), q in g.group_by(["run", "step", "sample"], maintain_order=True):
            d = q["trainer_logprob"].to_numpy() - q["sampler_logprob"].to_numpy()
            r = np.exp(np.clip(d, -20, 20))
            if method == "tis":
                m = np.zeros(len(d), bool)
            elif method == "icepop":
                m = (r < p["alpha"]) | (r > p["beta"])
            else:
                if method == "geo_rs":
                    g_ = math.exp(float(np.mean(d)))
                    out_ = g_ < p["lo"] or g_ > p["hi"]
                elif method == "verl_rs":
                    out_ = None
                elif method == "seq_rs":
                    x = math.exp(min(max(float(np.sum(d)), -20.0), 20.0))
                    out_ = x < p["lo"] or x > p["hi"]
                else:
                    out_ = bool(np.any(r < p["tau"]))
                m = ref_verl_rs(d, p["rollout_rs"], p["rollout_rs_threshold"]) if method == "verl_rs" \
                    else np.full(len(d), out_)
            masked_tok += list(m)
            if method == "tis":
                weight += list(np.clip(r, p["lo"], p["C"]))
                w_ess_kept += list(np.clip(r, p["lo"], p["C"]))
            else:
                weight += list(np.where(m, 0.0, r))
                w_ess_kept += list(np.clip(r[~m], 0.5, 2.0))
            n_seq += 1
            reward, adv = seqs[(run, step, sample)]
            seq_masked.append((bool(m.any()), reward))
            if adv is not None and adv > 0:
                adv_pos[0] += int(m.sum()); adv_pos[1] += len(m)
            if adv is not None and adv < 0:
                adv_neg[0] += int(m.sum()); adv_neg[1] += len(m)
        n = len(masked_tok)
        w = np.array(w_ess_kept)
        mr = [rw for sm, rw in seq_masked if sm and rw is not None]
        kr = [rw for sm, rw in seq_masked if not sm and rw is not None]
        out[tuple(key)] = {
            "n_tokens": n, "n_sequences": n_seq,
            "masked_token_frac": sum(masked_tok) / n,
            "masked_seq_frac": sum(sm for sm, _ in seq_masked) / n_seq,
            "weight_mean": float(np.mean(weight)),
            "ess_after": float(w.sum() ** 2 / (len(w) * np.sum(w * w))) if len(w) else None,
            "masked_reward_mean": float(np.mean(mr)) if mr else None,
            "kept_reward_mean": float(np.mean(kr)) if kr else None,
            "masked_adv_pos_frac": adv_pos[0] / adv_pos[1] if adv_pos[1] else None,
            "masked_adv_neg_frac": adv_neg[0] / adv_neg[1] if adv_neg[1] else None,
        }
    return out


def check(df: pl.DataFrame, ref: dict, keys: list[str], method: str, params: dict):
    assert df.height == len(ref)
    assert set(df["method"]) == {method}
    assert json.loads(df["params"][0]) == {**DEFAULTS[method], **params}
    assert list(json.loads(df["params"][0])) == list(DEFAULTS[method])  # METRICS.md's order
    for row in df.iter_rows(named=True):
        key = tuple(row[k] for k in keys)
        for col, want in ref[key].items():
            assert_close(row[col], want, f"{method} {params} {key} {col}")


def seq_table_keys(tokens):
    return set(tokens.select("run", "step", "sample").unique().iter_rows())
