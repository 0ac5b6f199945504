"""A two-chart page for tests/test_browser_plot.py: ui/plot.py's element on its own, outside the app.
"Same figures" reruns with unchanged figures; "New figure" replaces the first chart's figure."""
import sys
from pathlib import Path

import plotly.graph_objects as go
import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ui import plot  # noqa: E402

st.title("Plot probe")
ss = st.session_state
ss.setdefault("version", 0)
if st.button("New figure"):
    ss.version += 1
st.button("Same figures")
n = 50 + ss.version
plot.show(go.Figure(go.Scatter(x=list(range(n)), y=[i * i for i in range(n)], name="squares"))
          .update_layout(height=300, uirevision="probe"), key="probe_line")
plot.show(go.Figure(go.Heatmap(z=[[i * j for j in range(30)] for i in range(20)])).update_layout(height=300),
          key="probe_heatmap")
st.caption(f"version {ss.version}")
