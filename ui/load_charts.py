"""Plotly figures of expert load, built from the frames of analysis/metrics/load_views.py, rebalance.py and
hot_experts.py. Ratios to the fair share are drawn on a diverging scale centred on 1 (balanced)."""
from __future__ import annotations

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from ui.charts import DIVERGING, grid_array, layout, to_grid


def _ratio_heatmap(df: pl.DataFrame, x: str, y: str, x_title: str, y_title: str, what: str) -> go.Figure:
    xs, ys, grid = to_grid(df, x, y, "ratio")
    z = grid_array(grid)
    top = max(2.0, float(df["ratio"].max() or 2.0)) if df.height else 2.0
    fig = go.Figure(go.Heatmap(
        x=xs, y=ys, z=z, colorscale=DIVERGING, zmin=0, zmax=top, zmid=1.0,
        colorbar=dict(title="× fair share"),
        hovertemplate=f"{x_title} %{{x}}<br>{y_title} %{{y}}<br>{what} %{{z:.3g}}× fair share<extra></extra>"))
    fig.update_xaxes(type="category" if len(xs) <= 64 else None)
    fig.update_yaxes(dtick=1 if len(ys) <= 32 else None)
    return layout(fig, x=x_title, y=y_title, legend=False, height=max(300, min(700, 60 + 20 * len(ys))))


def expert_heatmap(df: pl.DataFrame) -> go.Figure:
    """[layer, expert, ratio] → layer × expert, each expert's tokens over the layer's fair share."""
    return _ratio_heatmap(df, "expert", "layer", "expert", "MoE layer", "load")


def rank_heatmap(ranks: pl.DataFrame, straggler: pl.DataFrame) -> go.Figure:
    """[layer, rank, ratio] beside [layer, straggler_mean, straggler_pooled]: layer × rank, and per layer the
    straggler factor (max / mean over ranks)."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.72, 0.28], shared_yaxes=True, horizontal_spacing=0.03)
    xs, ys, grid = to_grid(ranks, "rank", "layer", "ratio")
    top = max(2.0, float(ranks["ratio"].max() or 2.0)) if ranks.height else 2.0
    fig.add_trace(go.Heatmap(x=xs, y=ys, z=grid_array(grid), colorscale=DIVERGING, zmin=0, zmax=top, zmid=1.0,
                             colorbar=dict(title="× mean rank"),
                             hovertemplate="rank %{x}<br>layer %{y}<br>tokens %{z:.3g}× the mean rank<extra></extra>"),
                  row=1, col=1)
    s = straggler.sort("layer")
    fig.add_trace(go.Bar(y=s["layer"].to_list(), x=s["straggler_mean"].to_list(), orientation="h",
                         name="straggler (mean over steps)", marker_color="#d62728",
                         hovertemplate="layer %{y}<br>straggler %{x:.3f}<extra></extra>"), row=1, col=2)
    fig.add_vline(x=1.0, line_dash="dot", line_color="#888", row=1, col=2)
    fig.update_xaxes(title_text="EP rank", type="category", row=1, col=1)
    fig.update_xaxes(title_text="straggler = max / mean", row=1, col=2)
    fig.update_yaxes(title_text="MoE layer", dtick=1 if len(ys) <= 32 else None, row=1, col=1)
    return layout(fig, legend=False, height=max(300, min(700, 60 + 20 * len(ys))))


def hot_counts(df: pl.DataFrame) -> go.Figure:
    """[step, layer, n_hot] → step × layer, the number of hot experts (tokens > 2 × fair share)."""
    xs, ys, grid = to_grid(df, "step", "layer", "n_hot")
    top = max(1, int(df["n_hot"].max() or 0)) if df.height else 1
    fig = go.Figure(go.Heatmap(x=xs, y=ys, z=grid_array(grid), colorscale="YlOrRd", zmin=0, zmax=top,
                               colorbar=dict(title="hot experts"),
                               hovertemplate="step %{x}<br>layer %{y}<br>%{z} hot experts<extra></extra>"))
    fig.update_yaxes(dtick=1 if len(ys) <= 32 else None)
    fig.update_xaxes(dtick=1 if len(xs) <= 30 else None)
    return layout(fig, x="step", y="MoE layer", legend=False, height=max(280, min(600, 60 + 18 * len(ys))))


def layer_timeline(df: pl.DataFrame) -> go.Figure:
    """[step, expert, ratio] of one layer → step × expert, tokens over the fair share (hot above 2)."""
    return _ratio_heatmap(df, "step", "expert", "step", "expert", "load")


def what_if(df: pl.DataFrame) -> go.Figure:
    """[layer, static_forecast, rebalanced_forecast, ...] → grouped bars of the forecast imbalance per layer."""
    fig = go.Figure()
    layers = [str(v) for v in df["layer"].to_list()]
    for col, name, color in (("static_forecast", "static placement", "#7f7f7f"),
                             ("rebalanced_forecast", "rebalanced", "#2ca02c")):
        fig.add_trace(go.Bar(x=layers, y=df[col].to_list(), name=name, marker_color=color,
                             hovertemplate=f"layer %{{x}}<br>{name}: imbalance %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_layout(barmode="group")
    return layout(fig, x="MoE layer", y="forecast rank_imbalance (max/mean − 1)")


def domain_split(df: pl.DataFrame, layer: int) -> go.Figure:
    """[tag, layer, expert, share] → per expert, each tag's share of its routed slots at `layer`."""
    fig = go.Figure()
    part = df.filter(pl.col("layer") == layer)
    for tag in sorted(part["tag"].unique().to_list()):
        t = part.filter(pl.col("tag") == tag).sort("expert")
        fig.add_trace(go.Bar(x=[str(e) for e in t["expert"].to_list()], y=t["share"].to_list(), name=str(tag),
                             customdata=t["n"].to_list(),
                             hovertemplate=f"{tag}<br>expert %{{x}}<br>share %{{y:.2%}}<br>slots %{{customdata:,}}"
                                           "<extra></extra>"))
    fig.update_xaxes(type="category")
    fig.update_yaxes(tickformat=".0%")
    fig.update_layout(barmode="group")
    return layout(fig, x="expert", y="share of the tag's routed slots")
