"""Ingestion: recognise each input by content, validate it against SCHEMA.md, load it all-or-nothing.

    from analysis.ingest import ingest_paths, open_store
    outcomes = ingest_paths(open_store("data/drift.duckdb"), ["logs/"], run="bf16-baseline")

The names below are imported on first use, so that a light module of this package (hashing.py, which the
command line starts before the rest) does not pull in the readers, numba and DuckDB.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"IngestError": "errors", "Limits": "limits", "Outcome": "load", "expand": "load",
            "ingest_paths": "load", "load_unit": "load", "open_store": "summarise"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"analysis.ingest.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'analysis.ingest' has no attribute {name!r}")
