"""Exact, mergeable summaries (schema.py), computed at ingest (compute.py), turned into METRICS.md columns
(finalise.py) and read by the run-, step-, layer- and bucket-level views (read.py)."""
