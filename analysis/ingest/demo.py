"""The bundled demo runs (data/demo/, written by the drift lab): loaded when the database is empty."""
from __future__ import annotations

from pathlib import Path

from analysis.ingest import Outcome, ingest_paths
from analysis.store import Store

DEMO_DIR = Path(__file__).resolve().parents[2] / "data" / "demo"


def ensure_demo(store: Store, demo_dir: Path = DEMO_DIR) -> list[Outcome]:
    """Load every demo run if the database holds no run yet; returns the outcomes (empty if nothing done)."""
    if store.run_names() or not demo_dir.is_dir():
        return []
    return ingest_paths(store, sorted(p for p in demo_dir.iterdir() if p.is_dir()))
