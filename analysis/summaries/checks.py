"""The logging checks: whether the logged log-probs are the ones the tokens were sampled from, and aligned.

Three facts hold for any honest log, whatever the precision or staleness (METRICS.md "Logging checks"):

- Sampler honesty: tokens drawn from the distribution whose log-probs the sampler logged give
  E_s[r] = Σ_{x in the sampler's support} π_t(x) = 1 when both sides have the same support. Mean r below 1 by
  more than its standard error measures the trainer's mass outside the sampler's support: log-probs taken after
  top-k / top-p truncation on one side only.
- Temperature: within one position t = T·s + c when one side's logits were divided by a temperature T and the
  other's were not, so the least-squares slope of t on s is 1 for honest logs and near T otherwise (pooled over
  positions, whose constants c differ, it lies between 1 and T). A policy update between the sampler's weights
  and the trainer's changes the slope too (RL updates sharpen: the lab's bf16-async preset, one Adam step of
  lr 1e-3, gives 0.82), so the slope is not judged where tokens are stale (trainer version > sampler version).
- Alignment: t_i against s_{i±1} (neighbours in a sequence) is far apart for honest logs; a log whose trainer
  side is shifted by one position has mean |t_i − s_{i±1}| far below mean |t_i − s_i|.

This module holds the rules (thresholds both statistical and practical, so that a healthy run of 10^9 tokens
does not fire on a 1e-5 bias), their evaluation on a group's check values (`verdict`, used by the findings and
by DriftLogger's warning), the same values from a step's sums in Python (`values`, for DriftLogger; finalise.py
has them in SQL), and the sums of a stream of token batches (`CheckSums`, ingest's streamed summaries).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.summaries import schema as S

Z_MIN = 4.0               # standard errors a deviation must reach
MISSING_MASS_MIN = 0.002  # and mean r at least 0.2 % below 1 (truncation)
SLOPE_BAND = (0.95, 1.05)  # and the slope outside this band (temperature)
SHIFT_RATIO = 0.25        # position shift: mean |Δ| at lag −1 or +1 below 25 % of the one at lag 0
SHIFT_FLOOR = 0.05        # and mean |Δ| at lag 0 of at least 0.05 nats (below it, nothing to misread)
MIN_TOKENS = 100          # no verdict on fewer tokens

RULES = {
    "position_shift": f"mean |t_i − s_(i−1)| or mean |t_i − s_(i+1)| over neighbouring tokens of a sequence is below "
                      f"{SHIFT_RATIO:.0%} of mean |t_i − s_i| (≥ {SHIFT_FLOOR:g} nats; ≥ {MIN_TOKENS} tokens): the two "
                      "sides' log-probs are aligned one position apart; tested first, since then every other number "
                      "compares different tokens",
    "sampling_params": f"truncation: mean r is below 1 by ≥ {Z_MIN:g} standard errors and by ≥ {MISSING_MASS_MIN:.1%} "
                       f"(honest logs have E[r] = 1 at any precision or staleness); temperature: the least-squares "
                       f"slope of t on s lies outside [{SLOPE_BAND[0]:g}, {SLOPE_BAND[1]:g}] by ≥ {Z_MIN:g} standard "
                       f"errors (honest logs: 1), judged only without stale tokens (a policy update moves the slope "
                       f"too); ≥ {MIN_TOKENS} tokens; not reported when position_shift holds",
}

ACTIONS = {
    "position_shift": ("Fix the alignment of the trainer's log-probs before reading any drift number: the logits at "
                       "position i score token i + 1, so gather log_softmax(logits[:, :-1]) at tokens[:, 1:] and "
                       "slice the response from the same offset on both sides (check the response mask too)",
                       "the causal-LM convention, as in Hugging Face transformers' ForCausalLMLoss (logits[..., :-1] "
                       "against labels[..., 1:])"),
    "sampling_params": ("Log the sampler's raw log-probs, or apply the same processing on the trainer: vLLM "
                        "--logprobs-mode raw_logprobs (the default) rather than processed_logprobs; divide the "
                        "trainer's logits by the sampling temperature when the sampler's are; keep the sampler's "
                        "top-p / top-k support mask for the trainer (DeepSeek-V3.2) or log before truncation",
                        "verl #6240; ms-swift #8442, #8427; vime #69; miles #68; open-instruct #1678; TRL #4163; "
                        "marin #1879; vLLM --logprobs-mode"),
}


@dataclass(frozen=True)
class Verdict:
    """Which checks hold for a group, with the numbers behind each (None: the check does not hold)."""
    position_shift: dict | None = None
    truncation: dict | None = None
    temperature: dict | None = None

    @property
    def sampling_params(self) -> bool:
        return self.position_shift is None and (self.truncation is not None or self.temperature is not None)

    @property
    def holds(self) -> bool:
        return self.position_shift is not None or self.sampling_params

    def line(self) -> str:
        """One line naming the likely setting (DriftLogger's warning, the Data page's banner)."""
        if self.position_shift is not None:
            p = self.position_shift
            best = p["lag_abs_delta_prev" if p["lag"] < 0 else "lag_abs_delta_next"]
            return (f"the trainer's log-probs look shifted by one position against the sampler's (mean |Δ| "
                    f"{best:.3g} at lag {p['lag']:+d} vs {p['log_ratio_abs_mean']:.3g} at lag 0): check the gather "
                    "of logits[:, :-1] against tokens[:, 1:] and the response slice")
        parts = []
        if self.truncation is not None:
            parts.append(f"mean r = {self.truncation['ratio_mean']:.4f} ± {self.truncation['ratio_mean_se']:.2g}: "
                         f"{self.truncation['missing_mass']:.2%} of the trainer's mass lies outside the sampler's "
                         "support (top-p / top-k applied to the sampler's log-probs only)")
        if self.temperature is not None:
            parts.append(f"slope of t on s = {self.temperature['logprob_slope']:.3f}: a temperature "
                         f"≈ {self.temperature['implied_temperature']:.2f} applied to one side's logits only")
        return ("the logged log-probs look processed by sampling parameters: " + "; ".join(parts)
                + " (vLLM --logprobs-mode processed_logprobs? log raw log-probs or process both sides alike)")


def describe(case: str, v: dict) -> tuple[str, str]:
    """(what the evidence says, what to change) for a sub-case of sampling_params: "truncation" or "temperature"
    with the numbers `verdict` gives it."""
    if case == "truncation":
        return (f"mean r = {v['ratio_mean']:.4f} ± {v['ratio_mean_se']:.2g} (1 for honest logs): "
                f"{v['missing_mass']:.2%} of the trainer's probability lies outside the sampler's support, as top-p / "
                "top-k truncation of the sampler's log-probs alone leaves it",
                "log the sampler's log-probs before top-p / top-k (vLLM --logprobs-mode raw_logprobs, the default), "
                "or apply the same support mask on the trainer (DeepSeek-V3.2 keeps it)")
    if case == "temperature":
        return (f"t ≈ {v['logprob_slope']:.3f}·s + c (slope ± {v['logprob_slope_se']:.2g}; 1 for honest logs): a "
                f"sampling temperature ≈ {v['implied_temperature']:.2f} in the sampler's log-probs only (or "
                f"≈ {v['trainer_side_temperature']:.2f} dividing the trainer's logits only; pooled over positions the "
                "slope lies between 1 and the temperature)",
                "divide the trainer's logits by the sampling temperature, or log the sampler's raw log-probs (vLLM "
                "--logprobs-mode raw_logprobs)")
    raise ValueError(f"case: expected 'truncation' or 'temperature', got {case!r}")


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def verdict(v: dict, stale: bool = False) -> Verdict:
    """The checks on one group's values: n_tokens, log_ratio_abs_mean and finalise.CHECK_COLUMNS (null values
    make a check not hold: a database made before the check sums gives no finding from them). stale: some tokens
    have trainer version > sampler version (the temperature check is then not judged)."""
    n = v.get("n_tokens") or 0
    if n < MIN_TOKENS:
        return Verdict()
    lag0 = _num(v.get("log_ratio_abs_mean"))
    prev, nxt = _num(v.get("lag_abs_delta_prev")), _num(v.get("lag_abs_delta_next"))
    if lag0 is not None and lag0 >= SHIFT_FLOOR and prev is not None and nxt is not None:
        best, lag = (prev, -1) if prev <= nxt else (nxt, 1)
        if best < SHIFT_RATIO * lag0:
            return Verdict(position_shift={"lag_abs_delta_prev": prev, "lag_abs_delta_next": nxt,
                                           "log_ratio_abs_mean": lag0, "lag": lag, "ratio": best / lag0})
    truncation = temperature = None
    mm, se = _num(v.get("missing_mass")), _num(v.get("ratio_mean_se"))
    if mm is not None and se is not None and mm >= MISSING_MASS_MIN and mm >= Z_MIN * se:
        truncation = {"ratio_mean": 1.0 - mm, "ratio_mean_se": se, "missing_mass": mm,
                      "z": mm / se if se > 0 else None}
    slope, sse = _num(v.get("logprob_slope")), _num(v.get("logprob_slope_se"))
    if not stale and slope is not None and sse is not None and not SLOPE_BAND[0] <= slope <= SLOPE_BAND[1] \
            and abs(slope - 1.0) >= Z_MIN * sse:
        temperature = {"logprob_slope": slope, "logprob_slope_se": sse, "implied_temperature": slope,
                       "trainer_side_temperature": 1.0 / slope if slope > 0 else None,
                       "z": abs(slope - 1.0) / sse if sse > 0 else None}
    return Verdict(None, truncation, temperature)


def values(sums: dict) -> dict:
    """n_tokens, log_ratio_abs_mean and the CHECK_COLUMNS of one group from its merged summary_step sums (scalars,
    the schema's names): finalise.check_sql's formulas in Python, for DriftLogger's warning."""
    n = float(sums["n_tokens"])
    out = {"n_tokens": int(n)}
    if n <= 0:
        return out
    rm1, rm1_sq = sums["sum_rm1"], sums["sum_rm1_sq"]
    out["log_ratio_abs_mean"] = sums["sum_abs_d"] / n
    out["missing_mass"] = -rm1 / n
    constant = math.exp(max(-S.CLAMP, min(S.CLAMP, sums["min_d"]))) == math.exp(max(-S.CLAMP, min(S.CLAMP, sums["max_d"])))
    out["ratio_mean_se"] = None if n < 2 else 0.0 if constant else \
        math.sqrt(max((rm1_sq - rm1 * rm1 / n) / (n - 1.0), 0.0) / n)
    if sums.get("n_check_tokens") != sums["n_tokens"]:
        return out
    var_s = sums["sum_s2"] / n - (sums["sum_s"] / n) ** 2
    cov_sd = sums["sum_sd"] / n - (sums["sum_s"] / n) * (sums["sum_d"] / n)
    var_d = sums["sum_d2"] / n - (sums["sum_d"] / n) ** 2
    if sums["min_s"] < sums["max_s"] and var_s > 0:
        out["logprob_slope"] = 1.0 + cov_sd / var_s
        if n >= 3:
            out["logprob_slope_se"] = math.sqrt(max(var_d - cov_sd * cov_sd / var_s, 0.0) / ((n - 2.0) * var_s))
    if sums["n_adj"] > 0:
        out["lag_abs_delta_prev"] = sums["sum_abs_lag_prev"] / sums["n_adj"]
        out["lag_abs_delta_next"] = sums["sum_abs_lag_next"] / sums["n_adj"]
    return out


# -- the sums of a stream of token batches -------------------------------------------------------------------

PENDING_MAX = 4_000_000  # tokens held waiting for a neighbour (a step's tokens in random order hold many)


class CheckSums:
    """schema.CHECK_SUMS of one step's tokens, fed batch by batch in long form (a dense sequence index per token),
    in any order: a token whose neighbour (position ± 1 of its sequence) has not come yet is held until it does,
    so a pair split across batches counts once, as the SQL's window counts it. A file in key order holds about
    one token per sequence; `add` returns False where more than PENDING_MAX tokens wait (the caller then leaves
    the file to the SQL, which sorts)."""

    def __init__(self):
        self.n = 0
        self.n_adj = 0
        self._parts: dict[str, list[float]] = {c: [] for c in ("sum_s", "sum_s2", "sum_sd", "sum_abs_lag_prev",
                                                                  "sum_abs_lag_next")}
        # tokens waiting for a neighbour, sorted by key = seq · 2^32 + pos; need_prev / need_next: which one
        self._key = np.empty(0, np.int64)
        self._s = np.empty(0, np.float64)
        self._t = np.empty(0, np.float64)
        self._need_prev = np.empty(0, bool)
        self._need_next = np.empty(0, bool)

    def add(self, s: np.ndarray, t: np.ndarray, pos: np.ndarray, seq: np.ndarray, d: np.ndarray | None = None
            ) -> bool:
        """Add tokens (float64 s, t; int64 pos, seq); `d`: their t − s where the caller has it."""
        if len(s) == 0:
            return True
        from analysis.summaries.kernel import neighbours, read_only  # numba: only where a stream is summarised

        n = len(s)
        s, t = np.ascontiguousarray(s, np.float64), np.ascontiguousarray(t, np.float64)
        pos, seq = np.ascontiguousarray(pos, np.int64), np.ascontiguousarray(seq, np.int64)
        if d is None:
            d = t - s  # as the database stores Δ: one float64 subtraction
        prev_all, nxt_all = np.empty(max(n - 1, 0)), np.empty(max(n - 1, 0))
        has_prev, has_next = np.empty(n, bool), np.empty(n, bool)
        sums = np.empty(3)
        args = (prev_all, nxt_all, has_prev, has_next, sums)
        n_adj = neighbours(read_only(seq), read_only(pos), read_only(s), read_only(t), read_only(d), *args, True)
        if n_adj < 0:  # not in key order (or a key twice, which the load refuses later)
            order = np.argsort(seq << 32 | pos, kind="stable")
            seq, pos, s, t = seq[order], pos[order], s[order], t[order]
            d = t - s
            n_adj = neighbours(read_only(seq), read_only(pos), read_only(s), read_only(t), read_only(d), *args, False)
        self.n += len(s)
        for name, value in zip(("sum_s", "sum_s2", "sum_sd"), sums):
            self._parts[name].append(float(value))

        def key(i: np.ndarray) -> np.ndarray:  # of the tokens i: sequence · 2^32 + position
            return seq[i] << 32 | pos[i]
        prev = [prev_all[:n_adj]]  # |t_(i+1) − s_i| and |t_i − s_(i+1)| of the neighbours within this batch
        nxt = [nxt_all[:n_adj]]
        if len(self._key):  # the seams with tokens held from earlier batches
            for want, mine, held_flag in ((-1, has_prev, self._need_next), (1, has_next, self._need_prev)):
                ask = np.flatnonzero(~mine)
                ask_key = key(ask) + want
                at = np.searchsorted(self._key, ask_key)
                hit = at < len(self._key)
                hit[hit] = self._key[at[hit]] == ask_key[hit]
                b, h = ask[hit], at[hit]
                if want < 0:  # held token h at p − 1, batch token b at p
                    prev.append(np.abs(t[b] - self._s[h]))
                    nxt.append(np.abs(self._t[h] - s[b]))
                else:  # batch token b at p, held token h at p + 1
                    prev.append(np.abs(self._t[h] - s[b]))
                    nxt.append(np.abs(t[b] - self._s[h]))
                mine[b] = True
                held_flag[h] = False
                n_adj += len(b)
        self.n_adj += n_adj
        self._parts["sum_abs_lag_prev"].append(float(np.sum(prev[0] if len(prev) == 1 else np.concatenate(prev))))
        self._parts["sum_abs_lag_next"].append(float(np.sum(nxt[0] if len(nxt) == 1 else np.concatenate(nxt))))
        keep = self._need_prev | self._need_next
        wait = np.flatnonzero(~(has_prev & has_next))  # indices: one pass, where a mask took one per gather below
        key_all = np.concatenate([self._key[keep], key(wait)])
        order = np.argsort(key_all, kind="stable")
        self._key = key_all[order]
        self._s = np.concatenate([self._s[keep], s[wait]])[order]
        self._t = np.concatenate([self._t[keep], t[wait]])[order]
        self._need_prev = np.concatenate([self._need_prev[keep], ~has_prev[wait]])[order]
        self._need_next = np.concatenate([self._need_next[keep], ~has_next[wait]])[order]
        return len(self._key) <= PENDING_MAX

    def row(self) -> dict[str, float | int]:
        """The step's CHECK_SUMS (sums of the batches' partial sums, compensated)."""
        return {"n_check_tokens": self.n, "n_adj": self.n_adj} | {c: math.fsum(v) for c, v in self._parts.items()}
