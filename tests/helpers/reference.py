"""Brute-force numpy references for the metrics of METRICS.md, written from the definitions (loops over
per-token arrays, no SQL), and the comparisons of a metrics frame with them. tests/test_metrics_reference.py
checks the references themselves on hand-computed numbers."""
from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import polars as pl

RTOL = 1e-12
ATOL = 1e-15


def ratio(d: np.ndarray) -> np.ndarray:
    return np.exp(np.clip(d, -20.0, 20.0))


def ref_token_metrics(s: np.ndarray, t: np.ndarray, seq: np.ndarray, cap: float = 2.0, clip: float = 0.2) -> dict:
    """METRICS.md token metrics of one group; `seq` labels each token's sequence."""
    s, t = np.asarray(s, float), np.asarray(t, float)
    d = t - s
    r = ratio(d)
    ps, pt = np.exp(s), np.exp(t)
    n = len(d)
    if n < 2 or np.all(ps == ps[0]) or np.all(pt == pt[0]):
        pearson = None
    else:
        pearson = float(np.corrcoef(pt, ps)[0, 1])
    w = np.clip(r, 1.0 / cap, cap)
    out = {
        "n_tokens": n,
        "kl_k1": float(np.mean(s - t)),
        "kl_k2": float(np.mean(0.5 * d ** 2)),
        "kl_k3": float(np.mean(r - 1.0 - d)),
        "log_ratio_abs_mean": float(np.mean(np.abs(d))),
        "log_ratio_abs_max": float(np.max(np.abs(d))),
        "prob_abs_diff_mean": float(np.mean(np.abs(pt - ps))),
        "prob_abs_diff_max": float(np.max(np.abs(pt - ps))),
        "prob_pearson": pearson,
        "ratio_mean": float(np.mean(r)),
        "ratio_std": float(np.std(r)),
        "ratio_min": float(np.min(r)),
        "ratio_max": float(np.max(r)),
        "chi2_token": float(np.mean(r ** 2) - 1.0),
        "ratio_frac_high": float(np.mean(r > cap)),
        "ratio_frac_low": float(np.mean(r < 1.0 / cap)),
        "clip_frac": float(np.mean(np.abs(r - 1.0) > clip)),
        "ess": float(1.0 / np.mean((w / np.mean(w)) ** 2)),
        "mult_prob_error": float(np.mean(np.exp(np.abs(np.clip(d, -20.0, 20.0))))),
        "kl_k3_reverse": float(np.mean(1.0 / r - 1.0 + d)),
    }
    ppl, chi2, geo, abs_max = [], [], [], 0.0
    seq_list = np.asarray(seq).tolist()
    labels = list(dict.fromkeys(seq_list))
    for lab in labels:
        m = np.array([x == lab for x in seq_list])
        ppl.append(math.exp(np.mean(s[m]) - np.mean(t[m])))
        total = float(np.sum(d[m]))
        chi2.append(math.exp(2.0 * min(max(total, -20.0), 20.0)) - 1.0)
        abs_max = max(abs_max, abs(total))
        geo.append(math.exp(float(np.mean(d[m]))))
    out.update(n_sequences=len(labels), ppl_ratio=float(np.mean(ppl)), chi2_seq=float(np.mean(chi2)),
               seq_log_ratio_abs_max=abs_max, seq_geo_ratio_mean=float(np.mean(geo)),
               seq_geo_ratio_min=min(geo), seq_geo_ratio_max=max(geo))
    return out


def ref_grouped(tokens: pl.DataFrame, keys: list[str], cap: float = 2.0, clip: float = 0.2) -> dict[tuple, dict]:
    """ref_token_metrics per group of `keys`; sequences are (run, step, sample)."""
    out = {}
    for key, g in tokens.group_by(keys, maintain_order=True):
        seq = np.array([f"{a}|{b}|{c}" for a, b, c in zip(g["run"], g["step"], g["sample"])])
        out[tuple(key)] = ref_token_metrics(g["sampler_logprob"].to_numpy(), g["trainer_logprob"].to_numpy(),
                                            seq, cap, clip)
    return out


def assert_close(got, want, what=""):
    if want is None:
        assert got is None, f"{what}: expected null, got {got}"
        return
    assert got is not None, f"{what}: expected {want}, got null"
    assert math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL), f"{what}: got {got!r}, expected {want!r}"


def assert_frame_matches(df: pl.DataFrame, ref: dict[tuple, dict], keys: list[str], columns=None):
    assert df.height == len(ref), (df.height, len(ref))
    for row in df.iter_rows(named=True):
        key = tuple(row[k] for k in keys)
        want = ref[key]
        for col in columns or want:
            assert_close(row[col], want[col], f"{key} {col}")


# -- routing references ---------------------------------------------------------------------------------

def ref_routing_rows(routing: pl.DataFrame):
    """Per routing row: (run, step, sample, pos, layer, has_trainer, flip, top1_flip, overlap)."""
    rows = []
    for r in routing.iter_rows(named=True):
        S = r["sampler_experts"]
        T = r.get("trainer_experts")
        if T is None:
            rows.append((r["run"], r["step"], r["sample"], r["pos"], r["layer"], False, None, None, None))
        else:
            rows.append((r["run"], r["step"], r["sample"], r["pos"], r["layer"], True, set(S) != set(T),
                         S[0] != T[0], len(set(S) & set(T)) / len(S)))
    return rows


def ref_max_vio(counts: Counter) -> float | None:
    seen = [c for c in counts.values() if c > 0]
    if not seen:
        return None
    mean = sum(seen) / len(seen)
    return (max(seen) - mean) / mean


def ref_routing_by_layer(routing: pl.DataFrame) -> dict[tuple, dict]:
    groups: dict[tuple, list] = defaultdict(list)
    loads: dict[tuple, tuple[Counter, Counter]] = defaultdict(lambda: (Counter(), Counter()))
    for r in routing.iter_rows(named=True):
        key = (r["run"], r["step"], r["layer"])
        loads[key][0].update(r["sampler_experts"])
        if r.get("trainer_experts") is not None:
            loads[key][1].update(r["trainer_experts"])
    for row in ref_routing_rows(routing):
        groups[(row[0], row[1], row[4])].append(row)
    out = {}
    for key, rows in groups.items():
        both = [x for x in rows if x[5]]
        out[key] = {
            "n_tokens": len(both),
            "flip_rate": float(np.mean([x[6] for x in both])) if both else None,
            "top1_flip_rate": float(np.mean([x[7] for x in both])) if both else None,
            "overlap": float(np.mean([x[8] for x in both])) if both else None,
            "load_max_vio_sampler": ref_max_vio(loads[key][0]),
            "load_max_vio_trainer": ref_max_vio(loads[key][1]),
        }
    return out


def ref_token_flips(routing: pl.DataFrame) -> dict[tuple, tuple[bool, int, int | None]]:
    """Per token with trainer routing: (any flip, number of flipped layers, first flipped layer)."""
    per: dict[tuple, list[tuple[int, bool]]] = defaultdict(list)
    for row in ref_routing_rows(routing):
        if row[5]:
            per[row[:4]].append((row[4], row[6]))
    out = {}
    for key, layers in per.items():
        flipped = sorted(layer for layer, f in layers if f)
        out[key] = (bool(flipped), len(flipped), flipped[0] if flipped else None)
    return out


def assert_frames_close(x: pl.DataFrame, y: pl.DataFrame) -> None:
    """Same columns, keys and counts; floats equal at rel 1e-12 (summation order may differ)."""
    assert x.columns == y.columns and x.height == y.height
    for col in x.columns:
        if x[col].dtype == pl.Float64:
            for u, v in zip(x[col].to_list(), y[col].to_list()):
                assert (u is None and v is None) or math.isclose(u, v, rel_tol=RTOL, abs_tol=1e-16), col
        else:
            assert x[col].to_list() == y[col].to_list(), col


def ref_residual(d, pos, sample, segment, q: float = 0.125) -> dict:
    """METRICS.md v3 "Residual signatures" of one group, from the definitions, token by token. `d`: Δ = t − s of
    the group's tokens; `pos`, `sample`: their position and sequence (any hashable label, e.g. (step, sample));
    `segment`: their turn index, or None per token without one. k3 = r − 1 − Δ as expm1(clamp(Δ)) − Δ (no
    cancellation where r ≈ 1). A segment's first token: the least pos among the sequence's tokens of that segment.
    """
    k3_all, k3_first = [], []
    nonzero = lattice = 0
    firsts: dict = {}
    for i, x in enumerate(d):
        x = float(x)
        k3 = math.expm1(min(max(x, -20.0), 20.0)) - x
        k3_all.append(k3)
        k3_first.append(k3 if pos[i] == 0 else 0.0)
        if x != 0.0:
            nonzero += 1
            lattice += abs(x / q - round(x / q)) < 1e-6
        if segment[i] is not None:
            key = (sample[i], segment[i])
            firsts[key] = min(firsts.get(key, pos[i]), pos[i])
    at_first = [segment[i] is not None and firsts[(sample[i], segment[i])] == pos[i] for i in range(len(d))]
    rest = [segment[i] is not None and not at_first[i] for i in range(len(d))]
    low = [float(x) < -10.0 for x in d]

    def share(where):
        n = sum(where)
        return sum(w and lo for w, lo in zip(where, low)) / n if n else None
    total = math.fsum(k3_all)
    return {"first_token_kl_share": math.fsum(k3_first) / total if total > 0 else None,
            "lattice_share_q": lattice / nonzero if nonzero else None,
            "boundary_low_share": share(at_first), "elsewhere_low_share": share(rest)}
