"""Synthetic inputs that more than one benchmark uses, each built once under benchmarks/work/ (git-ignored) and
rebuilt when its builder's version changes: the 5M-token metrics database (metrics_db), the 40M-token summaries
database (summaries_db) and the run-scale Parquet files (scale_files)."""
from __future__ import annotations

from pathlib import Path


def seeded_store(path: Path):
    """(Store, cursor): a new database at `path` (one there before is removed) whose random() is seeded, so that
    a build written in SQL draws the same rows each time."""
    from analysis.store import Store

    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = Store(path)
    con = store.cursor()
    con.execute("SELECT setseed(0.42)")
    return store, con
