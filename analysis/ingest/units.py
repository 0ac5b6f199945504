"""What ingest works on and reports: a Unit (one all-or-nothing load) and its Outcome.

A module of its own so that the readers and framework adapters that build units import it without importing
the orchestrator (load.py), which imports them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from analysis.ingest.detect import Detected
from analysis.ingest.limits import Limits
from analysis.ingest.validate import Batch


@dataclass
class Unit:
    """One all-or-nothing load: usually one file; a framework adapter may join several (slime)."""
    name: str
    paths: list[Path]
    detected: Detected
    reader: Callable[["Unit", Limits], Iterator[Batch]]
    config: dict | None = None
    skip: str | None = None  # set by an adapter for a unit it recognised but must not load yet (the reason)
    # the smallest difference the log resolves where its writer rounds (precision.py); a reader may set it
    precision_floor: float | None = None


@dataclass
class Outcome:
    name: str
    status: str  # "loaded" | "skipped" | "refused" (the file broke a rule) | "error" (a bug of ours)
    format: str | None = None
    rows: dict[str, int] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    message: str = ""
    rule: str = ""  # for "refused": the rule broken (IngestError.rule)

    def line(self) -> str:
        if self.status == "loaded":
            parts = ", ".join(f"{v} {k} rows" for k, v in self.rows.items() if v)
            if not parts:  # a file of headers only: nothing to name a run by
                return f"loaded {self.name} [{self.format}]: no rows"
            return f"loaded {self.name} [{self.format}]: {parts} -> run {', '.join(self.runs)}"
        if self.status == "skipped":
            return f"skipped {self.name}: {self.message}"
        return f"{self.status} {self.message}"
