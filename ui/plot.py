"""Shows a plotly figure in a page, drawn once: the app's chart element, in place of st.plotly_chart.

Why: Streamlit 1.67's st.plotly_chart draws every chart three times as it mounts (`newPlot`, then two
`Plotly.react` from its own effects, each recomputing every trace, because it hands plotly fresh copies of the
figure), and plotly's draw is most of a chart-heavy view's time in the browser (benchmarks/RESULTS-pages.md).

How: a Streamlit v2 component (in the page's DOM, no iframe) whose script is constant code. It loads plotly.js
once per browser tab from the plotly package installed with the app (Streamlit's component file route serves
that package folder: public library files only, no user text in the path), then draws each figure with one
`Plotly.react` into the same div. A rerun with another figure reacts in place, so plotly's `uirevision`
(ui/charts.py: view_revision) keeps the user's zoom through a live redraw; a rerun with the same figure draws
nothing. While a figure is being drawn its div carries `data-pending`, which the browser tests wait on.

The look that Streamlit's theme gave the charts is the TEMPLATE below (the app's font, text and grid colours,
transparent backgrounds).
"""
from __future__ import annotations

from pathlib import Path

import plotly
import plotly.graph_objects as go
import plotly.io as pio
import streamlit as st
import streamlit.components.v1 as components_v1

COMPONENT = "driftscope_chart"  # the v2 component's name (AppTest lists it as a bidi_component)
CHART_CLASS = "drift-chart"  # the div plotly draws into (it adds js-plotly-plot); tests select it
_PLOTLY_DIR = Path(plotly.__file__).parent / "package_data"  # plotly.min.js of the installed plotly
_ASSET_NAME = "plotly_js"

TEXT, GRID, FONT = "#31333f", "#e6e9ef", '"Source Sans", "Source Sans Pro", sans-serif'
TEMPLATE = go.layout.Template(layout=go.Layout(
    font=dict(family=FONT, size=13, color=TEXT),
    paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)",
    colorway=["#3b5bdb", "#e8590c", "#2b8a3e", "#c2255c", "#1098ad", "#f59f00", "#7048e8", "#5c940d"],
    xaxis=dict(gridcolor=GRID, linecolor=GRID, zerolinecolor=GRID, automargin=True),
    yaxis=dict(gridcolor=GRID, linecolor=GRID, zerolinecolor=GRID, automargin=True),
    hoverlabel=dict(bgcolor="white", bordercolor=GRID, font=dict(family=FONT, color=TEXT)),
    legend=dict(font=dict(size=12)),
))

_JS = """
// no `responsive`: the ResizeObserver below already follows every width change, the window's included
const CONFIG = {displaylogo: false, modeBarButtonsToRemove: ["select2d", "lasso2d"]};

function plotlyJs(src) {
  if (!window.__driftPlotly) {
    window.__driftPlotly = new Promise((resolve, reject) => {
      const tag = document.createElement("script");
      tag.src = src;
      tag.onload = () => resolve(window.Plotly);
      tag.onerror = () => { window.__driftPlotly = null; tag.remove(); reject(new Error("plotly.js did not load")); };
      document.head.appendChild(tag);
    });
  }
  return window.__driftPlotly;
}

export default function ({ data, parentElement }) {
  const box = parentElement.querySelector("div.CHART_CLASS");
  if (!box) return;
  // one cleanup per div, handed back by every call (whichever call Streamlit keeps it from)
  box.__driftCleanup ??= () => {
    if (box.__driftResize) box.__driftResize.disconnect();
    if (window.Plotly) window.Plotly.purge(box);
  };
  if (box.__driftJson === data.figure) return box.__driftCleanup;  // same figure: drawn (or being drawn)
  box.__driftJson = data.figure;
  box.dataset.pending = "1";
  const fig = JSON.parse(data.figure);
  plotlyJs(data.src)
    .then((Plotly) => {
      if (box.__driftJson !== data.figure) return;  // a newer figure came meanwhile: it draws instead
      if (!box.__driftResize) {  // the column can change width without the window resizing (sidebar)
        // an observer reports the size it starts with too: only a new width redraws (a relayout is a draw)
        box.__driftWidth = box.clientWidth;
        box.__driftResize = new ResizeObserver(() => {
          if (!box._fullLayout || box.clientWidth === box.__driftWidth) return;
          box.__driftWidth = box.clientWidth;
          Plotly.Plots.resize(box);
        });
        box.__driftResize.observe(box);
      }
      return Plotly.react(box, fig.data, fig.layout, CONFIG);
    })
    .catch((err) => { box.dataset.error = String(err); })
    .finally(() => { if (box.__driftJson === data.figure) delete box.dataset.pending; });
  return box.__driftCleanup;
}
""".replace("CHART_CLASS", CHART_CLASS)

_chart = st.components.v2.component(COMPONENT, html=f'<div class="{CHART_CLASS}"></div>',
                                    css=f".{CHART_CLASS} {{ width: 100%; }}", js=_JS, isolate_styles=False)


def _plotly_src() -> str:
    """The URL of plotly.min.js, relative to the page (so that it holds under a server.baseUrlPath too). The file
    route exists once the folder is declared in a script run: it is declared again on each call, which
    Streamlit takes as a no-op for the same folder."""
    asset = components_v1.declare_component(_ASSET_NAME, path=str(_PLOTLY_DIR))
    return f"component/{asset.name}/plotly.min.js"


def show(fig: go.Figure, key: str) -> None:
    """Draw `fig` in the page under `key` (stable across reruns: the chart is redrawn in place)."""
    fig.update_layout(template=TEMPLATE)
    _chart(data={"figure": pio.to_json(fig, validate=False), "src": _plotly_src()}, key=key)
