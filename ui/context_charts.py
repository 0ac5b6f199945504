"""Drift beside its context on one step axis: a drift metric, mean reward, mean advantage, response length and
sequences per step, stacked with a shared x axis so that a rise in drift lines up with what changed in reward,
advantage or length."""
from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from ui.charts import _rgba, hover_format, layout, line_mode, ordered_runs

PANELS = ("drift", "mean reward", "mean advantage (band: min–max)", "response length (mean, band: min–max)",
          "sequences per step")
REWARD, ADVANTAGE, LENGTH, COUNT = PANELS[1:]


def context_over_steps(per_step: pl.DataFrame, context: pl.DataFrame, metric: str,
                       colors: dict[str, str]) -> go.Figure:
    """per_step: [run, step, <metric>, ...] (dashboard.step_metrics); context: analysis.metrics.context.step_context.
    Rows sharing x: the drift metric, reward_mean, advantage_mean with its min–max band, response_length_mean
    with its min–max band, n_sequences.
    Where every run holds the same number of sequences at every step (constant_count), the sequences row is
    left out too: a flat line says nothing the page's caption does not.
    A run without rewards draws no reward line (nothing to show rather than a line at zero), and where no run has
    one the reward row is left out rather than drawn empty; the same for advantages (a row under the reward's)."""
    rewards = bool(context.height) and bool(context["n_rewarded"].sum())
    advantages = bool(context.height) and "n_advantaged" in context.columns and bool(context["n_advantaged"].sum())
    shown = [p for p in PANELS if (rewards or p != REWARD) and (advantages or p != ADVANTAGE)
             and (p != COUNT or constant_count(context) is None)]
    row_of = {name: i + 1 for i, name in enumerate(shown)}
    fig = make_subplots(rows=len(shown), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=[metric] + shown[1:])
    runs = ordered_runs(pl.concat([per_step.select("run"), context.select("run")]), colors)
    for run in runs:
        color = colors.get(run)
        d = per_step.filter(pl.col("run") == run).sort("step")
        c = context.filter(pl.col("run") == run).sort("step")
        common = dict(legendgroup=run, name=run, line=dict(color=color, width=2), mode=line_mode(max(d.height, c.height)),
                      marker=dict(size=4))
        if metric in d.columns and d.height:
            fig.add_trace(go.Scatter(x=d["step"].to_list(), y=d[metric].to_list(), showlegend=True, **common,
                                     hovertemplate=f"{run}<br>step %{{x}}<br>{metric} "
                                                   f"%{{y:{hover_format(metric)}}}<extra></extra>"), row=1, col=1)
        if not c.height:
            continue
        x = c["step"].to_list()
        rewarded = c.filter(pl.col("n_rewarded") > 0)
        if rewarded.height:
            fig.add_trace(go.Scatter(x=rewarded["step"].to_list(), y=rewarded["reward_mean"].to_list(),
                                     showlegend=False, customdata=rewarded["n_rewarded"].to_list(), **common,
                                     hovertemplate=f"{run}<br>step %{{x}}<br>mean reward %{{y:.4g}}"
                                                   "<br>over %{customdata} sequences<extra></extra>"),
                          row=row_of[REWARD], col=1)
        with_adv = c.filter(pl.col("n_advantaged") > 0) if advantages else c.clear()
        if with_adv.height:
            ax = with_adv["step"].to_list()
            alo, ahi = with_adv["advantage_min"].to_list(), with_adv["advantage_max"].to_list()
            fig.add_trace(go.Scatter(x=ax + ax[::-1], y=ahi + alo[::-1], fill="toself", fillcolor=_rgba(color, 0.15),
                                     line=dict(width=0), hoverinfo="skip", showlegend=False, legendgroup=run),
                          row=row_of[ADVANTAGE], col=1)
            fig.add_trace(go.Scatter(x=ax, y=with_adv["advantage_mean"].to_list(), showlegend=False, **common,
                                     customdata=list(zip(with_adv["n_advantaged"].to_list(), alo, ahi)),
                                     hovertemplate=f"{run}<br>step %{{x}}<br>mean advantage %{{y:.4g}}"
                                                   "<br>min %{customdata[1]:.4g}, max %{customdata[2]:.4g}"
                                                   "<br>over %{customdata[0]} sequences<extra></extra>"),
                          row=row_of[ADVANTAGE], col=1)
        lo, hi = c["response_length_min"].to_list(), c["response_length_max"].to_list()
        fig.add_trace(go.Scatter(x=x + x[::-1], y=hi + lo[::-1], fill="toself", fillcolor=_rgba(color, 0.15),
                                 line=dict(width=0), hoverinfo="skip", showlegend=False, legendgroup=run),
                      row=row_of[LENGTH], col=1)
        fig.add_trace(go.Scatter(
            x=x, y=c["response_length_mean"].to_list(), showlegend=False, **common,
            customdata=list(zip(c["response_length_std"].to_list(), lo, hi)),
            hovertemplate=f"{run}<br>step %{{x}}<br>mean length %{{y:.4g}} tokens<br>std %{{customdata[0]:.3g}}"
                          "<br>min %{customdata[1]}, max %{customdata[2]}<extra></extra>"),
            row=row_of[LENGTH], col=1)
        if COUNT in row_of:
            fig.add_trace(go.Scatter(x=x, y=c["n_sequences"].to_list(), showlegend=False, **common,
                                     hovertemplate=f"{run}<br>step %{{x}}<br>%{{y}} sequences<extra></extra>"),
                          row=row_of[COUNT], col=1)
    fig.update_xaxes(title_text="step", row=len(shown), col=1)
    for name in (LENGTH, COUNT):  # lengths and counts from zero: a change reads at its true size
        if name in row_of:
            fig.update_yaxes(rangemode="tozero", row=row_of[name], col=1)
    return layout(fig, height=180 * len(shown))


def constant_count(context: pl.DataFrame) -> int | None:
    """The number of sequences of every step of every run where it is one number (a fixed batch), else None."""
    counts = context["n_sequences"].unique()
    return int(counts[0]) if counts.len() == 1 else None
