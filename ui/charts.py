"""Plotly figures built from the analysis functions' small DataFrames (already binned/aggregated in DuckDB).

Only figure construction lives here: reshaping for a heat map, axis choices, hover text, colours.
Every builder takes the DataFrame as the analysis function returns it and a {run: colour} map where runs
are overlaid.
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np
import plotly.colors
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from ui.glossary import PERCENT_METRICS
from ui.number_format import log_ticks, share_tickformat

HEIGHT = 340
DIVERGING = "RdBu_r"
SEQUENTIAL = "Viridis"
MARKERS_BELOW = 60  # a line draws its points as markers only when it has fewer: plotly draws each marker as an
# SVG element, and the correction simulator's 9 lines of 400 steps took ~0.6 s of the browser's time in markers


def line_mode(n_points: int) -> str:
    """Scatter mode of a line of n points: markers on short lines (each point visible), a plain line on long ones."""
    return "lines+markers" if n_points < MARKERS_BELOW else "lines"


def layout(fig: go.Figure, *, height: int = HEIGHT, x: str | None = None, y: str | None = None,
            title: str | None = None, legend: bool = True) -> go.Figure:
    top = 40 if title else 30
    legend_box = dict(orientation="h", yanchor="bottom", y=1.0, xanchor="left", x=0)
    if legend and fig.layout.annotations:  # subplot titles sit just above the plots: legend goes above them
        top += 28
        legend_box = dict(orientation="h", yanchor="top", y=1.0, xanchor="left", x=0, yref="container")
    # room for the usual tick labels and axis titles from the start: plotly's automargin (ui/plot.py TEMPLATE)
    # then has nothing to add and draws the chart once, not twice (a fresh page's two Overview charts drew in
    # 208 ms instead of 284 on the 2-core VM); a longer label still gets its room
    fig.update_layout(height=height, margin=dict(l=70, r=10, t=top, b=50),
                      title=dict(text=title, x=0, font=dict(size=14)) if title else None,
                      legend=legend_box, showlegend=legend)
    if x:
        fig.update_xaxes(title_text=x)
    if y:
        fig.update_yaxes(title_text=y)
    fig.update_layout(uirevision=view_revision(fig))
    return fig


def view_revision(fig: go.Figure) -> str:
    """plotly's uirevision: while it stays the same, a redrawn chart keeps what the user did to it (zoom, pan,
    legend clicks), so a live page that redraws with a new step leaves the view alone. It names what the chart
    shows (traces, axis types and titles, panel titles), so a chart of other runs, other metrics or log axes
    starts from its own default view instead of a zoom meant for another."""
    lay = fig.layout.to_plotly_json()
    axes = sorted((k, v.get("type"), str(v.get("title"))) for k, v in lay.items() if k[1:5] == "axis")
    shown = ([t.name for t in fig.data], [type(t).__name__ for t in fig.data], axes,
             [a.text for a in fig.layout.annotations])
    return hashlib.sha1(repr(shown).encode()).hexdigest()[:12]


def hover_format(metric: str) -> str:
    # d3 "p": a percentage rounded to significant digits, so 23 in a million reads 0.0023%, not 0.00%
    return ".3~p" if metric in PERCENT_METRICS else ".4g"


def largest_abs(values) -> float | None:
    """The largest |value| (None when there is none): what a share axis must still resolve."""
    vals = [abs(v) for v in values if v is not None and math.isfinite(v)]
    return max(vals, default=None)


def ordered_runs(df: pl.DataFrame, colors: dict[str, str] | None = None) -> list[str]:
    """Runs of `df` in the colour map's order (the order runs were created), then any others."""
    if "run" not in df.columns:
        return []
    present = df["run"].unique(maintain_order=True).to_list()
    ordered = [r for r in (colors or {}) if r in present]
    return ordered + [r for r in present if r not in ordered]


def _log_axis(fig: go.Figure, axis: str, decades: bool = True, span: tuple[float, float] | None = None,
              **where) -> None:
    # decades: one labelled tick per power of ten (shares spanning many decades); otherwise 1-2-5 ticks over
    # `span` (ratios and thresholds spanning one or two decades), labelled with their values: plotly's own
    # "D2" ticks print 0.2 and 0.5 as "2" and "5", and its default labels every digit, which crowds.
    upd: dict = dict(type="log", exponentformat="power", showexponent="all")
    vals, text = log_ticks(*span) if span and not decades else ([], [])
    if vals:
        upd.update(tickmode="array", tickvals=vals, ticktext=text)
    else:
        upd["dtick"] = 1
    (fig.update_xaxes if axis == "x" else fig.update_yaxes)(**upd, **where)


# -- per-step curves ------------------------------------------------------------------------------------
def step_curves(df: pl.DataFrame, metrics: Sequence[str], colors: dict[str, str], log_y: bool = False,
                x: str = "step") -> go.Figure:
    """Small multiples, one panel per metric, runs overlaid."""
    metrics = [m for m in metrics if m in df.columns]
    cols = 1 if len(metrics) == 1 else 2
    rows = max(1, math.ceil(len(metrics) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=metrics, horizontal_spacing=0.08,
                        vertical_spacing=0.12 if rows > 1 else 0.0)
    for i, metric in enumerate(metrics):
        r, c = divmod(i, cols)
        for j, run in enumerate(ordered_runs(df, colors)):
            part = df.filter(pl.col("run") == run).sort(x)
            fig.add_trace(go.Scatter(
                x=part[x].to_list(), y=part[metric].to_list(), mode=line_mode(part.height),
                name=run, legendgroup=run, showlegend=i == 0, marker=dict(size=5),
                line=dict(color=colors.get(run), width=2),
                hovertemplate=f"{run}<br>{x} %{{x}}<br>{metric} %{{y:{hover_format(metric)}}}<extra></extra>"),
                row=r + 1, col=c + 1)
        if log_y:
            _log_axis(fig, "y", row=r + 1, col=c + 1)
        if metric in PERCENT_METRICS:
            fig.update_yaxes(tickformat=share_tickformat(largest_abs(df[metric].to_list())), row=r + 1, col=c + 1)
    fig.update_xaxes(title_text=x, row=rows)
    return layout(fig, height=max(HEIGHT, 260 * rows))


# -- distributions --------------------------------------------------------------------------------------
def _rgba(color: str | None, alpha: float) -> str:
    c = (color or "#888888").lstrip("#")
    r, g, b = (int(c[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def _segments(lo: list[float], hi: list[float]) -> list[tuple[int, int]]:
    """[start, end) index ranges of contiguous bins (empty bins are not in the frame)."""
    out, start = [], 0
    for i in range(1, len(lo) + 1):
        if i == len(lo) or abs(lo[i] - hi[i - 1]) > 1e-9 * max(1.0, abs(hi[i - 1])):
            out.append((start, i))
            start = i
    return out


# Signed log axis for Δ: the fixed bins are ten per decade of |Δ| from 1e-8 to 1000 on each side of 0, so the
# axis shows sign(Δ)·(log10|Δ| + 9): every decade equally wide, 0 in the middle (|Δ| < 1e-8 would fall inside).
_SLOG_SHIFT = 9.0


def signed_log(v: float) -> float:
    return 0.0 if v == 0 else math.copysign(math.log10(abs(v)) + _SLOG_SHIFT, v)


def _signed_log_axis(fig: go.Figure, axis: str = "x") -> None:
    vals = [10.0 ** k for k in (-8, -6, -4, -2, 0, 2)]
    ticks = [-v for v in reversed(vals)] + [0.0] + vals
    getattr(fig, f"update_{axis}axes")(tickvals=[signed_log(v) for v in ticks],
                                        ticktext=[f"{v:g}" for v in ticks])


def histogram(df: pl.DataFrame, colors: dict[str, str], x_title: str, log_y: bool = False,
              log_x: bool = False, y: str = "frac", signed_log_x: bool = False) -> go.Figure:
    """Binned counts ([run, bin_lo, bin_hi, count, frac]) as filled step outlines, one colour per run;
    a gap in the bins (no tokens) is a gap in the outline. signed_log_x: Δ on the signed log axis."""
    fig = go.Figure()
    for run in ordered_runs(df, colors):
        part = df.filter(pl.col("run") == run).sort("bin_lo")
        lo, hi, val, cnt = (part[c].to_list() for c in ("bin_lo", "bin_hi", y, "count"))
        shown_lo, shown_hi = lo, hi  # hover shows the bins' own edges whatever the axis
        if signed_log_x:
            lo, hi = [signed_log(v) for v in lo], [signed_log(v) for v in hi]
        color = colors.get(run)
        for k, (a, b) in enumerate(_segments(lo, hi)):
            xs = np.array(lo[a:b] + [hi[b - 1]], dtype=np.float64)  # arrays: plotly skips its per-value checks
            ys = np.array(val[a:b] + [val[b - 1]], dtype=np.float64)
            custom = np.column_stack([shown_hi[a:b] + [shown_hi[b - 1]], cnt[a:b] + [cnt[b - 1]],
                                      shown_lo[a:b] + [shown_lo[b - 1]]]).astype(np.float64)
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines", line_shape="hv", name=run, legendgroup=run, showlegend=k == 0,
                line=dict(color=color, width=1.6), fill="tozeroy", fillcolor=_rgba(color, 0.18),
                customdata=custom,
                hovertemplate=(f"{run}<br>[%{{customdata[2]:.4g}}, %{{customdata[0]:.4g}})<br>share %{{y:.3~p}}"
                               "<br>tokens %{customdata[1]:,}<extra></extra>")))
    if log_y:
        _log_axis(fig, "y")
    else:
        fig.update_yaxes(tickformat=share_tickformat(largest_abs(df[y].to_list())) if df.height else ".1%")
    if log_x:
        lo = [v for v in df["bin_lo"].to_list() if v > 0] if df.height else []
        _log_axis(fig, "x", decades=False, span=(min(lo), max(df["bin_hi"].to_list())) if lo else None)
    if signed_log_x:
        _signed_log_axis(fig)
    return layout(fig, x=x_title, y="share of tokens")


def to_grid(df: pl.DataFrame, x: str, y: str, z: str) -> tuple[list, list, list[list]]:
    xs = sorted(df[x].unique().to_list())
    ys = sorted(df[y].unique().to_list())
    xi = {v: i for i, v in enumerate(xs)}
    yi = {v: i for i, v in enumerate(ys)}
    grid: list[list] = [[None] * len(xs) for _ in ys]
    for a, b, v in zip(df[x].to_list(), df[y].to_list(), df[z].to_list()):
        grid[yi[b]][xi[a]] = v
    return xs, ys, grid


def grid_array(grid: list[list]) -> np.ndarray:
    """A heat map's cells as a float array, empty cells NaN: plotly takes an array as one typed block,
    where nested lists cost a Python-level check of every cell (0.3 s for a 100 × 100 grid)."""
    return np.array(grid, dtype=np.float64)


def _uniform_centres(lo: list[float], hi: list[float]) -> list[float] | None:
    """All bin centres of an equal-width binning, including empty bins (None if widths differ): plotly
    draws a heat-map cell halfway to its neighbour's centre, so a missing bin would widen its neighbours."""
    if not lo:
        return None
    width = hi[0] - lo[0]
    if width <= 0 or any(abs((b - a) - width) > 1e-9 * max(1.0, abs(width)) for a, b in zip(lo, hi)):
        return None
    start, n = min(lo), round((max(hi) - min(lo)) / width)
    if n > 2000:
        return None
    return [start + (i + 0.5) * width for i in range(n)]


def _fill_axis(xs: list, full: list[float] | None, grid: list[list], axis: int) -> tuple[list, list[list]]:
    """Re-index the grid onto `full` centres (matching existing centres by nearest value)."""
    if not full or len(full) == len(xs):
        return xs, grid
    width = full[1] - full[0] if len(full) > 1 else 1.0
    index = {i: int(round((x - full[0]) / width)) for i, x in enumerate(xs)}
    if axis == 1:
        out = [[None] * len(full) for _ in grid]
        for r, row in enumerate(grid):
            for i, v in enumerate(row):
                out[r][index[i]] = v
    else:
        out = [[None] * len(grid[0]) for _ in full]
        for i, row in enumerate(grid):
            out[index[i]] = row
    return full, out


def _log_grid(grid: list[list]) -> tuple[list[list], list[float], list[str]]:
    """log10 of positive cells (None elsewhere) and matching colour-bar ticks: counts span decades."""
    out = [[math.log10(v) if v is not None and v > 0 else None for v in row] for row in grid]
    vals = [v for row in out for v in row if v is not None]
    if not vals:
        return out, [], []
    lo, hi = math.floor(min(vals)), math.ceil(max(vals))
    ticks = list(range(lo, hi + 1))
    return out, ticks, [f"1e{t}" if abs(t) > 2 else f"{10.0 ** t:g}" for t in ticks]


HEATMAP_MAX_ROWS = 150  # a step × bin heat map is ~300 px high: more rows than this are below a pixel each (the
# browser's drawing of 400 rows of ~220 bins against 134 rows: a gain within noise, benchmarks/RESULTS-pages.md)


def steps_per_row(df: pl.DataFrame, max_rows: int = HEATMAP_MAX_ROWS) -> int:
    """How many consecutive logged steps `step_heatmap` pools into one row of [step, ...] rows."""
    return max(1, math.ceil(df["step"].n_unique() / max_rows)) if df.height else 1


def pool_steps(df: pl.DataFrame, k: int) -> pl.DataFrame:
    """[step, bin_lo, bin_hi, count, frac] with each k consecutive logged steps pooled into one row, labelled by
    its first step: counts add up, frac is the share of the pooled steps' tokens."""
    if k <= 1:
        return df
    steps = df["step"].unique().sort().to_list()
    first = {st: steps[i - i % k] for i, st in enumerate(steps)}
    return (df.with_columns(step=pl.col("step").replace_strict(first, return_dtype=df.schema["step"]))
            .group_by("step", "bin_lo", "bin_hi").agg(pl.col("count").sum())
            .with_columns(frac=pl.col("count") / pl.col("count").sum().over("step")))


def step_heatmap(df: pl.DataFrame, x_title: str = "Δ = t − s", signed_log_x: bool = False) -> go.Figure:
    """[step, bin_lo, bin_hi, count, frac] → step × bin heat map, colour = share of the step's tokens (log).
    signed_log_x: Δ on the signed log axis (the fixed bins are then equally wide). Runs of more than
    HEATMAP_MAX_ROWS steps: each row pools `steps_per_row` consecutive steps (labelled by the first)."""
    k = steps_per_row(df)
    df = pool_steps(df, k)
    if signed_log_x:
        df = df.with_columns(bin_lo=pl.col("bin_lo").map_elements(signed_log, return_dtype=pl.Float64),
                             bin_hi=pl.col("bin_hi").map_elements(signed_log, return_dtype=pl.Float64))
    mid = df.with_columns(((pl.col("bin_lo") + pl.col("bin_hi")) / 2).alias("_x"))
    xs, ys, grid = to_grid(mid, "_x", "step", "frac")
    bins = mid.unique("bin_lo").sort("bin_lo")
    xs, grid = _fill_axis(xs, _uniform_centres(bins["bin_lo"].to_list(), bins["bin_hi"].to_list()), grid, 1)
    z, ticks, labels = _log_grid(grid)
    step_label = "step %{y}" if k == 1 else f"{k} steps from %{{y}}"
    fig = go.Figure(go.Heatmap(
        x=xs, y=ys, z=grid_array(z), colorscale=SEQUENTIAL, customdata=grid_array(grid),
        colorbar=dict(title="share", tickvals=ticks, ticktext=labels),
        hovertemplate=f"{step_label}<br>Δ ≈ %{{x:.3g}}<br>share %{{customdata:.3%}}<extra></extra>"))
    if signed_log_x:
        _signed_log_axis(fig)
        fig.update_traces(hovertemplate=f"{step_label}<br>share %{{customdata:.3%}}<extra></extra>")
    return layout(fig, x=x_title, y="step" if k == 1 else f"step (rows of {k})", legend=False, height=380)


def density_2d(df: pl.DataFrame, log_axes: bool = False) -> go.Figure:
    """[x_lo, x_hi, y_lo, y_hi, count] → heat map of sampler vs trainer probability with the diagonal."""
    mid = df.with_columns(((pl.col("x_lo") + pl.col("x_hi")) / 2).alias("_x"),
                          ((pl.col("y_lo") + pl.col("y_hi")) / 2).alias("_y"))
    xs, ys, grid = to_grid(mid, "_x", "_y", "count")
    bx, by = mid.unique("x_lo").sort("x_lo"), mid.unique("y_lo").sort("y_lo")
    xs, grid = _fill_axis(xs, _uniform_centres(bx["x_lo"].to_list(), bx["x_hi"].to_list()), grid, 1)
    ys, grid = _fill_axis(ys, _uniform_centres(by["y_lo"].to_list(), by["y_hi"].to_list()), grid, 0)
    z, ticks, labels = _log_grid(grid)
    fig = go.Figure(go.Heatmap(
        x=xs, y=ys, z=grid_array(z), colorscale="Magma", reversescale=True, customdata=grid_array(grid),
        colorbar=dict(title="tokens", tickvals=ticks, ticktext=labels),
        hovertemplate="sampler p ≈ %{x:.3g}<br>trainer p ≈ %{y:.3g}<br>tokens %{customdata:,}<extra></extra>"))
    lo = min(df["x_lo"].min(), df["y_lo"].min()) if df.height else 0.0
    hi = max(df["x_hi"].max(), df["y_hi"].max()) if df.height else 1.0
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="trainer = sampler",
                             line=dict(color="#19D3F3", dash="dash", width=1.5), hoverinfo="skip"))
    if log_axes:
        _log_axis(fig, "x")
        _log_axis(fig, "y")
    fig.update_yaxes(scaleanchor="x", scaleratio=1)
    return layout(fig, x="sampler probability exp(s)", y="trainer probability exp(t)", height=460)


# -- buckets ------------------------------------------------------------------------------------------
def bucket_chart(df: pl.DataFrame, metric: str, colors: dict[str, str], x_title: str,
                 bars: bool = False) -> go.Figure:
    """[run, bucket, label, n_tokens, <metric>] → metric per bucket, runs overlaid (x in bucket order)."""
    order = (df.group_by("label").agg(pl.col("bucket").min()).sort("bucket")["label"].to_list()
             if df.height else [])
    fig = go.Figure()
    for run in ordered_runs(df, colors):
        part = df.filter(pl.col("run") == run).sort("bucket")
        kind = go.Bar if bars else go.Scatter
        extra = {} if bars else {"mode": "lines+markers", "line": dict(color=colors.get(run), width=2)}
        fig.add_trace(kind(
            x=part["label"].to_list(), y=part[metric].to_list(), name=run, marker=dict(color=colors.get(run)),
            customdata=part["n_tokens"].to_list(),
            hovertemplate=f"{run}<br>%{{x}}<br>{metric} %{{y:{hover_format(metric)}}}<br>tokens %{{customdata:,}}"
                          "<extra></extra>", **extra))
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    if metric in PERCENT_METRICS:
        fig.update_yaxes(tickformat=share_tickformat(largest_abs(df[metric].to_list()) if df.height else None))
    if bars:
        fig.update_layout(barmode="group")
    return layout(fig, x=x_title, y=metric)


def extreme_curve(df: pl.DataFrame, colors: dict[str, str]) -> go.Figure:
    """[run, tau, frac] → F(τ) on log-log axes."""
    fig = go.Figure()
    for run in ordered_runs(df, colors):
        part = df.filter((pl.col("run") == run) & (pl.col("frac") > 0)).sort("tau")
        fig.add_trace(go.Scatter(
            x=part["tau"].to_list(), y=part["frac"].to_list(), mode="lines+markers", name=run,
            line=dict(color=colors.get(run), width=2), marker=dict(size=5),
            hovertemplate=f"{run}<br>τ %{{x:.3g}}<br>F(τ) %{{y:.3e}}<extra></extra>"))
    taus = [t for t in df["tau"].to_list() if t > 0] if df.height else []
    _log_axis(fig, "x", decades=False, span=(min(taus), max(taus)) if taus else None)
    _log_axis(fig, "y")
    return layout(fig, x="τ", y="F(τ): share of tokens with max(r, 1/r) > τ")


# -- one sequence -------------------------------------------------------------------------------------
def diverging_colors(values: Sequence[float], scale: float | None = None) -> list[str]:
    """One colour per value on DIVERGING, symmetric around 0 (what cmid=0 gives), computed here: a bar chart
    given numbers as colours draws them, but plotly.js also logs a warning per bar (half a second of console
    traces for a few hundred tokens in Chromium). Full colour at ±`scale` and beyond (default: the largest |value|)."""
    m = scale if scale else max((abs(v) for v in values), default=0.0)
    if not m or not math.isfinite(m):
        return plotly.colors.sample_colorscale(DIVERGING, [0.5] * len(values))
    return plotly.colors.sample_colorscale(DIVERGING, [0.5 + 0.5 * max(-1.0, min(1.0, v / m)) for v in values])


SEQUENCE_VALUES = {"delta": "Δ = t − s", "ratio": "r = π_trainer / π_sampler"}


def sequence_delta(df: pl.DataFrame, value: str = "delta", scale: float | None = None,
                   prompt_tokens: int | None = None) -> go.Figure:
    """One sequence along its positions: a bar per token of Δ (or of r, drawn from r = 1), coloured by Δ with full
    colour at |Δ| = `scale` (the run's p99 |Δ| on the page, so noise stays pale and an anomalous block is dark);
    a grey band spans ±`scale`; drag to zoom, double-click to reset. Where the prompt's token count is known, the
    prompt is a shaded band left of position 0 (its tokens carry no log-probs). df: [pos, token, token_id,
    sampler_logprob, trainer_logprob, delta, ratio]."""
    tokens = [("" if t is None else str(t)) for t in (df["token"].to_list() if "token" in df.columns
                                                      else [None] * df.height)]
    ids = df["token_id"].to_list() if "token_id" in df.columns else [None] * df.height
    labels = [t if t else (f"id {i}" if i is not None else "") for t, i in zip(tokens, ids)]
    deltas = df["delta"].to_list()
    ratio = value == "ratio"
    ys = [r - 1.0 for r in df["ratio"].to_list()] if ratio else deltas
    fig = go.Figure(go.Bar(
        x=df["pos"].to_list(), y=ys, base=1.0 if ratio else None,
        marker=dict(color=diverging_colors(deltas, scale), line=dict(width=0)),
        customdata=list(zip(labels, df["sampler_logprob"].to_list(), df["trainer_logprob"].to_list(), deltas,
                            df["ratio"].to_list())),
        hovertemplate=("pos %{x}: %{customdata[0]}<br>s %{customdata[1]:.4f}<br>t %{customdata[2]:.4f}"
                       "<br>Δ %{customdata[3]:.4f}<br>r %{customdata[4]:.4f}<extra></extra>")))
    if prompt_tokens:
        fig.add_vrect(x0=-prompt_tokens - 0.5, x1=-0.5, fillcolor="rgba(128,128,128,0.18)", line_width=0,
                      annotation_text=f"prompt ({prompt_tokens:,} tokens, no log-probs)",
                      annotation_position="top left", annotation_font_size=11)
    if scale:  # the run's usual spread: |Δ| ≤ scale, i.e. r within [e^−scale, e^scale]
        lo, hi = (math.exp(-scale), math.exp(scale)) if ratio else (-scale, scale)
        fig.add_hrect(y0=lo, y1=hi, fillcolor="rgba(128,128,128,0.10)", line_width=0)
    fig.update_layout(bargap=0.05)
    return layout(fig, x="position in the response", y=SEQUENCE_VALUES[value], legend=False, height=280)


# -- comparison ---------------------------------------------------------------------------------------
def run_bars(df: pl.DataFrame, metrics: Sequence[str], colors: dict[str, str]) -> go.Figure:
    """One panel per metric, one bar per run ([run, <metrics>...], one row per run)."""
    metrics = [m for m in metrics if m in df.columns]
    cols = min(3, max(1, len(metrics)))
    rows = max(1, math.ceil(len(metrics) / cols))
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=metrics, vertical_spacing=0.18 if rows > 1 else 0.0)
    df = df.sort(pl.col("run").replace_strict({r: i for i, r in enumerate(ordered_runs(df, colors))}, default=0))
    runs = df["run"].to_list()
    for i, metric in enumerate(metrics):
        r, c = divmod(i, cols)
        fig.add_trace(go.Bar(x=runs, y=df[metric].to_list(), marker=dict(color=[colors.get(x) for x in runs]),
                             showlegend=False,
                             hovertemplate=f"%{{x}}<br>{metric} %{{y:{hover_format(metric)}}}<extra></extra>"),
                      row=r + 1, col=c + 1)
        if metric in PERCENT_METRICS:
            fig.update_yaxes(tickformat=share_tickformat(largest_abs(df[metric].to_list())), row=r + 1, col=c + 1)
    fig.update_xaxes(type="category", showticklabels=len(runs) <= 6)
    return layout(fig, height=max(HEIGHT, 280 * rows), legend=False)
