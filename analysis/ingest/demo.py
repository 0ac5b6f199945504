"""The bundled demo runs (data/demo/, written by the drift lab): loaded when the database is empty."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from analysis.store import Store

if TYPE_CHECKING:
    from analysis.ingest.load import Outcome

DEMO_DIR = Path(__file__).resolve().parents[2] / "data" / "demo"


def ensure_demo(store: Store, demo_dir: Path = DEMO_DIR) -> list[Outcome]:
    """Load every demo run if the database holds no run yet; returns the outcomes (empty if nothing done)."""
    if store.run_names() or not demo_dir.is_dir():
        return []
    # the loader and its numba kernels (~0.3 s of imports) only when there is something to load: the app calls
    # this on every server start, before its first page
    from analysis.ingest import ingest_paths
    return ingest_paths(store, sorted(p for p in demo_dir.iterdir() if p.is_dir()))
