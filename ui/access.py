"""Viewer mode: DRIFT_READ_ONLY=1 hides every action that changes the database (upload, delete, config edit,
lab runs). One place decides, so a hosted deployment can harden it without touching the pages."""
from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}

VIEWER_MESSAGE = ("This Driftscope is in viewer mode (DRIFT_READ_ONLY=1): uploads, deletions, config edits and "
                  "lab runs are switched off. Run your own copy to load data: `streamlit run app.py`.")


def read_only() -> bool:
    """True when the app must not change the database."""
    return os.environ.get("DRIFT_READ_ONLY", "").strip().lower() in _TRUE


def writable() -> bool:
    return not read_only()


def demo_disabled() -> bool:
    """DRIFT_NO_DEMO=1: an empty database stays empty (tests of empty states, deployments without demo)."""
    return os.environ.get("DRIFT_NO_DEMO", "").strip().lower() in _TRUE
