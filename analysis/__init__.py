"""Driftscope analysis library: ingest drift logs into DuckDB and compute mismatch metrics.

Never imports streamlit; the CLI (`python -m analysis`) and the pages call the same functions.
"""
