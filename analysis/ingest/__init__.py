"""Ingestion: recognise each input by content, validate it against SCHEMA.md, load it all-or-nothing.

    from analysis.store import Store
    from analysis.ingest import ingest_paths
    outcomes = ingest_paths(Store("data/drift.duckdb"), ["logs/"], run="bf16-baseline")
"""
from analysis.ingest.errors import IngestError
from analysis.ingest.limits import Limits
from analysis.ingest.load import Outcome, expand, ingest_paths, load_unit

__all__ = ["IngestError", "Limits", "Outcome", "expand", "ingest_paths", "load_unit"]
