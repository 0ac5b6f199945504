"""Streamlit-side helpers for the pages: shared state, access mode, plotly figure builders.

Nothing here runs SQL or computes a metric: data comes from `analysis/` functions, figures are built from
their DataFrames.
"""
