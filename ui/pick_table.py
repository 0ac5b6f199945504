"""A small clickable table: a click (or Enter) on a row sends that row's id to Python; a click (or Enter) on a
header sorts.

Why not `st.dataframe(on_select=...)`: its data grid (canvas, Arrow, the grid's code) was ~0.28 s of a fresh open of
the Sequences page (benchmarks/RESULTS-pages.md), more than everything else on it but the chart. This table is
plain DOM built by a few lines of script (a `st.components.v2` component, no iframe), so it costs what its rows do.

Cells arrive as text formatted here and are set with `textContent` in the browser: a value is never markup.
"""
from __future__ import annotations

import math

import polars as pl
import streamlit as st

_CSS = """
table { border-collapse: collapse; font-size: 0.85rem; font-variant-numeric: tabular-nums; width: max-content;
        min-width: 100%; }
.wrap { overflow-x: auto; max-height: 420px; overflow-y: auto; border: 1px solid rgba(128,128,128,0.25);
        border-radius: 0.5rem; }
th, td { padding: 0.25rem 0.6rem; text-align: right; white-space: nowrap;
         border-bottom: 1px solid rgba(128,128,128,0.15); }
th { position: sticky; top: 0; background: var(--st-secondary-background-color); cursor: pointer;
     font-weight: 600; user-select: none; }
th.num, td.num { text-align: right; } th.text, td.text { text-align: left; }
tbody tr { cursor: pointer; }
tbody tr:hover { background: var(--st-secondary-background-color); }
tbody tr.picked { background: color-mix(in srgb, var(--st-primary-color) 18%, transparent); }
tbody tr:focus-visible, th:focus-visible { outline: 2px solid var(--st-primary-color); outline-offset: -2px; }
"""

# data: {columns: [name], kinds: ["num" | "text"], rows: [[text]], sort: [[number | null]], ids: [int],
#        picked: int | null}. A click or Enter on a row sets the trigger `open` to its id.
_JS = """
export default function(component) {
  const { data, parentElement, setTriggerValue } = component;
  let wrap = parentElement.querySelector(".wrap");
  if (!wrap) { wrap = document.createElement("div"); wrap.className = "wrap"; parentElement.appendChild(wrap); }
  const order = data.ids.map((_, i) => i);
  let by = -1, desc = false;
  function draw() {
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    data.columns.forEach((name, c) => {
      const th = document.createElement("th");
      th.className = data.kinds[c];
      th.textContent = name + (c === by ? (desc ? " ▼" : " ▲") : "");
      th.tabIndex = 0;
      if (c === by) th.setAttribute("aria-sort", desc ? "descending" : "ascending");
      th.onclick = () => { desc = c === by ? !desc : data.kinds[c] === "num"; by = c; sort(); draw(); };
      th.onkeydown = (e) => { if (e.key === "Enter") th.onclick(); };
      head.appendChild(th);
    });
    const body = table.createTBody();
    for (const i of order) {
      const tr = body.insertRow();
      tr.tabIndex = 0;
      if (data.ids[i] === data.picked) { tr.className = "picked"; tr.setAttribute("aria-current", "true"); }
      data.rows[i].forEach((text, c) => {
        const td = tr.insertCell();
        td.className = data.kinds[c];
        td.textContent = text;
      });
      tr.onclick = () => setTriggerValue("open", data.ids[i]);
      tr.onkeydown = (e) => { if (e.key === "Enter") setTriggerValue("open", data.ids[i]); };
    }
    wrap.replaceChildren(table);
  }
  function sort() {  // missing values last either way
    order.sort((a, b) => {
      const x = data.sort[a][by], y = data.sort[b][by];
      if (x === y) return a - b;
      if (x === null) return 1;
      if (y === null) return -1;
      return (x < y ? -1 : 1) * (desc ? -1 : 1);
    });
  }
  draw();
}
"""

_table = st.components.v2.component("driftscope.pick_table", css=_CSS, js=_JS)


def cell(value) -> str:
    """A value as the table shows it: floats to 4 significant digits, ints with thousands separators, none as —."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def payload(df: pl.DataFrame, id_column: str, picked: int | None = None) -> dict:
    """The component's data for `df` (rows in their order), each row opened by its `id_column` value."""
    kinds = ["num" if t.is_numeric() else "text" for t in df.dtypes]
    columns = [df[c].to_list() for c in df.columns]
    rows = [list(r) for r in zip(*columns)] if df.height else []

    def key(v):  # a sort key JSON can carry: numbers as they are, text as itself, none and NaN as null
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return None
        return v

    return {"columns": df.columns, "kinds": kinds, "rows": [[cell(v) for v in r] for r in rows],
            "sort": [[key(v) for v in r] for r in rows], "ids": [int(v) for v in df[id_column].to_list()],
            "picked": picked}


def pick_table(df: pl.DataFrame, id_column: str, key: str, picked: int | None = None, on_open=None):
    """Draw `df` as a clickable table; returns the id of the row clicked in this run (None: no click).
    `on_open(id)`, if given, runs as a callback before the script reruns (it may set widget state)."""
    def opened():
        value = st.session_state[key].get("open") if key in st.session_state else None
        if value is not None and on_open is not None:
            on_open(int(value))

    result = _table(key=key, data=payload(df, id_column, picked), on_open_change=opened)
    value = getattr(result, "open", None)
    return None if value is None else int(value)
