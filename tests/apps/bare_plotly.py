"""The baseline of `benchmarks/bench_pages.py --fresh`: a bare Streamlit page with one plotly chart
(st.plotly_chart, nothing of Driftscope), what any Streamlit dashboard costs a fresh browser session and a server
start on this machine."""
import math

import plotly.graph_objects as go
import streamlit as st

st.set_page_config(page_title="Bare", layout="wide")
st.title("Bare")
x = list(range(400))
st.plotly_chart(go.Figure(go.Scatter(x=x, y=[math.sin(i / 20) for i in x], mode="lines")).update_layout(height=300),
                key="bare_chart")
