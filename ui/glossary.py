"""One-line explanations of the METRICS.md columns, shown as captions and help tooltips."""
from __future__ import annotations

METRIC_HELP: dict[str, str] = {
    "n_tokens": "number of response tokens in the group",
    "n_sequences": "number of sequences in the group",
    "kl_k1": "mean(s − t): unbiased KL(π_sampler‖π_trainer) estimator; noisy and can be negative",
    "kl_k2": "mean(½Δ²): squared log-ratio, a second-order KL proxy",
    "kl_k3": "mean(r − 1 − Δ) ≥ 0: low-variance KL(π_sampler‖π_trainer) estimator (verl k3_kl)",
    "log_ratio_abs_mean": "mean |Δ| = mean |t − s| over tokens",
    "log_ratio_abs_max": "largest |Δ| = |t − s| of any token: the single worst disagreement",
    "prob_abs_diff_mean": "mean |exp t − exp s|: disagreement in probability space",
    "prob_abs_diff_max": "largest |exp t − exp s| of any token",
    "prob_pearson": "Pearson correlation of the trainer's and the sampler's token probabilities (1 = perfect)",
    "ratio_mean": "mean importance ratio r = π_trainer/π_sampler (≈ 1 when the two agree)",
    "ratio_std": "standard deviation of r",
    "ratio_min": "smallest r",
    "ratio_max": "largest r",
    "chi2_token": "mean(r²) − 1: χ² divergence per token; large values mean heavy-tailed ratios",
    "ratio_frac_high": "fraction of tokens with r > C (the importance-ratio cap)",
    "ratio_frac_low": "fraction of tokens with r < 1/C",
    "clip_frac": "fraction of tokens with |r − 1| > ε: clipped by PPO from mismatch alone",
    "ess": "effective sample size of the capped weights, in (0, 1]; 1 = no mismatch",
    "ppl_ratio": "mean over sequences of exp(mean s − mean t): perplexity ratio sampler/trainer",
    "chi2_seq": "mean over sequences of exp(2·ΣΔ) − 1: sequence-level χ²",
    "seq_log_ratio_abs_max": "largest |ΣΔ| of any sequence: the worst sequence-level log-ratio",
    "mult_prob_error": "mean exp(|Δ|): multiplicative probability error, 1 = identical (NeMo RL gates < 1.05 / 1.1)",
    "kl_k3_reverse": "mean(1/r − 1 + Δ) ≥ 0 over the sampler's tokens: weighs tokens the trainer finds far less "
                     "likely enormously (NeMo RL policy_kl_error)",
    "seq_geo_ratio_mean": "mean over sequences of exp(mean Δ): the length-invariant sequence ratio (1 = identical)",
    "seq_geo_ratio_min": "smallest per-sequence exp(mean Δ)",
    "seq_geo_ratio_max": "largest per-sequence exp(mean Δ)",
    "ratio_mean_se": "standard error of ratio_mean, √(sample variance of r / n)",
    "missing_mass": "1 − ratio_mean: the trainer's probability outside the sampler's support (0 for honest logs at "
                    "any precision; > 0 when the sampler's log-probs were taken after top-p / top-k)",
    "logprob_slope": "least-squares slope of t on s (1 for honest logs; near the temperature when one side's "
                     "logits were divided by it and the other's not)",
    "logprob_slope_se": "standard error of logprob_slope",
    "lag_abs_delta_prev": "mean |t_i − s_(i−1)| over neighbouring tokens: far above mean |Δ| unless the log-probs "
                          "are shifted by one position",
    "lag_abs_delta_next": "mean |t_i − s_(i+1)| over neighbouring tokens: far below mean |Δ| when the trainer's "
                          "log-probs sit one position early",
    "first_token_kl_share": "share of kl_k3's sum carried by the first response token: near 1 when the mismatch "
                            "sits at the prompt/response seam (a template or BOS difference between the two sides)",
    "lattice_share_q": "share of the tokens with Δ ≠ 0 whose Δ is a multiple of 1/8: high when one side's "
                       "log-probs were rounded to a coarse grid (low-precision logits)",
    "boundary_low_share": "share of Δ < −10 at the first token of a turn (multi-turn runs): far above "
                          "elsewhere_low_share when the trainer sees a different context at turn boundaries",
    "elsewhere_low_share": "share of Δ < −10 at the other tokens of the turns",
    "token_any_flip_rate": "share of tokens whose top-k experts differ between sampler and trainer in at least "
                           "one MoE layer (R3 reports 94% for a 48-layer MoE)",
    "flipped_layers_per_token": "mean number of MoE layers per token whose expert set differs",
    "topk_overlap": "mean |S_s ∩ S_t| / J: the share of the J most likely tokens both sides list (1 = the same top-J)",
    "top1_agree": "share of positions where the sampler's and the trainer's most likely tokens are the same",
    "topk_kl_shared": "KL(sampler ‖ trainer) over the tokens both top-J lists share, each side renormalised over "
                      "them (0 when they share at most one)",
    "topk_tv_lower": "a lower bound on the full-vocabulary total variation distance, from the two top-J lists",
    "topk_tv_upper": "an upper bound on the full-vocabulary total variation distance, from the two top-J lists",
    "weight_abs_diff_mean": "mean over tokens whose expert sets agree of Σ_k |w_s − w_t|: how far the router's "
                            "combine weights differ even where the experts are the same",
    "flip_rate_by_margin": "flip rate and mean |Δ| of the (token, layer) rows by their router margin (the k-th "
                           "minus the (k+1)-th expert probability): flips concentrate where the margin is near 0",
    "margin_mean_sampler": "mean router margin of the sampler (k-th minus (k+1)-th expert probability)",
    "margin_mean_trainer": "mean router margin of the trainer",
    "flip_rate": "share of tokens at a layer whose top-k expert set differs between sampler and trainer",
    "top1_flip_rate": "share of tokens whose highest-ranked expert differs",
    "overlap": "mean |E_s ∩ E_t| / k: how many of the k experts agree (1 = identical sets)",
    "load_max_vio_sampler": "sampler's expert-load imbalance: (max load − mean) / mean",
    "load_max_vio_trainer": "trainer's expert-load imbalance: (max load − mean) / mean",
}

# Metric cards of the Overview page: (metric, label).
CARD_METRICS: list[tuple[str, str]] = [
    ("kl_k3", "KL k3"),
    ("log_ratio_abs_max", "max |Δ|"),
    ("ratio_frac_high", "r > C"),
    ("ess", "ESS"),
    ("token_any_flip_rate", "tokens with a flip"),
]
# metrics in nats of log-prob difference, read against a log's precision floor (files.precision_floor: the
# smallest difference its rounded numbers resolve, analysis/ingest/precision.py)
FLOOR_METRICS = {"kl_k1", "kl_k2", "kl_k3", "kl_k3_reverse", "log_ratio_abs_mean", "log_ratio_abs_max",
                 "seq_log_ratio_abs_max"}
# shares whose denominator is the group's token count: a card can give the count beside the share
TOKEN_SHARES = {"ratio_frac_high", "ratio_frac_low", "clip_frac"}
PERCENT_METRICS = {"ratio_frac_high", "ratio_frac_low", "clip_frac", "token_any_flip_rate", "flip_rate",
                   "top1_flip_rate", "top1_agree"}

DIMENSIONS: dict[str, tuple[str, str]] = {
    "prob": ("sampler probability exp(s)", "Low-probability tokens usually carry the largest |Δ|."),
    "position": ("position in the response", "Drift that grows with position points at KV-cache or "
                                               "accumulation-order effects."),
    "length": ("response length", "Long responses accumulate more sequence-level mismatch."),
    "entropy": ("sampler entropy", "High-entropy positions are where small logit errors change probabilities most."),
    "lag": ("staleness (lag)", "Lag = trainer_version − sampler_version, the policy versions the trainer is ahead "
                               "of the sampler: lag 0 is on-policy; mismatch that grows with lag is staleness "
                               "(asynchronous RL), not numerics."),
    "tag": ("tag (task)", "Each sequence's tag as logged (DriftLogger `tags=`, a `tag` key): a domain whose "
                          "mismatch stands out points at its prompts or its tokens, not the numerics."),
    "segment": ("turn", "The turn of a multi-turn rollout (DriftLogger `segment_ids=`): mismatch that jumps at "
                        "later turns points at the context the environment added between them. From the token "
                        "rows."),
}


def describe(metric: str) -> str:
    return METRIC_HELP.get(metric, metric)


def fmt_value(metric: str, v) -> str:
    """A metric value for a card: percentages for shares with significant digits (a rare tail reads "0.0023%",
    never "0.00%"), scientific notation for tiny numbers."""
    if v is None:
        return "—"
    if metric in PERCENT_METRICS:
        from ui.number_format import fmt_share
        return fmt_share(v)
    if v != 0 and abs(v) < 1e-3:  # 8.65e-4: 3 digits and a bare exponent fit a card five to a row ("8.654e-04"
        mantissa, exponent = f"{v:.2e}".split("e")  # was cut to "8.654e-…" at 1280 px on the demo)
        return f"{mantissa}e{int(exponent)}"
    return f"{v:.4g}"


def token_count(metric: str, v, n_tokens: int | None) -> str | None:
    """What a share of tokens stands for, as a count: "23 of 1,000,000 tokens" (None for other metrics)."""
    if metric not in TOKEN_SHARES or v is None or not n_tokens:
        return None
    return f"{round(v * n_tokens):,} of {n_tokens:,} tokens"


def below_floor(metric: str, v, floor: float | None) -> str | None:
    """"below the log's precision (1e-6)" where `metric` is in nats and |v| is under the run's precision floor:
    the log's rounding could make such a value, so it measures nothing; None otherwise."""
    if floor is None or v is None or metric not in FLOOR_METRICS or not abs(v) < floor:
        return None
    return f"below the log's precision ({fmt_floor(floor)})"


def fmt_floor(floor: float) -> str:
    """A precision floor as written in a label: 1e-6, 5e-5."""
    mantissa, exponent = f"{floor:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


# -- the Overview's headline cards, as one HTML element -------------------------------------------------------
# One element for all runs rather than a bordered container of five st.metric per run: a fresh browser session
# draws the nine demo runs' cards as one block instead of ~100 elements (benchmarks/RESULTS-pages.md). The
# definitions are each label's tooltip (the `title` attribute). Every piece of text is escaped: run names, notes
# and logging-check lines are user data.
_CARD_CSS = """<style>
.drift-cards { display: flex; flex-direction: column; gap: 0.75rem; }
.drift-card { border: 1px solid rgba(49, 51, 63, 0.2); border-radius: 0.5rem; padding: 0.75rem 1rem; }
.drift-card-check { margin-top: 0.35rem; font-size: 0.875rem; opacity: 0.85; }
.drift-card-check .badge { background: rgba(255, 43, 43, 0.12); color: #bd4043; border-radius: 0.5rem;
  padding: 0.1rem 0.5rem; font-weight: 600; margin-right: 0.5rem; }
.drift-card-metrics { display: grid; grid-template-columns: repeat(5, minmax(0, 1fr)); gap: 1rem;
  margin-top: 0.5rem; }
.drift-metric .label { font-size: 0.875rem; text-decoration: underline dotted rgba(49, 51, 63, 0.4);
  cursor: help; width: fit-content; }
.drift-metric .value { font-size: 2rem; line-height: 1.25; white-space: nowrap; overflow: hidden;
  text-overflow: ellipsis; }
.drift-metric .caption { font-size: 0.8rem; opacity: 0.7; }
.drift-metric .caption.warn { color: #d9822b; opacity: 1; }
</style>"""


def badge_html(run: str, color: str, note: str = "") -> str:
    """A run's name with its colour dot and a note (S.run_badge, the headline cards). Run names are user text:
    escaped."""
    import html
    return (f'<div style="display:flex;align-items:center;gap:0.5rem;font-weight:600;font-size:1.05rem">'
            f'<span style="width:0.8rem;height:0.8rem;border-radius:50%;background:{html.escape(color)};'
            f'display:inline-block"></span>{html.escape(run)}'
            f'<span class="note" style="font-weight:400;opacity:0.7;font-size:0.85rem">{html.escape(note)}</span>'
            '</div>')


def headline_card(run: str, row: dict, color: str, routing: str | None, floor: float | None,
                  check: str | None) -> dict:
    """One run's card for cards_html: `row` its run-level metrics (dashboard.run_and_step_tables), `routing` its
    dashboard.routing_kinds value, `floor` its precision floor, `check` a logging-check line to show first."""
    note = f"{row['n_tokens']:,} tokens · {row['n_sequences']:,} sequences"
    if floor is not None:
        note += f" · precision floor {fmt_floor(floor)}"
    metrics = []
    for metric, label in CARD_METRICS:
        help_text = describe(metric)
        if metric == "token_any_flip_rate" and routing != "both":
            help_text += (" — not available: this run has no MoE routing" if routing == "none"
                          else " — not available: only the sampler's routing was recorded")
        v = row.get(metric)
        captions = [(text, warn) for text, warn in ((token_count(metric, v, row.get("n_tokens")), False),
                                                     (below_floor(metric, v, floor), True)) if text]
        metrics.append({"label": label, "value": fmt_value(metric, v), "help": help_text, "captions": captions})
    return {"run": run, "color": color, "note": note, "check": check, "metrics": metrics}


def cards_html(cards: list[dict]) -> str:
    """The headline cards of the given runs: each a dict with run, color, note, check (a logging-check line or
    None) and metrics, a list of dicts with label, value, help and captions (a list of (text, warn))."""
    import html
    esc = html.escape
    out = [_CARD_CSS, '<div class="drift-cards">']
    for c in cards:
        out.append(f'<div class="drift-card" data-run="{esc(c["run"])}">{badge_html(c["run"], c["color"], c["note"])}')
        if c.get("check"):
            out.append(f'<div class="drift-card-check"><span class="badge">check the logging first</span>'
                       f'<span class="line">{esc(c["check"])}</span></div>')
        out.append('<div class="drift-card-metrics">')
        for m in c["metrics"]:
            out.append(f'<div class="drift-metric" data-label="{esc(m["label"])}" data-value="{esc(m["value"])}">'
                       f'<div class="label" title="{esc(m["help"])}">{esc(m["label"])}</div>'
                       f'<div class="value">{esc(m["value"])}</div>')
            out.extend(f'<div class="caption{" warn" if warn else ""}">{esc(text)}</div>'
                       for text, warn in m["captions"])
            out.append('</div>')
        out.append('</div></div>')
    out.append('</div>')
    return "".join(out)
