"""Findings: what carries a run's mismatch, the numbers that show it, where to see them, and what to try.

Every kind is detected from the data by a stated rule (RULES, also shown with each finding); the advice and
its source come from docs/DIAGNOSIS.md ("Cause signatures"). The measurements come from the other analysis
modules (metrics, buckets, routing, corrections, decomposition, gates), one query per table for all the runs asked.

Ranking: severity (alert, warn, info), then causes before symptoms (KINDS order: the logging checks first, since
no drift number means anything while the two sides' log-probs are misaligned or processed differently; then
staleness, because stale weights also flip routers and shift every bucket; band violations and noise floors
describe consequences), then the share of kl_k3 a finding accounts for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence
from urllib.parse import urlencode

import numpy as np
import polars as pl

from analysis.findings import decomposition, gates, pairs, residual
from analysis.metrics import buckets, corrections, dashboard, routing, sampled
from analysis.store import Store
from analysis.summaries import checks, sql

SEVERITIES = ("alert", "warn", "info")
KINDS = ("position_shift", "sampling_params", "retokenization", "staleness", "trainer_self", "routing_flips",
         "low_probability_tokens", "long_sequences", "spikes", "rising_trend", "first_token", "lattice", "per_turn",
         "step0_mismatch", "corridor", "band_violation", "replay_residue", "unusual_for_config", "noise_floor",
         "healthy")

# Thresholds of the rules (each named in RULES)
KL_FLOOR = 1e-6          # run kl_k3 below this is rounding noise (fp32 control: ~1e-13): no cause is sought
CARRY_SHARE = 0.3        # a cause must carry at least this share of the run's kl_k3 (Σ of k3 terms)
CONCENTRATION = 3.0      # ... and its tokens' kl_k3 must be this many times that of the other tokens
LOW_P_TOKEN_SHARE = 0.25  # "low-probability tokens": the lowest-probability buckets holding at most 25% of tokens
LOW_P_CARRY = 0.5
SPIKE_FACTOR = 10.0      # a step above 10× the median of its neighbours (±3 steps)
SPIKE_ALERT = 100.0
TREND_MIN_STEPS = 6
TREND_RATIO = 2.0        # median kl_k3 of the last third of steps ≥ 2× that of the first third
TREND_RANK_CORR = 0.6    # and Spearman correlation of kl_k3 with step ≥ 0.6 (a sustained rise, not one jump)
LENGTH_RATIO = 3.0       # kl_k3 of the longest length bucket ≥ 3× the shortest
SEQ_NEAR_CLAMP = 10.0    # |ΣΔ| ≥ 10 = half the clamp (20): the sequence ratio is beyond e^10 ≈ 22,026
FIRST_TOKEN_SHARE = 0.3  # position 0 carries ≥ 30% of Σ k3 (one position of many) ...
LATTICE_SHARE = 0.5      # half the tokens with Δ ≠ 0 sit on a non-zero multiple of q
LATTICE_MIN = 20         # ... of at least this many such tokens
RETOK_MIN = 3            # at least this many segment-first tokens with Δ < −10 ...
RETOK_RATIO = 10.0       # ... and their share ≥ 10× the share of Δ < −10 among the other tokens with a segment
SELF_SHARE = 0.3         # the trainer against itself reaches ≥ 30% of the run's kl_k3
OUTLIER_TOKENS = 3       # a max-type gate crossed by at most this many tokens reads as outliers, not the distribution

RULES = {
    **checks.RULES,
    "staleness": f"tokens with lag > 0 carry ≥ {CARRY_SHARE:.0%} of Σ k3 and their kl_k3 is ≥ {CONCENTRATION:g}× "
                 "that of lag-0 tokens (or there are none)",
    "routing_flips": f"tokens whose routing flipped in some layer carry ≥ {CARRY_SHARE:.0%} of Σ k3 and their mean |Δ| "
                     f"is ≥ {CONCENTRATION:g}× that of unflipped tokens",
    "low_probability_tokens": f"the lowest-probability buckets holding ≤ {LOW_P_TOKEN_SHARE:.0%} of tokens carry "
                              f"≥ {LOW_P_CARRY:.0%} of Σ k3 (and ≥ {CONCENTRATION:g}× their token share)",
    "long_sequences": f"kl_k3 of the longest response-length bucket ≥ {LENGTH_RATIO:g}× the shortest, or some "
                      f"sequence has |ΣΔ| ≥ {SEQ_NEAR_CLAMP:g} (half the clamp 20)",
    "spikes": f"a step's kl_k3 > {SPIKE_FACTOR:g}× the median of its neighbours within ±3 steps (≥ 5 steps; alert "
              f"above {SPIKE_ALERT:g}×)",
    "rising_trend": f"≥ {TREND_MIN_STEPS} steps, median kl_k3 of the last third ≥ {TREND_RATIO:g}× the first third, "
                    f"and Spearman(step, kl_k3) ≥ {TREND_RANK_CORR:g}",
    "first_token": f"tokens at response position 0 carry ≥ {FIRST_TOKEN_SHARE:.0%} of Σ k3 (first_token_kl_share) and "
                   f"their kl_k3 is ≥ {CONCENTRATION:g}× that of the other positions (summaries)",
    "lattice": f"≥ {LATTICE_SHARE:.0%} of the tokens with Δ ≠ 0 (at least {LATTICE_MIN}) have Δ on a non-zero multiple of "
               f"q = {residual.LATTICE_Q:g} within {residual.LATTICE_TOL:g} (summaries where they settle it, else "
               "token rows)",
    "retokenization": f"≥ {RETOK_MIN} tokens at the first position of a segment (turn) have Δ < "
                      f"{residual.BOUNDARY_LOW:g}, and their share (boundary_low_share) is ≥ {RETOK_RATIO:g}× that of "
                      "the other tokens with a segment (elsewhere_low_share)",
    "per_turn": f"of ≥ 2 turns (segments), one carries ≥ {CARRY_SHARE:.0%} of Σ k3 with a kl_k3 ≥ "
                f"{CONCENTRATION:g}× that of the other turns' tokens (token rows; not reported where retokenization "
                "explains it)",
    "trainer_self": f"a trainer-vs-trainer rerun of the run's tokens (ingest --pair-of RUN) has a kl_k3 ≥ "
                    f"{SELF_SHARE:.0%} of the run's",
    "replay_residue": "the run's config has replay = ids or ids+weights and a run of the same config apart from "
                      "replay has none: kl_k3 removed against it, and what remains",
    "corridor": "a metric outside ref − max(rel_down·|ref|, floor) … ref + max(rel_up·|ref|, floor) around the mean of "
                "the baseline runs (--baseline; defaults rel_up 0.5, rel_down 0.8, floor 0.02), or NaN; a max-type "
                f"metric names the tokens beyond the edge (≤ {OUTLIER_TOKENS}: outliers, not the distribution)",
    "unusual_for_config": f"a metric below or above every one of ≥ {gates.MIN_PEERS} other runs whose config has the "
                          f"same {', '.join(gates.CONFIG_KEYS)}",
    "step0_mismatch": f"kl_k3 ≥ {KL_FLOOR:g} at the run's first step, whose tokens all have lag 0 (or no versions)",
    "band_violation": "a published band or CI gate of docs/DIAGNOSIS.md that the run's value breaks",
    "noise_floor": "a correction's band (at its default parameters) reaches less far from Δ = 0 than the measured "
                   "p99 of what it acts on (warn: less than the p50)",
    "healthy": f"no warn or alert finding (every cause rule needs kl_k3 ≥ {KL_FLOOR:g})",
}

# docs/DIAGNOSIS.md, "Cause signatures": what to try, and where that advice comes from
ACTIONS = {
    **checks.ACTIONS,
    "staleness": ("Reduce the maximum staleness (off-policy steps) or use a staleness-aware / decoupled correction; "
                  "this is asynchronous off-policyness, not numerics",
                  "AReaL; Qwen 'Stabilizing RL' (arXiv 2512.01374)"),
    "routing_flips": ("Routing replay (R3: the trainer reuses the sampler's experts) or an fp32 router",
                      "R3 paper (arXiv 2510.11370); prime-rl PR #2808 (mismatch KL 0.0015 → 0.0002–0.0005)"),
    "low_probability_tokens": ("An fp32 LM head / log-softmax, fp16 instead of bf16, or token-level TIS",
                               "MiniMax-M1 (probability correlation ~0.9 → ~0.99, secondary); Precision-RL paper"),
    "long_sequences": ("Use the geometric (length-invariant) sequence ratio or token-level corrections instead of the "
                       "sequence product", "verl docs rollout_corr_math.md (CLAMP = 20)"),
    "spikes": ("Look for an inference-engine bug or a broken weight refit at those steps, not precision",
               "NeMo RL docs/guides/grpo.md"),
    "rising_trend": ("Early warning of off-policy collapse: add a correction (TIS / IcePop / geo-RS), routing replay, "
                     "or an fp32 head", "prime-rl training docs; VeXact (arXiv 2605.14220); Miles mismatch blog"),
    "first_token": ("Compare the first generated token's path on both sides: the prefill's last position against "
                    "the trainer's forward (kernels, the chat template's first token, a BOS or system prefix)",
                    "miles #2722 (the gap left after replay sat on the first generated token)"),
    "lattice": ("Δ in exact steps of q is a low-precision grid (FP8 steps of 0.125): keep the log-prob path (LM head, "
                "log-softmax) out of FP8 on the side that quantises",
                "miles #2722 (TE-FP8 differences in exact steps of 0.125)"),
    "retokenization": ("Keep the sampler's token ids for the trainer: the text was tokenized again between turns, "
                       "which is not numerics", "verl #3720, TRL #5224"),
    "per_turn": ("Look at what the environment adds before that turn (tool output, a new template) and how both "
                 "sides tokenize and process it",
                 "no published threshold: Driftscope's rule, docs/DIAGNOSIS.md#cause-signatures"),
    "trainer_self": ("Part of this mismatch is the trainer disagreeing with itself (batch size, chunking): "
                     "batch-invariant trainer kernels first; an engine fix cannot go below this level",
                     "TRL #6789 (trainer chunking alone moved 8.0% of tokens outside [0.9, 1.1], the engine 7.5%)"),
    "replay_residue": ("What replay leaves is not routing: read the remaining signatures (first token, lattice) "
                       "for the next fix", "miles #2722 (ids-only replay 0.369 → 0.139 mean |Δ|; the rest on the "
                       "first token and an FP8 grid); prime-rl #3543"),
    "corridor": ("Compare this run's config with the baseline runs' (Compare page); a corridor tripped by a few "
                 "tokens points at those tokens (Token drift, extreme tokens), not at the whole run",
                 "miles docs/ci/03-metric-history-gate.md; NeMo RL #4080 (a max-type gate read 464.6 from one token)"),
    "unusual_for_config": ("Check what differs from the runs of the same configuration (Compare page)",
                           "docs/DIAGNOSIS.md#2026-h2-new-evidence-and-open-questions (what level is normal)"),
    "step0_mismatch": ("Mismatch before any update is kernel non-determinism / batch variance or precision: try "
                       "batch-invariant kernels (vLLM batch-invariant mode gives kl 0.0)",
                       "slime true-on-policy docs; vLLM × TorchTitan blog 2025-11-10"),
    "noise_floor": ("Widen the band beyond the measured p99, or use a token-level weight (TIS) instead of masking",
                    "verl-omni RFC #280"),
    "healthy": ("Nothing to fix; keep logging both sides to catch a drift early",
                "docs/DIAGNOSIS.md, 'Published bands and gates'"),
}

# Evidence views: page URL stems (ui/nav.py) and their query-bound tabs/widgets
TOKENS_WHERE = ("token_drift", {"tokens_tab": "Where the mismatch lives"})
TOKENS_DIST = ("token_drift", {})  # its first tab: the Δ histogram
ROUTING_TOKENS = ("routing", {"routing_tab": "Flips per token"})
OVERVIEW = ("overview", {})
PAIRS = ("compare", {"compare_tab": "Pairs"})  # Compare's tab of trainer-self reruns and replay groups
FINDINGS_TABS = ("Waterfall", "Correction simulator", "Gates")  # the Findings page's other tabs (query-bound)
WATERFALL = ("findings", {"findings_tab": FINDINGS_TABS[0]})
SIMULATOR = ("findings", {"findings_tab": FINDINGS_TABS[1]})
GATES = ("findings", {"findings_tab": FINDINGS_TABS[2]})


@dataclass
class Finding:
    run: str
    kind: str
    severity: str
    title: str
    numbers: dict
    page: str
    query: dict = field(default_factory=dict)
    score: float = 0.0
    action: str = ""
    source: str = ""

    def __post_init__(self):
        if not self.action and self.kind in ACTIONS:
            self.action, self.source = ACTIONS[self.kind]

    @property
    def url(self) -> str:
        return f"/{self.page}" + (f"?{urlencode(self.query)}" if self.query else "")

    @property
    def rule(self) -> str:
        return RULES[self.kind]

    def as_dict(self) -> dict:
        return {"run": self.run, "kind": self.kind, "severity": self.severity, "title": self.title,
                "evidence": {"numbers": self.numbers, "page": self.page, "query": self.query, "url": self.url},
                "action": self.action, "source": self.source, "rule": self.rule}


# Token drift's grouping radio binds its shown label to the URL (ui/glossary.DIMENSIONS; a test keeps them equal)
TOKENS_DIM_LABELS = {"prob": "sampler probability exp(s)", "length": "response length", "lag": "staleness (lag)",
                     "position": "position in the response", "segment": "turn"}


def _where(dim: str) -> tuple[str, dict]:
    return TOKENS_WHERE[0], {**TOKENS_WHERE[1], "tokens_dim": TOKENS_DIM_LABELS[dim]}


def _mass(df: pl.DataFrame) -> pl.DataFrame:
    """Bucket rows with mass = n_tokens · kl_k3 (the bucket's Σ of k3 terms)."""
    return df.with_columns(mass=pl.col("n_tokens").cast(pl.Float64) * pl.col("kl_k3"))


def _spearman(x: Sequence[float], y: Sequence[float]) -> float:
    rx, ry = pl.Series(x).rank().to_numpy(), pl.Series(y).rank().to_numpy()
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


# -- one rule per kind: each takes the run's tables and returns its findings -----------------------------------

def _staleness(run, lag: pl.DataFrame, cause_sev) -> list[Finding]:
    if lag.is_empty() or lag["bucket"].max() <= 0:
        return []
    lag = _mass(lag)
    total = lag["mass"].sum()
    stale, fresh = lag.filter(pl.col("bucket") > 0), lag.filter(pl.col("bucket") <= 0)
    share = stale["mass"].sum() / total if total > 0 else 0.0
    k_stale = stale["mass"].sum() / stale["n_tokens"].sum()
    k_fresh = fresh["mass"].sum() / fresh["n_tokens"].sum() if fresh.height else 0.0
    if share < CARRY_SHARE or (k_fresh > 0 and k_stale < CONCENTRATION * k_fresh):
        return []
    tok_share = stale["n_tokens"].sum() / lag["n_tokens"].sum()
    ratio = k_stale / k_fresh if k_fresh > 0 else math.inf
    page, query = _where("lag")
    return [Finding(run, "staleness", cause_sev(share), f"Stale tokens (lag > 0, {tok_share:.0%} of tokens) carry "
                    f"{share:.1%} of the mismatch: kl_k3 {k_stale:.3g} vs {k_fresh:.3g} at lag 0"
                    + (f" ({ratio:.0f}×)" if math.isfinite(ratio) else ""),
                    {"share_of_kl": share, "stale_token_share": tok_share, "kl_k3_lag_gt0": k_stale,
                     "kl_k3_lag0": k_fresh, "max_lag": int(lag["bucket"].max())}, page, query, share)]


def _routing(run, mism: pl.DataFrame, layers: pl.DataFrame, flip_rate, cause_sev) -> list[Finding]:
    flipped, still = mism.filter(pl.col("flipped")), mism.filter(~pl.col("flipped"))
    if flipped.is_empty():
        return []
    m = _mass(mism)
    total = m["mass"].sum()
    share = _mass(flipped)["mass"].sum() / total if total > 0 else 0.0
    d_flip = flipped["log_ratio_abs_mean"][0]
    d_still = still["log_ratio_abs_mean"][0] if still.height else 0.0
    if share < CARRY_SHARE or (d_still > 0 and d_flip < CONCENTRATION * d_still):
        return []
    nums = {"share_of_kl": share, "token_any_flip_rate": flip_rate, "abs_delta_flipped": d_flip,
            "abs_delta_unflipped": d_still}
    depth = ""
    if layers.height >= 2:
        layers = layers.sort("layer")
        first, last = layers["flip_rate"][0], layers["flip_rate"][-1]
        rho = _spearman(layers["layer"].to_list(), layers["flip_rate"].to_list())
        nums.update(flip_rate_first_layer=first, flip_rate_last_layer=last, depth_rank_corr=rho)
        if rho > 0 and last > first:
            depth = f"; flips rise with depth ({first:.2%} at layer {layers['layer'][0]} → {last:.2%} at layer " \
                    f"{layers['layer'][-1]})"
    return [Finding(run, "routing_flips", cause_sev(share),
                    f"Tokens with a routing flip ({flip_rate:.1%} of tokens) carry {share:.1%} of the mismatch: "
                    f"mean |Δ| {d_flip:.3g} vs {d_still:.3g} unflipped{depth}",
                    nums, *ROUTING_TOKENS, share)]


def _low_prob(run, prob: pl.DataFrame, cause_sev) -> list[Finding]:
    if prob.height < 2:
        return []
    p = _mass(prob).sort("bucket")
    total, n = p["mass"].sum(), p["n_tokens"].sum()
    cum = (p["n_tokens"].cum_sum() / n).to_list()
    k = max(1, sum(1 for c in cum if c <= LOW_P_TOKEN_SHARE))
    if k >= p.height:
        return []
    low = p.head(k)
    share, tok_share = low["mass"].sum() / total if total > 0 else 0.0, low["n_tokens"].sum() / n
    if share < LOW_P_CARRY or share < CONCENTRATION * tok_share:
        return []
    edge = low["bucket_hi"][-1]
    page, query = _where("prob")
    return [Finding(run, "low_probability_tokens", cause_sev(share),
                    f"Tokens with sampler probability < {edge:.3g} ({tok_share:.1%} of tokens) carry {share:.1%} of "
                    f"the mismatch", {"share_of_kl": share, "token_share": tok_share, "prob_below": edge},
                    page, query, share)]


def _long(run, length: pl.DataFrame, row: dict, cause_sev) -> list[Finding]:
    nums, parts, score = {}, [], 0.0
    if length.height >= 2:
        ln = length.sort("bucket")
        short, long_ = ln["kl_k3"][0], ln["kl_k3"][-1]
        if long_ > 0 and long_ >= LENGTH_RATIO * short:
            nums.update(kl_k3_shortest=short, kl_k3_longest=long_, longest=ln["label"][-1], shortest=ln["label"][0])
            parts.append(f"kl_k3 {long_:.3g} in responses of length {ln['label'][-1]} vs {short:.3g} at "
                         f"{ln['label'][0]}")
            score = 1.0 - short / long_
    worst = row.get("seq_log_ratio_abs_max")
    if worst is not None and worst >= SEQ_NEAR_CLAMP:
        nums["seq_log_ratio_abs_max"] = worst
        parts.append(f"a sequence with |ΣΔ| = {worst:.3g} (ratio e^{worst:.3g}; the clamp is 20)")
        score = max(score, min(1.0, worst / 20.0))
    if not parts:
        return []
    page, query = _where("length")
    return [Finding(run, "long_sequences", cause_sev(score), "Mismatch grows with length: " + "; ".join(parts),
                    nums, page, query, score)]


def _spikes(run, steps: pl.DataFrame) -> list[Finding]:
    if steps.height < 5:
        return []
    s = steps.sort("step")
    kl, st_ = s["kl_k3"].to_list(), s["step"].to_list()
    hits = []
    for i, v in enumerate(kl):
        nb = [kl[j] for j in range(max(0, i - 3), min(len(kl), i + 4)) if j != i]
        med = float(np.median(nb))
        if v >= KL_FLOOR and v > SPIKE_FACTOR * med:
            hits.append((st_[i], v, v / med if med > 0 else math.inf))
    if not hits:
        return []
    worst = max(hits, key=lambda h: h[2])
    sev = "alert" if worst[2] > SPIKE_ALERT else "warn"
    where = ", ".join(f"{a}" for a, _, _ in hits[:6]) + ("…" if len(hits) > 6 else "")
    return [Finding(run, "spikes", sev, f"kl_k3 spikes at step{'s' if len(hits) > 1 else ''} {where}: "
                    f"{worst[1]:.3g} at step {worst[0]}, "
                    + (f"{worst[2]:.3g}× its neighbours" if math.isfinite(worst[2]) else "its neighbours at 0"),
                    {"spike_steps": [a for a, _, _ in hits], "worst_step": worst[0], "worst_kl_k3": worst[1],
                     "worst_factor": worst[2] if math.isfinite(worst[2]) else None},  # JSON has no inf
                    *OVERVIEW, min(1.0, len(hits) / steps.height))]


def _trend(store, run, steps: pl.DataFrame, cause_sev) -> list[Finding]:
    if steps.height < TREND_MIN_STEPS:
        return []
    s = steps.sort("step")
    halves = decomposition.thirds(s["step"].to_list())
    a, b = halves
    first = s.filter(pl.col("step").is_between(*a))["kl_k3"].median()
    last = s.filter(pl.col("step").is_between(*b))["kl_k3"].median()
    rho = _spearman(s["step"].to_list(), s["kl_k3"].to_list())
    if not (last >= KL_FLOOR and last >= TREND_RATIO * first and rho >= TREND_RANK_CORR):
        return []
    thinning = sampled.thin_steps(store, [run], [a, b])
    terms = decomposition.decompose(store, run, a, b, thinning.steps)
    drivers = terms.filter(~pl.col("term").is_in(["A", "B"])).sort("value", descending=True)
    top = drivers.row(0, named=True) if drivers.height else None
    nums = {"median_kl_k3_first_third": first, "median_kl_k3_last_third": last, "rank_corr": rho,
            "steps_first": list(a), "steps_last": list(b), "decomposition_step_stride": thinning.stride}
    nums.update({f"decomposition_{t}": v for t, v in zip(terms["term"], terms["value"])})
    change = terms["value"][-1] - terms["value"][0]
    lead = f"; {top['label']} accounts for {top['value'] / change:.0%} of the change" if top and change > 0 else ""
    if lead and thinning.label():
        lead += f" ({thinning.label()})"
    ratio = last / first if first > 0 else math.inf
    return [Finding(run, "rising_trend", cause_sev(1.0), f"kl_k3 rises over the run: median {first:.3g} (steps "
                    f"{a[0]}–{a[1]}) → {last:.3g} (steps {b[0]}–{b[1]}), ×{ratio:.3g}, Spearman {rho:.2f}{lead}",
                    nums, *WATERFALL, 1.0)]


def _step0(run, first_step, steps: pl.DataFrame, max_lag: int | None) -> list[Finding]:
    row = steps.filter(pl.col("step") == first_step)
    if row.is_empty():
        return []
    v = row["kl_k3"][0]
    if v < KL_FLOOR or (max_lag is not None and max_lag > 0):
        return []
    return [Finding(run, "step0_mismatch", "info", f"kl_k3 = {v:.3g} already at step {first_step}, before any "
                    "update: kernel non-determinism or precision, not training drift",
                    {"step": first_step, "kl_k3": v}, *OVERVIEW, 0.0)]


def _bands(run, gate_rows: pl.DataFrame) -> list[Finding]:
    out = []
    for g in gate_rows.filter(pl.col("passed") == False).iter_rows(named=True):  # noqa: E712 (null = unknown)
        out.append(Finding(run, "band_violation", g["severity"], f"{g['metric']} = {g['value']:.4g} breaks "
                           f"{g['gate']} ({g['band']})",
                           {"metric": g["metric"], "value": g["value"], "band": g["band"], "gate": g["gate"]},
                           *GATES, 0.0, action=f"Bring {g['metric']} back {g['band']}: see the cause findings "
                           "above for what carries it", source=g["source"]))
    return out


def _noise(run, q: dict) -> list[Finding]:
    out = []
    for method, m in corrections.METHODS.items():
        quantity = corrections.BAND_QUANTITY[method]
        width = corrections.band_log_width(method)
        p50, p99 = q[f"{quantity}_p50"], q[f"{quantity}_p99"]
        if p99 is None or width >= p99:
            continue
        sev = "warn" if width < p50 else "info"
        params = ", ".join(f"{k}={v:g}" for k, v in m.defaults.items())
        approx = quantity == "token" and not q.get("token_exact", True)
        out.append(Finding(run, "noise_floor", sev, f"{method} ({params}) reaches ±{width:.3g} in log units, "
                           f"below the measured {corrections.QUANTITY_LABELS[quantity]} "
                           f"{'p50' if sev == 'warn' else 'p99'} {'≈' if approx else '='} "
                           f"{p50 if sev == 'warn' else p99:.3g}{' (within one histogram bin)' if approx else ''}: it "
                           f"{'masks noise' if method != 'tis' else 'truncates ordinary tokens'}",
                           {"method": method, "band_log_width": width, "p50": p50, "p99": p99,
                            "quantity": quantity, "exact": not approx}, *SIMULATOR, p99 and (1.0 - width / p99)))
    return out


def _logging_checks(run, row: dict, stale: bool) -> list[Finding]:
    """position_shift, or else sampling_params (summaries/checks.py), from the run's summary row; stale: some of
    its tokens have lag > 0 (the slope is then not judged)."""
    found = checks.verdict(row, stale)
    if found.position_shift is not None:
        p = found.position_shift
        lag = "i − 1" if p["lag"] < 0 else "i + 1"
        best = p["lag_abs_delta_prev" if p["lag"] < 0 else "lag_abs_delta_next"]
        return [Finding(run, "position_shift", "alert", f"The two sides' log-probs are one position apart: mean "
                        f"|t_i − s_({lag})| = {best:.3g} against mean |t_i − s_i| = {p['log_ratio_abs_mean']:.3g} "
                        f"(lag −1 {p['lag_abs_delta_prev']:.3g}, lag +1 {p['lag_abs_delta_next']:.3g}): fix the "
                        "alignment before reading any drift number", p, *OVERVIEW, 1.0)]
    if not found.sampling_params:
        return []
    parts, cases, nums, actions = [], [], {}, []
    for case in ("truncation", "temperature"):
        values = getattr(found, case)
        if values is not None:
            text, action = checks.describe(case, values)
            cases.append(case)
            nums.update(values)
            parts.append(text)
            actions.append(action)
    nums["cases"] = cases
    return [Finding(run, "sampling_params", "alert", "The logged log-probs look processed by sampling parameters "
                    f"({' and '.join(cases)}): " + "; ".join(parts), nums, *OVERVIEW, 1.0,
                    action="; ".join(a[0].upper() + a[1:] for a in actions) + ". Drift numbers compare "
                    "differently processed distributions until then", source=checks.ACTIONS["sampling_params"][1])]


def _first_token(run, sig: dict | None, cause_sev) -> list[Finding]:
    share = sig and sig["first_token_kl_share"]
    if not share or share < FIRST_TOKEN_SHARE or not sig["k3_first"]:
        return []
    rest = sig["k3_rest"] or 0.0
    if rest > 0 and sig["k3_first"] < CONCENTRATION * rest:
        return []
    ratio = sig["k3_first"] / rest if rest > 0 else math.inf
    page, query = _where("position")
    return [Finding(run, "first_token", cause_sev(share), f"The first generated token carries {share:.1%} of the "
                    f"mismatch: kl_k3 {sig['k3_first']:.3g} at position 0 vs {rest:.3g} elsewhere"
                    + (f" ({ratio:.0f}×)" if math.isfinite(ratio) else ""),
                    {"first_token_kl_share": share, "kl_k3_first": sig["k3_first"], "kl_k3_rest": rest,
                     "n_first": sig["n_first"], "n_tokens": sig["n_tokens"]}, page, query, share)]


def _lattice(run, sig: dict | None) -> list[Finding]:
    share = sig and sig["lattice_share"]
    if not share or share < LATTICE_SHARE or sig["n_nonzero"] < LATTICE_MIN:
        return []
    return [Finding(run, "lattice", "warn", f"{share:.1%} of the tokens with Δ ≠ 0 sit on multiples of "
                    f"{sig['q']:g}: a low-precision grid, not rounding noise",
                    {"lattice_share": share, "q": sig["q"], "n_nonzero": sig["n_nonzero"]}, *TOKENS_DIST, share)]


def _retokenization(run, sig: dict | None) -> list[Finding]:
    if not sig or sig["boundary_low_share"] is None or (sig["n_seg_first_low"] or 0) < RETOK_MIN:
        return []
    at, rest = sig["boundary_low_share"], sig["elsewhere_low_share"] or 0.0
    if rest > 0 and at < RETOK_RATIO * rest:
        return []
    page, query = _where("segment")
    return [Finding(run, "retokenization", "warn", f"{sig['n_seg_first_low']} of {sig['n_seg_first']} turn starts "
                    f"({at:.1%}) have Δ < {residual.BOUNDARY_LOW:g}, against {rest:.2%} of the other tokens: the "
                    "text was tokenized again between turns",
                    {"boundary_low_share": at, "elsewhere_low_share": rest, "n_seg_first": sig["n_seg_first"],
                     "n_seg_first_low": sig["n_seg_first_low"], "n_seg_rest": sig["n_seg_rest"],
                     "from": sig["segments_from"]}, page, query, at)]


def _per_turn(run, turns: pl.DataFrame, cause_sev) -> list[Finding]:
    if turns.height < 2:
        return []
    t = _mass(turns)
    total, n = t["mass"].sum(), t["n_tokens"].sum()
    worst = t.sort("kl_k3", descending=True, nulls_last=True).row(0, named=True)
    share = worst["mass"] / total if total > 0 else 0.0
    others = n - worst["n_tokens"]
    k_rest = (total - worst["mass"]) / others if others else 0.0
    if share < CARRY_SHARE or (k_rest > 0 and worst["kl_k3"] < CONCENTRATION * k_rest):
        return []
    ratio = worst["kl_k3"] / k_rest if k_rest > 0 else math.inf
    page, query = _where("segment")
    by_turn = {int(r["bucket"]): r for r in t.sort("bucket").iter_rows(named=True)}
    return [Finding(run, "per_turn", cause_sev(share), f"Turn {int(worst['bucket'])} of {t.height} carries "
                    f"{share:.1%} of the mismatch: kl_k3 {worst['kl_k3']:.3g} vs {k_rest:.3g} in the other turns"
                    + (f" ({ratio:.0f}×)" if math.isfinite(ratio) else "") + f", mean |Δ| "
                    f"{worst['log_ratio_abs_mean']:.3g}",
                    {"turn": int(worst["bucket"]), "share_of_kl": share, "kl_k3_turn": worst["kl_k3"],
                     "kl_k3_other_turns": k_rest, "kl_k3_by_turn": [by_turn[b]["kl_k3"] for b in by_turn],
                     "abs_delta_by_turn": [by_turn[b]["log_ratio_abs_mean"] for b in by_turn]}, page, query, share)]


def _trainer_self(run, rows: pl.DataFrame, cause_sev) -> list[Finding]:
    out = []
    for p in rows.iter_rows(named=True):
        share = p["self_share"]
        if share is None or share < SELF_SHARE:
            continue
        out.append(Finding(run, "trainer_self", cause_sev(min(share, 1.0)), f"The trainer disagrees with itself "
                           f"as much as {share:.0%} of the engine mismatch: kl_k3 {p['kl_k3_self']:.3g} "
                           f"({p['trainer_self_run']}, trainer vs trainer) vs {p['kl_k3']:.3g}; tokens outside "
                           f"r ∈ [0.9, 1.1]: {p['outside_0_9_1_1_self']:.2%} vs {p['outside_0_9_1_1']:.2%}",
                           {k: p[k] for k in ("trainer_self_run", "self_share", "kl_k3", "kl_k3_self",
                                              "outside_0_9_1_1", "outside_0_9_1_1_self", "n_tokens",
                                              "n_tokens_self")}, *PAIRS, min(share, 1.0)))
    return out


def _replay_residue(run, rows: pl.DataFrame) -> list[Finding]:
    out = []
    for r in rows.filter(pl.col("replay") != "none").iter_rows(named=True):
        if r["removed_share"] is None:
            continue
        left = [f"{r['first_token_kl_share']:.0%} of it on the first token"
                if (r["first_token_kl_share"] or 0) >= FIRST_TOKEN_SHARE else "",
                f"{r['lattice_share']:.0%} of Δ ≠ 0 on multiples of {residual.LATTICE_Q:g}"
                if (r["lattice_share"] or 0) >= LATTICE_SHARE else ""]
        left = [x for x in left if x]
        out.append(Finding(run, "replay_residue", "info", f"{r['replay']} replay removed {r['removed_share']:.0%} of "
                           f"kl_k3 ({r['kl_k3_baseline']:.3g} → {r['kl_k3']:.3g}, against {r['baseline']})"
                           + (f"; what remains: {', '.join(left)}" if left else ""),
                           {k: r[k] for k in ("replay", "baseline", "kl_k3", "kl_k3_baseline", "kl_k3_removed",
                                              "removed_share", "token_any_flip_rate", "first_token_kl_share",
                                              "lattice_share", "boundary_low_share")}, *PAIRS, 0.0))
    return out


def _corridors(run, rows: pl.DataFrame, baselines: Sequence[str]) -> list[Finding]:
    out = []
    for g in rows.filter(pl.col("status").is_in(["fail", "error"])).iter_rows(named=True):
        nums = {"metric": g["metric"], "value": g["value"], "ref": g["ref"], "lo": g["lo"], "hi": g["hi"],
                "baselines": list(baselines)}
        if g["status"] == "error":
            title = f"{g['metric']}: the corridor gate cannot judge it ({g['detail']})"
        else:
            title = f"{g['metric']} = {g['value']:.4g} is outside [{g['lo']:.4g}, {g['hi']:.4g}] around the " \
                    f"baseline mean {g['ref']:.4g}"
            if g["n_tokens"] is not None:
                a, b, n = g["n_beyond_min"], g["n_beyond_max"], g["n_tokens"]
                nums.update(n_tokens_beyond=b, n_tokens_beyond_at_least=a, share_of_tokens=g["share_beyond"],
                            n_tokens=n)
                count = f"{a}" if a == b else f"{a}–{b}"
                title += f"; {count} of {n:,} tokens beyond it ({(g['share_beyond'] or 0):.2g} of tokens)"
                if b <= OUTLIER_TOKENS:
                    title += ": outlier tokens, not the distribution"
        sev = "alert" if g["status"] == "error" or g["n_tokens"] is None or g["n_beyond_max"] > OUTLIER_TOKENS \
            else "warn"
        out.append(Finding(run, "corridor", sev, title, nums, *GATES, 1.0))
    return out


def _unusual(run, rows: pl.DataFrame) -> list[Finding]:
    out = []
    for b in rows.filter(pl.col("position").is_in(["below", "above"])).iter_rows(named=True):
        out.append(Finding(run, "unusual_for_config", "info", f"{b['metric']} = {b['value']:.4g} is {b['position']} "
                           f"every one of the {b['n_peers']} other runs with {b['config']} ({b['peer_min']:.4g} – "
                           f"{b['peer_max']:.4g}, median {b['peer_median']:.4g})",
                           {k: b[k] for k in ("metric", "value", "config", "n_peers", "peer_min", "peer_median",
                                              "peer_max", "position")}, *GATES, 0.0))
    return out


# -- all kinds for several runs ---------------------------------------------------------------------------------

def findings_many(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None,
                  cap: float = 2.0, clip: float = 0.2, baselines: Sequence[str] | None = None,
                  corridor: gates.Corridor | None = None, q: float = residual.LATTICE_Q) -> dict[str, list[Finding]]:
    """{run: its ranked findings} for `runs` over the inclusive step range (None: every step); `baselines`: runs
    whose values make the corridor gates (gates.corridor_gates, with `corridor`); `q`: the lattice quantum."""
    runs = sql.check_runs(runs)
    if not runs:
        return {}
    tables = dashboard.run_and_step_tables(store, runs, cap=cap, clip=clip, steps=steps)
    summary, per_step = tables["run"], tables["step"]
    gate_rows = gates.gate_table(summary, per_step, runs)
    kinds = dashboard.routing_kinds(store, runs)
    both = [r for r in runs if kinds.get(r) == "both"]
    flips = routing.flip_views(store, both, steps, views=("mismatch",))["mismatch"] if both else None
    layers = routing.layer_profile(store, both, steps) if both else None
    prob = buckets.mismatch_by(store, runs, "prob", cap=cap, clip=clip, steps=steps, metrics=["kl_k3"])
    length = buckets.mismatch_by(store, runs, "length", cap=cap, clip=clip, steps=steps,
                                 metrics=["kl_k3"])
    has_lag = buckets.has_column_data(store, runs, "sampler_version")
    lag = buckets.mismatch_by(store, runs, "lag", cap=cap, clip=clip, steps=steps, metrics=["kl_k3"]) \
        if has_lag else None
    noise = corrections.log_ratio_quantiles(store, runs, by="run", steps=steps)
    first_steps = _first_steps(store, runs)
    first_lag = _first_step_lags(store, runs, first_steps, steps) if has_lag else {}
    sigs = {r["run"]: r for r in residual.signature_table(store, runs, q, steps).iter_rows(named=True)}
    turned = [r for r in runs if sigs.get(r) and (sigs[r]["n_seg_first"] or 0) > 0]
    turns = buckets.mismatch_by(store, turned, "segment", steps=steps, metrics=["kl_k3", "log_ratio_abs_mean"]) \
        if turned else None
    configs = pairs.run_configs(store)
    selfs = pairs.trainer_self_table(store, runs, steps, configs)
    replays = pairs.replay_table(store, runs, steps, configs)
    corridors = gates.corridor_gates(store, runs, baselines, corridor or gates.Corridor(), steps, cap, clip) \
        if baselines else None
    bands = gates.config_bands(store, runs, steps, cap, clip)
    out: dict[str, list[Finding]] = {}
    for run in runs:
        srow = summary.filter(pl.col("run") == run)
        if srow.is_empty():
            out[run] = []
            continue
        row = srow.row(0, named=True)
        rsteps = per_step.filter(pl.col("run") == run)
        rgates = gate_rows.filter(pl.col("run") == run)
        alarming = bool(rgates.filter((pl.col("passed") == False) & (pl.col("severity") == "alert")).height)  # noqa

        def cause_sev(share: float) -> str:
            return "alert" if alarming and share >= 0.5 else "warn"

        of = (lambda df: df.filter(pl.col("run") == run) if df is not None else pl.DataFrame())
        found: list[Finding] = _logging_checks(run, row, run in _stale_runs(lag))
        if row["kl_k3"] is not None and row["kl_k3"] >= KL_FLOOR:
            if lag is not None:
                found += _staleness(run, of(lag), cause_sev)
            if run in both:
                found += _routing(run, of(flips), of(layers), row.get("token_any_flip_rate"), cause_sev)
            found += _low_prob(run, of(prob), cause_sev)
            found += _long(run, of(length), row, cause_sev)
            found += _spikes(run, rsteps)
            found += _trend(store, run, rsteps, cause_sev)
            found += _first_token(run, sigs.get(run), cause_sev)
            found += _lattice(run, sigs.get(run))
            retok = _retokenization(run, sigs.get(run))
            found += retok
            if turns is not None and not retok:
                found += _per_turn(run, of(turns), cause_sev)
            found += _trainer_self(run, of(selfs), cause_sev)
        first = first_steps.get(run)
        if first is not None and (steps is None or steps[0] is None or steps[0] <= first):
            found += _step0(run, first, rsteps, first_lag.get(run))
        found += _bands(run, rgates)
        if corridors is not None:
            found += _corridors(run, of(corridors), baselines)
        found += _unusual(run, of(bands))
        found += _replay_residue(run, of(replays))
        qrow = of(noise)
        if qrow.height:
            found += _noise(run, qrow.row(0, named=True))
        if not any(f.severity in ("alert", "warn") for f in found):
            found.append(Finding(run, "healthy", "info", f"No cause found: kl_k3 = {row['kl_k3']:.3g}, "
                                 f"mult_prob_error = {row['mult_prob_error']:.6g}, every published band passes"
                                 if rgates["passed"].all() else
                                 f"No cause found: kl_k3 = {row['kl_k3']:.3g}", {"kl_k3": row["kl_k3"],
                                 "mult_prob_error": row["mult_prob_error"]}, *OVERVIEW, 0.0))
        out[run] = rank(found)
    return out


def _stale_runs(lag: pl.DataFrame | None) -> set[str]:
    """The runs with tokens of lag > 0 in a `buckets.mismatch_by(..., "lag")` table (None: no versions)."""
    return set() if lag is None else set(lag.filter(pl.col("bucket") > 0)["run"].to_list())


def logging_checks(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> dict[str, checks.Verdict]:
    """{run: the logging checks' verdict} (position_shift, truncation, temperature; summaries/checks.py) from the
    summaries alone: what the Data page's banner and Overview's badge show, the findings' own rule."""
    runs = sql.check_runs(runs)
    if not runs:
        return {}
    summary = dashboard.run_summary(store, runs, steps=steps)
    lag = buckets.mismatch_by(store, runs, "lag", steps=steps, metrics=["kl_k3"]) \
        if buckets.has_column_data(store, runs, "sampler_version") else None
    stale = _stale_runs(lag)
    return {row["run"]: checks.verdict(row, row["run"] in stale) for row in summary.iter_rows(named=True)}


def _first_steps(store: Store, runs: list[str]) -> dict[str, int]:
    """{run: its first logged step}, from the summaries (Store.runs), whatever step range is selected."""
    first = dict(store.runs().select("run", "first_step").iter_rows())
    return {run: first[run] for run in runs if first.get(run) is not None}


def _first_step_lags(store: Store, runs: list[str], first_steps: dict, steps) -> dict[str, int]:
    """{run: the largest lag among the tokens of its first step}: one lag grouping per distinct first step."""
    out: dict[str, int] = {}
    by_first: dict[int, list[str]] = {}
    for run in runs:
        first = first_steps.get(run)
        if first is not None and (steps is None or steps[0] is None or steps[0] <= first):
            by_first.setdefault(first, []).append(run)
    for first, group in by_first.items():
        lags = buckets.mismatch_by(store, group, "lag", steps=(first, first), metrics=["kl_k3"])
        out.update(dict(lags.group_by("run").agg(pl.col("bucket").max()).iter_rows()))
    return out


def rank(found: list[Finding]) -> list[Finding]:
    return sorted(found, key=lambda f: (SEVERITIES.index(f.severity), KINDS.index(f.kind), -(f.score or 0.0)))


def findings(store: Store, run: str, steps: tuple[int, int] | None = None, cap: float = 2.0,
             clip: float = 0.2) -> list[Finding]:
    """One run's ranked findings (see findings_many)."""
    return findings_many(store, [run], steps, cap, clip)[run]


def findings_table(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None, cap: float = 2.0,
                   clip: float = 0.2, baselines: Sequence[str] | None = None) -> list[dict]:
    """findings_many as plain dicts (what the page caches and draws)."""
    return [f.as_dict() for fs in findings_many(store, runs, steps, cap, clip, baselines=baselines or None).values()
            for f in fs]
