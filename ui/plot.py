"""Shows a plotly figure in a page, drawn once: the app's chart element, in place of st.plotly_chart.

Why: Streamlit 1.67's st.plotly_chart draws every chart three times as it mounts (`newPlot`, then two
`Plotly.react` from its own effects, each recomputing every trace, because it hands plotly fresh copies of the
figure), and plotly's draw is most of a chart-heavy view's time in the browser (benchmarks/RESULTS-pages.md).

How: a Streamlit v2 component (in the page's DOM, no iframe) whose script is constant code. It loads plotly.js
once per browser tab, then draws each figure with one `Plotly.react` into the same div. A rerun with another
figure reacts in place, so plotly's `uirevision` (ui/charts.py: view_revision) keeps the user's zoom through a
live redraw; a rerun with the same figure draws nothing. While a figure is being drawn its div carries
`data-pending`, which the browser tests wait on. Pages call `chart(builder, *inputs)`: the figure's JSON is kept
per process under a digest of its inputs, so a view drawn once is not rebuilt for the next session.

plotly.js is plotly's cartesian bundle (ui/static/plotly: plotly.js-cartesian-dist-min 3.7.0, MIT; the traces in
TRACES), not the full plotly.min.js of the Python package (3.8.2): a fresh browser session parses and runs the
script before its first chart, ~0.35 s for the 1.4 MB bundle against ~1.0 s for the 4.8 MB one on a 2-core VM
(benchmarks/RESULTS-pages.md). So a figure may use only those traces: the chart functions refuse any other, which
every page test would catch. Streamlit's component file route serves that folder (our files, no user text in the
path). `preload()`, called by app.py on a page whose first view draws a chart, starts loading the script while the
server still runs the page, so that it is ready when the first chart arrives.

The look that Streamlit's theme gave the charts is the TEMPLATE below (the app's font, text and grid colours,
transparent backgrounds).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import plotly.graph_objects as go
import plotly.io as pio
import polars as pl
import streamlit as st
import streamlit.components.v1 as components_v1

COMPONENT = "driftscope_chart"  # the v2 component's name (AppTest lists it as a bidi_component)
CHART_CLASS = "drift-chart"  # the div plotly draws into (it adds js-plotly-plot); tests select it
_PLOTLY_DIR = Path(__file__).parent / "static" / "plotly"  # the cartesian bundle, and its licence
_PLOTLY_FILE = "plotly-cartesian.min.js"
_ASSET_NAME = "plotly_js"
PRELOAD_KEY = "plotly_preload"
# the trace types of the cartesian bundle (its README and `Object.keys(Plotly.Plots.modules)` in a browser)
TRACES = frozenset({"bar", "box", "contour", "heatmap", "histogram", "histogram2d", "histogram2dcontour", "image",
                    "pie", "scatter", "scatterternary", "violin"})

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

_LOADER = """
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
"""

_JS = _LOADER + """
// no `responsive`: the ResizeObserver below already follows every width change, the window's included
const CONFIG = {displaylogo: false, modeBarButtonsToRemove: ["select2d", "lasso2d"]};

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
    """The URL of the plotly.js bundle, relative to the page (so that it holds under a server.baseUrlPath too).
    The file route exists once the folder is declared in a script run: it is declared again on each call, which
    Streamlit takes as a no-op for the same folder."""
    asset = components_v1.declare_component(_ASSET_NAME, path=str(_PLOTLY_DIR))
    return f"component/{asset.name}/{_PLOTLY_FILE}"


def preload() -> None:
    """Start loading plotly.js in the browser now (once per tab; a no-op where it is loaded or loading). An
    st.html element with a script (constant code: the loader and the bundle's URL), not a component: its script runs
    as soon as the element arrives, where a component's waits for the component machinery to load. Its container is
    hidden, so it takes no room in the page."""
    with st.container(key=PRELOAD_KEY):
        st.html(f"<style>.st-key-{PRELOAD_KEY} {{ display: none; }}</style>"
                f"<script>{_LOADER} plotlyJs({json.dumps(_plotly_src())}).catch(() => {{}});</script>",
                unsafe_allow_javascript=True)


def show(fig: go.Figure, key: str) -> None:
    """Draw `fig` in the page under `key` (stable across reruns: the chart is redrawn in place)."""
    _send(_to_json(fig), key)


def chart(build: Callable[..., go.Figure], *args, key: str, **kwargs) -> None:
    """`show(build(*args, **kwargs), key)`, with the figure's JSON kept per process under a digest of the builder
    and the values of its inputs. Building the figure is most of a chart page's script time (plotly's figure
    objects check every value they are given: ~0.25 s of the Overview's ~0.3 s on the demo), so a view that any
    session has drawn (a shared link, a refresh, a new visitor, a page revisited) is sent without being rebuilt.
    An input that cannot be fingerprinted (_feed) builds the figure every time."""
    digest = _digest(build, args, kwargs)
    _send(_to_json(build(*args, **kwargs)) if digest is None else _figure_json(digest, build, args, kwargs), key)


def _send(figure: str, key: str) -> None:
    _chart(data={"figure": figure, "src": _plotly_src()}, key=key)


def _to_json(fig: go.Figure) -> str:
    missing = {t.type for t in fig.data} - TRACES
    if missing:  # a programming error, not a user's: the bundle could not draw it
        raise ValueError(f"plotly.js bundle of ui/plot.py has no {sorted(missing)} trace")
    fig.update_layout(template=TEMPLATE)
    return pio.to_json(fig, validate=False)


# a few views' figures (the Overview's two are ~0.6 MB of JSON on the demo): the pages' default views, and more
@st.cache_data(show_spinner=False, max_entries=64)
def _figure_json(digest: str, _build: Callable[..., go.Figure], _args: tuple, _kwargs: dict) -> str:
    return _to_json(_build(*_args, **_kwargs))  # the digest stands for the arguments Streamlit does not hash


def _digest(build: Callable, args: tuple, kwargs: dict) -> str | None:
    h = hashlib.sha256(f"{build.__module__}.{build.__qualname__}".encode())
    try:
        _feed(h, args)
        _feed(h, dict(kwargs))
    except (TypeError, pl.exceptions.PolarsError):
        return None
    return h.hexdigest()


def _feed(h, obj) -> None:
    """Add `obj`'s value to the digest: frames by schema and row hashes, plain values by type and repr (exact for
    floats), containers element by element. Anything else raises TypeError."""
    if isinstance(obj, pl.DataFrame):
        h.update(b"F%r%d" % (str(obj.schema).encode(), obj.height))
        if obj.height and obj.width:
            h.update(obj.hash_rows(seed=0).to_numpy().tobytes())
    elif isinstance(obj, pl.Series):
        _feed(h, obj.to_frame())
    elif obj is None or isinstance(obj, (str, bool, int, float)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    elif isinstance(obj, (list, tuple)):
        h.update(b"%s%d[" % (type(obj).__name__.encode(), len(obj)))
        for x in obj:
            _feed(h, x)
    elif isinstance(obj, dict):
        h.update(b"dict%d{" % len(obj))
        for k, v in obj.items():  # in order: a builder may draw in its inputs' order
            _feed(h, k)
            _feed(h, v)
    else:
        raise TypeError(f"no fingerprint for {type(obj).__name__}")
