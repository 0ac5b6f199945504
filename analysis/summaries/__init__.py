"""Exact, mergeable summaries, pure: their tables and merge rules (schema.py), the SQL of the per-token terms,
bins and filters that every query shares (sql.py), the numba kernel that sums a batch (kernel.py), and the
METRICS.md formulas over the sums (finalise.py, corrections.py). Imports nothing from ingest or the store:
ingest writes summaries (analysis/ingest/summarise.py), the metrics package reads them."""
