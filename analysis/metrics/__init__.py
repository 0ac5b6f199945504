"""The read side: METRICS.md columns per run, step, layer and bucket, from the summaries (read.py and
dashboard.py are the table readers the pages and the CLI go through), and the token-level views that query
token rows (token.py, drilldown.py, sampled.py). Pure functions of a Store and parameters; polars out."""
