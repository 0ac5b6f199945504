"""One response as text, each token shaded by Δ = t − s (red: trainer more likely, blue: sampler more likely).

Token text comes from user files: every string is passed through html.escape before it reaches the page,
and st.html additionally sanitises the markup (no script runs).
"""
from __future__ import annotations

import bisect
import functools
import html
import math

import polars as pl
import streamlit as st

_VISIBLE = {"\n": "↵", "\t": "⇥", "\r": "␍"}
# The Sequences page's ranking of a step's sequences (the first is its default) and how many it lists; the
# prefetch computes the default view with the same values (ui/prefetch.py)
ORDERS = {"seq_log_ratio_abs": "|ΣΔ| (whole sequence)", "max_log_ratio_abs": "max |Δ| (worst token)"}
WORST_N = 20
# Columns of the worst-sequences table that a run's logs may leave empty: n_flips without the trainer's routing,
# reward and advantage without a sequences file.
OPTIONAL_WORST = ("n_flips", "reward", "advantage")


def without_empty(worst: pl.DataFrame) -> tuple[pl.DataFrame, list[str]]:
    """The worst-sequences table without the OPTIONAL_WORST columns that are empty in every row, and their names."""
    hidden = [c for c in OPTIONAL_WORST if c in worst.columns and worst[c].null_count() == worst.height]
    return worst.drop(hidden), hidden


def worst_caption(hidden=()) -> str:
    """The caption under the worst-sequences table, naming only the columns shown (`hidden`: those left out)."""
    parts = ["Click a row to open it, a header to sort. seq_log_ratio = ΣΔ over the response (the sequence-level "
             "log importance ratio); max_log_ratio_abs = the largest single-token |Δ|"]
    if "n_flips" not in hidden:
        parts.append("n_flips = token-layer pairs whose experts flipped")
    logged = [c for c in ("reward", "advantage") if c not in hidden] + ["response_length"]
    parts.append(f"{', '.join(logged[:-1])}{' and ' if len(logged) > 1 else ''}{logged[-1]} as the trainer logged "
                 f"{'them' if len(logged) > 1 else 'it'}")
    text = "; ".join(parts) + "."
    if hidden:
        text += f" Not in this run's logs, so not shown: {', '.join(hidden)}."
    return text


def _shade(delta: float, scale: float) -> str:
    a = min(1.0, abs(delta) / scale) if scale > 0 else 0.0
    rgb = "214,39,40" if delta > 0 else "31,119,180"
    return f"rgba({rgb},{0.08 + 0.72 * a:.3f})" if a > 0 else "transparent"


def _label(token, token_id) -> str:
    if token is None or token == "":
        return f"⟨{token_id}⟩" if token_id is not None else "·"
    text = str(token)
    for ch, sym in _VISIBLE.items():
        text = text.replace(ch, sym)
    return text


def sequence_html(df: pl.DataFrame, scale: float | None = None) -> str:
    """[pos, token_id, token, sampler_logprob, trainer_logprob, delta, ratio] → escaped HTML spans.

    `scale` is the |Δ| that gets full colour (default: the largest |Δ| of the sequence).
    """
    if df.is_empty():
        return "<p>(no tokens)</p>"
    deltas = df["delta"].to_list()
    scale = scale or max((abs(d) for d in deltas if d is not None), default=0.0) or 1.0
    tokens = df["token"].to_list() if "token" in df.columns else [None] * df.height
    ids = df["token_id"].to_list() if "token_id" in df.columns else [None] * df.height
    flips = df["n_flipped_layers"].to_list() if "n_flipped_layers" in df.columns else [None] * df.height
    spans = []
    for pos, tok, tid, s, t, d, r, nf in zip(df["pos"].to_list(), tokens, ids, df["sampler_logprob"].to_list(),
                                             df["trainer_logprob"].to_list(), deltas, df["ratio"].to_list(), flips):
        what = f"token {tok!r}" if tok is not None else "no token text logged"
        tip = (f"pos {pos} · {what}" + (f" (id {tid})" if tid is not None else "") +
               f"\ns = {s:.5f}\nt = {t:.5f}\nΔ = {d:+.5f}\nr = {r:.5f}" +
               (f"\nflipped layers: {nf}" if nf is not None else ""))
        border = "border-bottom:2px solid #d62728;" if nf else ""
        border += "border-radius:3px;box-shadow:inset 0 0 0 1px rgba(128,128,128,0.18);margin:0 1px;"
        spans.append(f'<span class="ds-tok" title="{html.escape(tip, quote=True)}" '
                     f'style="background:{_shade(d, scale)};{border}">{html.escape(_label(tok, tid))}</span>')
    return ('<div style="font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:0.92rem;'
            'line-height:1.9;white-space:pre-wrap;word-break:break-word;">' + "".join(spans) + "</div>")


def legend_html(scale: float) -> str:
    return (f'<div style="font-size:0.8rem;opacity:0.8">'
            f'<span style="background:{_shade(-scale, scale)};padding:0 6px">Δ = −{scale:.3g}</span> sampler more '
            f'likely · <span style="background:{_shade(scale, scale)};padding:0 6px">Δ = +{scale:.3g}</span> '
            f'trainer more likely · underlined: expert set flipped in at least one layer · hover a token for '
            f's, t, Δ, r</div>')


# -- the controls and numbers around one sequence -------------------------------------------------------
def nearest(steps: list[int], typed: int) -> int:
    """The logged step closest to a typed one (the lower on a tie); `steps` ascending and non-empty.

    >>> nearest([0, 10, 20], 14), nearest([0, 10, 20], 15), nearest([5], 0)
    (10, 10, 5)
    """
    i = bisect.bisect_left(steps, typed)
    if i == len(steps):
        return steps[-1]
    if i == 0 or steps[i] == typed:
        return steps[i]
    return steps[i - 1] if typed - steps[i - 1] <= steps[i] - typed else steps[i]


def step_increment(steps: list[int]) -> int:
    """The greatest common gap between logged steps (every 10th step logged: 10), at least 1.

    >>> step_increment([0, 10, 30]), step_increment([3]), step_increment([1, 2, 4])
    (10, 1, 1)
    """
    return max(1, functools.reduce(math.gcd, (b - a for a, b in zip(steps, steps[1:])), 0))


def reward_bounds(kind: str, threshold: float) -> dict:
    """worst_sequences' reward_min / reward_max for the page's filter ("any", "at_least", "below").

    "below" keeps reward < threshold: the largest float under it is the inclusive upper bound."""
    if kind == "at_least":
        return {"reward_min": float(threshold)}
    if kind == "below":
        return {"reward_max": math.nextafter(float(threshold), -math.inf)}
    return {}


def id_ranges(ids: list[int], limit: int = 6) -> str:
    """Sorted ids as runs of consecutive values: "0–31, 40, 42–43".

    >>> id_ranges([0, 1, 2, 5, 7, 8]), id_ranges([])
    ('0–2, 5, 7–8', 'none')
    """
    parts, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            parts.append(f"{start}" if start == v else f"{start}–{v}")
            start = None
    if not parts:
        return "none"
    return ", ".join(parts[:limit]) + (f", … ({len(parts) - limit} more ranges)" if len(parts) > limit else "")


def neighbours(group: list[int], sample: int) -> tuple[int | None, int | None]:
    """The sample ids before and after `sample` in its group (ascending ids), None at either end.

    >>> neighbours([2, 5, 9], 5), neighbours([2, 5, 9], 2), neighbours([2, 5, 9], 9)
    ((2, 9), (None, 5), (5, None))
    """
    i = group.index(sample)
    return (group[i - 1] if i > 0 else None), (group[i + 1] if i + 1 < len(group) else None)


def open_sample(sample: int | None) -> None:
    """A prev/next button's callback: the sample box (and the URL) take that id before the page reruns."""
    if sample is not None:
        st.session_state["seq_sample"] = sample


FALLBACK_SCALE = 0.1  # |Δ| for full colour when the run's spread is unknown or 0 (an fp32 control run)


def default_scale(p99: float | None) -> float:
    """The colour scale a run's sample view opens on: its p99 |Δ| (drilldown.delta_scale), 3 significant
    digits; FALLBACK_SCALE where that is unknown or 0 (every token agreeing exactly: nothing to scale to).

    >>> default_scale(0.012345), default_scale(None), default_scale(0.0)
    (0.0123, 0.1, 0.1)
    """
    if not p99 or not math.isfinite(p99) or p99 <= 0:
        return FALLBACK_SCALE
    return float(f"{min(p99, 50.0):.3g}")


def scale_help(p99: float | None) -> str:
    known = f"this run's p99 |Δ| is {p99:.3g}" if p99 else "this run's p99 |Δ| is 0 or unknown"
    return (f"Tokens with |Δ| at or above this get the strongest shade; it opens on the run's own p99 |Δ| ({known}), "
            "so the usual noise stays pale and a block of unusual tokens stands out.")


def box_height(text: str, most: int) -> int | str:
    """A text box's height: "content" (as tall as its text) for a few short lines, else `most` pixels, scrolled.

    >>> box_height("short", 160), box_height("x\\n" * 20, 160)
    ('content', 160)
    """
    lines = text.count("\n") + 1 + len(text) // 90
    return "content" if lines <= 5 else most


def fmt_number(v) -> str:
    return "—" if v is None else f"{v:.4g}"


TOKEN_TABLE = {"pos": "pos", "token_id": "token_id", "token": "token", "sampler_logprob": "s",
               "trainer_logprob": "t", "delta": "Δ", "ratio": "r", "n_flipped_layers": "flipped_layers"}


def token_table(df: pl.DataFrame) -> pl.DataFrame:
    """sequence_tokens' frame with the short names of the page (s, t, Δ, r): the copy/download table."""
    return df.select([c for c in TOKEN_TABLE if c in df.columns]).rename(
        {c: n for c, n in TOKEN_TABLE.items() if c in df.columns})
