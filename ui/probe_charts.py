"""Plotly figures of the drift-origin probe, from the analysis/metrics/probe.py frames."""
from __future__ import annotations

import math

import plotly.graph_objects as go
import polars as pl

from ui.charts import layout

MEASURED, FLOOR, MARK = "#EF553B", "#7F7F7F", "#00CC96"


def _log_ok(values) -> list:
    """Values for a log axis: 0 (an exact match) and NULL drop out (plotly cannot draw them on a log scale)."""
    return [v if v is not None and v > 0 and math.isfinite(v) else None for v in values]


def divergence_by_site(df: pl.DataFrame, first: dict | None) -> go.Figure:
    """by_layer_op's table: mean relative L2 per (layer, op) in compute order, against the fp32 floor; the first
    site above the floor marked."""
    sites = df["site"].to_list()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=sites, y=_log_ok(df["rel_l2_mean"].to_list()), mode="lines+markers",
                             name="sampler vs trainer", line=dict(color=MEASURED, width=2),
                             hovertemplate="%{x}<br>mean rel. L2 %{y:.3g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=sites, y=_log_ok(df["floor_rel_l2_mean"].to_list()), mode="lines+markers",
                             name="fp32 vs fp32 (floor)", line=dict(color=FLOOR, width=2, dash="dot"),
                             hovertemplate="%{x}<br>floor mean rel. L2 %{y:.3g}<extra></extra>"))
    if first is not None:
        fig.add_vline(x=sites.index(first["site"]), line=dict(color=MARK, width=2, dash="dash"))
        fig.add_annotation(x=first["site"], y=1, yref="paper", text=f"first above the floor: {first['site']}",
                           showarrow=False, xanchor="left", yanchor="bottom", font=dict(color=MARK))
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(type="category", tickangle=-45)
    return layout(fig, x="layer and op, in the order a block computes them", y="mean relative L2", height=380)


def first_flip_layers(df: pl.DataFrame) -> go.Figure:
    """first_flips' table → tokens per first flipped layer ('none': no layer flips), with their mean |Δ|."""
    g = df.with_columns(layer=pl.col("first_flip_layer").cast(pl.Utf8).fill_null("none"),
                        abs_delta=pl.col("delta").abs()) \
        .group_by("layer").agg(pl.len().alias("n"), pl.col("abs_delta").mean().alias("mean_abs_delta"))
    order = sorted(g["layer"].to_list(), key=lambda v: (v == "none", int(v) if v != "none" else 0))
    g = g.with_columns(pl.col("layer").replace_strict({v: i for i, v in enumerate(order)}).alias("o")).sort("o")
    fig = go.Figure(go.Bar(x=g["layer"].to_list(), y=g["n"].to_list(), marker_color=MEASURED,
                           customdata=g["mean_abs_delta"].to_list(),
                           hovertemplate="first flip at layer %{x}<br>tokens %{y}<br>mean |Δ| %{customdata:.3g}"
                                         "<extra></extra>"))
    fig.update_xaxes(type="category")
    return layout(fig, x="first layer whose router top-k set flips", y="tokens", legend=False)


def token_path(df: pl.DataFrame) -> go.Figure:
    """token_path's table: one token's relative L2 through the layers against its floor; flipped routers marked."""
    sites = df["site"].to_list()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=sites, y=_log_ok(df["rel_l2"].to_list()), mode="lines+markers", name="this token",
                             line=dict(color=MEASURED, width=2),
                             hovertemplate="%{x}<br>rel. L2 %{y:.3g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=sites, y=_log_ok(df["floor_rel_l2"].to_list()), mode="lines+markers",
                             name="its fp32 floor", line=dict(color=FLOOR, width=2, dash="dot"),
                             hovertemplate="%{x}<br>floor rel. L2 %{y:.3g}<extra></extra>"))
    flipped = df.filter(pl.col("flip").fill_null(False))
    if flipped.height:
        fig.add_trace(go.Scatter(x=flipped["site"].to_list(), y=_log_ok(flipped["rel_l2"].to_list()), mode="markers",
                                 name="router top-k flipped", marker=dict(symbol="x", size=12, color=MARK),
                                 hovertemplate="%{x}: top-k flipped<extra></extra>"))
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(type="category", tickangle=-45)
    return layout(fig, x="layer and op", y="relative L2", height=360)
