"""Plotly figures of MoE routing agreement, built from the analysis/metrics/routing.py and analysis/metrics/drilldown.py frames."""
from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from ui.charts import grid_array, hover_format, largest_abs, layout, ordered_runs, to_grid
from ui.glossary import PERCENT_METRICS
from ui.number_format import share_tickformat


def layer_heatmap(df: pl.DataFrame, value: str = "flip_rate") -> go.Figure:
    """[step, layer, <value>] → step × layer heat map."""
    xs, ys, grid = to_grid(df, "step", "layer", value)
    fig = go.Figure(go.Heatmap(
        x=xs, y=ys, z=grid_array(grid), colorscale="YlOrRd", zmin=0,
        colorbar=dict(title=value, tickformat=share_tickformat(largest_abs(df[value].to_list()) if df.height else None)
                      if value in PERCENT_METRICS else None),
        hovertemplate=f"step %{{x}}<br>layer %{{y}}<br>{value} %{{z:{hover_format(value)}}}<extra></extra>"))
    fig.update_yaxes(dtick=1 if len(ys) <= 32 else None)
    fig.update_xaxes(dtick=1 if len(xs) <= 30 else None)
    return layout(fig, x="step", y="MoE layer", legend=False, height=max(300, min(700, 40 + 22 * len(ys))))


def layer_profile(df: pl.DataFrame, colors: dict[str, str], metric: str = "flip_rate") -> go.Figure:
    fig = go.Figure()
    for run in ordered_runs(df, colors):
        part = df.filter(pl.col("run") == run).sort("layer")
        fig.add_trace(go.Scatter(
            x=part["layer"].to_list(), y=part[metric].to_list(), mode="lines+markers", name=run,
            line=dict(color=colors.get(run), width=2),
            hovertemplate=f"{run}<br>layer %{{x}}<br>{metric} %{{y:{hover_format(metric)}}}<extra></extra>"))
    if metric in PERCENT_METRICS:
        fig.update_yaxes(tickformat=share_tickformat(largest_abs(df[metric].to_list()) if df.height else None))
    fig.update_xaxes(dtick=1)
    return layout(fig, x="MoE layer", y=metric)


def first_flip(df: pl.DataFrame, colors: dict[str, str]) -> go.Figure:
    """[run, first_flip_layer, n_tokens, frac]; a null layer means the token never flipped."""
    fig = go.Figure()
    for run in ordered_runs(df, colors):
        part = df.filter(pl.col("run") == run).sort("first_flip_layer", nulls_last=True)
        xs = ["none" if v is None else str(v) for v in part["first_flip_layer"].to_list()]
        fig.add_trace(go.Bar(x=xs, y=part["frac"].to_list(), name=run, marker=dict(color=colors.get(run)),
                             customdata=part["n_tokens"].to_list(),
                             hovertemplate=f"{run}<br>first flip at layer %{{x}}<br>share %{{y:.3~p}}"
                                           "<br>tokens %{customdata:,}<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(tickformat=share_tickformat(largest_abs(df["frac"].to_list()) if df.height else None))
    fig.update_layout(barmode="group")
    return layout(fig, x="first MoE layer where the expert set flips", y="share of tokens")


def expert_load(df: pl.DataFrame) -> go.Figure:
    """[expert, frac_sampler, frac_trainer] → grouped bars per expert."""
    fig = go.Figure()
    experts = [str(e) for e in df["expert"].to_list()]
    fig.add_trace(go.Bar(x=experts, y=df["frac_sampler"].to_list(), name="sampler", marker_color="#636EFA",
                         customdata=df["n_sampler"].to_list(),
                         hovertemplate="expert %{x}<br>sampler share %{y:.2%}<br>tokens %{customdata:,}<extra></extra>"))
    if "frac_trainer" in df.columns and df["frac_trainer"].drop_nulls().len():
        fig.add_trace(go.Bar(x=experts, y=df["frac_trainer"].to_list(), name="trainer", marker_color="#EF553B",
                             customdata=df["n_trainer"].to_list(),
                             hovertemplate="expert %{x}<br>trainer share %{y:.2%}<br>tokens %{customdata:,}"
                                           "<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(tickformat=".0%")
    fig.update_layout(barmode="group")
    return layout(fig, x="expert", y="share of routed slots")


def flip_mismatch(df: pl.DataFrame, colors: dict[str, str]) -> go.Figure:
    """[run, flipped, n_tokens, log_ratio_abs_mean, kl_k3] → two panels, flipped vs unflipped per run."""
    metrics = ["log_ratio_abs_mean", "kl_k3"]
    fig = make_subplots(rows=1, cols=2)  # panel names go under the panels: a wrapped legend covers titles
    for i, metric in enumerate(metrics):
        for run in ordered_runs(df, colors):
            part = df.filter(pl.col("run") == run).sort("flipped")
            xs = ["flipped" if f else "not flipped" for f in part["flipped"].to_list()]
            fig.add_trace(go.Bar(x=xs, y=part[metric].to_list(), name=run, legendgroup=run, showlegend=i == 0,
                                 marker=dict(color=colors.get(run)), customdata=part["n_tokens"].to_list(),
                                 hovertemplate=f"{run}<br>%{{x}}<br>{metric} %{{y:.4g}}<br>tokens %{{customdata:,}}"
                                               "<extra></extra>"), row=1, col=i + 1)
    fig.update_layout(barmode="group")
    fig = layout(fig)
    fig.update_xaxes(title_text="mean |Δ|", row=1, col=1)
    fig.update_xaxes(title_text="kl_k3", row=1, col=2)
    return fig


def flip_grid(df: pl.DataFrame) -> go.Figure:
    """[pos, layer, flip] → position × layer grid; dark cells are flipped expert sets."""
    d = df.with_columns(pl.col("flip").cast(pl.Int8))
    xs, ys, grid = to_grid(d, "pos", "layer", "flip")
    fig = go.Figure(go.Heatmap(
        x=xs, y=ys, z=grid_array(grid), zmin=0, zmax=1, colorscale=[[0, "#eef2f7"], [1, "#d62728"]], showscale=False,
        xgap=1, ygap=1, hovertemplate="pos %{x}<br>layer %{y}<br>flip %{z}<extra></extra>"))
    fig.update_yaxes(dtick=1 if len(ys) <= 32 else None)
    return layout(fig, x="position in the response", y="MoE layer", legend=False,
                   height=max(220, min(600, 60 + 20 * len(ys))))


def flip_by_margin(df: pl.DataFrame, colors: dict[str, str]) -> go.Figure:
    """[run, side, margin_bin, label, n_tokens, flip_rate, log_ratio_abs_mean] (metrics.routing.
    flip_rate_by_margin) → two panels over the margin bins: the flip rate and mean |Δ| of the (token, layer) rows."""
    fig = make_subplots(rows=1, cols=2)
    for i, metric in enumerate(("flip_rate", "log_ratio_abs_mean")):
        for run in ordered_runs(df, colors):
            part = df.filter(pl.col("run") == run).sort("margin_bin")
            side = part["side"][0] if part.height else ""
            fig.add_trace(go.Bar(x=part["label"].to_list(), y=part[metric].to_list(), name=run, legendgroup=run,
                                 showlegend=i == 0, marker=dict(color=colors.get(run)),
                                 customdata=part["n_tokens"].to_list(),
                                 hovertemplate=f"{run}<br>{side} margin %{{x}}<br>{metric} "
                                               f"%{{y:{hover_format(metric)}}}<br>(token, layer) rows "
                                               "%{customdata:,}<extra></extra>"), row=1, col=i + 1)
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category")
    fig.update_yaxes(tickformat=share_tickformat(largest_abs(df["flip_rate"].to_list()) if df.height else None),
                     row=1, col=1)
    fig = layout(fig)
    fig.update_xaxes(title_text="router margin (flip rate)", row=1, col=1)
    fig.update_xaxes(title_text="router margin (mean |Δ|)", row=1, col=2)
    return fig
