"""Figures of the Findings page: the kl_k3 waterfall, the correction simulator's per-step curves, and the measured
|Δ| quantiles against a correction's band. Figure construction only; the numbers come from analysis/."""
from __future__ import annotations

from typing import Sequence

import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from ui.charts import HEIGHT, layout, line_mode

SEVERITY_COLORS = {"alert": "red", "warn": "orange", "info": "blue"}  # streamlit markdown colour names
METHOD_COLORS = {"tis": "#1f77b4", "icepop": "#d62728", "geo_rs": "#2ca02c", "seq_rs": "#9467bd", "veto": "#8c564b"}


def waterfall(terms: pl.DataFrame, a: tuple[int, int], b: tuple[int, int]) -> go.Figure:
    """decomposition.shift_share's rows as a waterfall: kl_k3 over A, one bar per term, kl_k3 over B.

    Drawn as floating bars (a term's bar spans the running total before and after it) joined by connector lines:
    the app's plotly.js bundle (ui/plot.py) holds the cartesian traces only, and those have no waterfall trace."""
    labels = [f"kl_k3, steps {a[0]}–{a[1]}" if t == "A" else f"kl_k3, steps {b[0]}–{b[1]}" if t == "B" else lab
              for t, lab in zip(terms["term"], terms["label"])]
    values = terms["value"].to_list()
    lo, hi, color, text, after, total = [], [], [], [], [], 0.0
    for t, v in zip(terms["term"], values):
        if t in ("A", "B"):  # a total, drawn from zero
            start, total = 0.0, v
            color.append("#1f77b4")
            text.append(f"{v:.3g}")
        else:  # a term moves the running total by v
            start, total = total, total + v
            color.append("#d62728" if v >= 0 else "#2ca02c")
            text.append(f"{v:+.3g}")
        lo.append(min(start, total))
        hi.append(max(start, total))
        after.append(total)
    fig = go.Figure(go.Bar(x=labels, y=[h - l for l, h in zip(lo, hi)], base=lo, marker=dict(color=color),
                           text=text, textposition="outside", customdata=values,
                           hovertemplate="%{x}<br>%{customdata:.4g}<extra></extra>"))
    for i in range(len(labels) - 1):  # the total carried from one bar to the next
        fig.add_shape(type="line", xref="x", yref="y", x0=i + 0.4, x1=i + 0.6, y0=after[i], y1=after[i],
                      line=dict(color="#999", width=1))
    return layout(fig, y="kl_k3", legend=False)


def simulator_curves(df: pl.DataFrame, columns: Sequence[tuple[str, str]]) -> go.Figure:
    """One panel per (column, title) of corrections.compare_methods' per-step table; one line per method."""
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=[t for _, t in columns], horizontal_spacing=0.06)
    for i, (col, _) in enumerate(columns):
        for (method, params), part in df.sort("step").group_by(["method", "params"], maintain_order=True):
            fig.add_trace(go.Scatter(
                x=part["step"].to_list(), y=part[col].to_list(), mode=line_mode(part.height), name=f"{method} {params}",
                legendgroup=f"{method}{params}", showlegend=i == 0, line=dict(color=METHOD_COLORS.get(method)),
                hovertemplate=f"{method}<br>step %{{x}}<br>{col} %{{y:.4g}}<extra></extra>"), row=1, col=i + 1)
        if col.endswith("_frac"):
            fig.update_yaxes(tickformat=".0%", row=1, col=i + 1)
    fig.update_xaxes(title_text="step")
    return layout(fig, height=HEIGHT)


def noise_vs_bands(q: pl.DataFrame, bands: Sequence[tuple[str, str, float]], labels: dict[str, str]) -> go.Figure:
    """Per step p50 and p99 of each quantity a chosen method acts on (corrections.log_ratio_quantiles), with each
    method's band reach (method, quantity, log width) as a horizontal line: a band below the p50 masks noise."""
    quantities = list(dict.fromkeys(qty for _, qty, _ in bands))
    fig = make_subplots(rows=1, cols=max(1, len(quantities)), subplot_titles=[labels[x] for x in quantities],
                        horizontal_spacing=0.08)
    q = q.sort("step")
    for i, qty in enumerate(quantities):
        for pct, dash in (("p50", "solid"), ("p99", "dot")):
            fig.add_trace(go.Scatter(x=q["step"].to_list(), y=q[f"{qty}_{pct}"].to_list(), mode=line_mode(q.height),
                                     name=f"measured {pct}", legendgroup=pct, showlegend=i == 0,
                                     line=dict(color="#444", dash=dash),
                                     hovertemplate=f"step %{{x}}<br>{pct} %{{y:.3g}}<extra></extra>"),
                          row=1, col=i + 1)
        for method, mq, width in bands:
            if mq == qty:
                fig.add_trace(go.Scatter(x=[q["step"].min(), q["step"].max()], y=[width, width], mode="lines",
                                         name=f"{method} band ±{width:.3g}", line=dict(color=METHOD_COLORS.get(method),
                                                                                         width=3),
                                         hovertemplate=f"{method} band reach %{{y:.3g}}<extra></extra>"),
                              row=1, col=i + 1)
        fig.update_yaxes(type="log", exponentformat="power", row=1, col=i + 1)
    fig.update_xaxes(title_text="step")
    return layout(fig, height=HEIGHT, y="log units")


def gates_matrix(table: pl.DataFrame) -> go.Figure:
    """gates.gate_table as a run × gate grid: green pass, red fail, grey unknown; hover shows value and band."""
    runs = table["run"].unique(maintain_order=True).to_list()
    names = table["gate"].unique(maintain_order=True).to_list()
    cell = {(r["run"], r["gate"]): r for r in table.iter_rows(named=True)}
    z, text = [], []
    for run in runs:
        row_z, row_t = [], []
        for g in names:
            c = cell.get((run, g))
            passed = None if c is None else c["passed"]
            row_z.append(None if passed is None else float(passed))
            row_t.append("" if c is None else f"{c['metric']} = {c['value']:.4g}<br>band {c['band']}<br>{c['source']}"
                         if c["value"] is not None else "no value")
        z.append(row_z)
        text.append(row_t)
    fig = go.Figure(go.Heatmap(z=z, x=names, y=runs, text=text, zmin=0, zmax=1, showscale=False, xgap=2, ygap=2,
                               colorscale=[[0, "#d62728"], [1, "#2ca02c"]],
                               hovertemplate="%{y}<br>%{x}<br>%{text}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    return layout(fig, height=max(160, 60 + 34 * len(runs)), legend=False)
