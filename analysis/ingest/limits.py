"""Caps that keep memory bounded whatever the input (overridable by environment for hosted use)."""
from __future__ import annotations

from dataclasses import dataclass

from analysis import settings

MiB = settings.MiB

# A file larger than this gets a transaction of its own (batches.py), as before batching: its own load is long enough
# that a commit does not matter, and a refusal of a later file never makes it load twice. It is also hashed while it
# loads, and the command line starts that hash ahead (hashing.py).
ALONE_BYTES = 8 << 20


@dataclass(frozen=True)
class Limits:
    max_line_bytes: int = settings.MAX_LINE.default                # one JSON line (one sequence) at most
    max_decompressed_bytes: int = settings.MAX_DECOMPRESSED.default  # a .gz stream, decompressed
    max_tensor_file_bytes: int = settings.MAX_TENSOR_FILE.default    # .pt / .safetensors are read whole
    batch_rows: int = 491_520               # rows per read batch (4 DuckDB row groups)

    @classmethod
    def from_env(cls) -> "Limits":
        """The caps the DRIFT_MAX_*_MB settings ask for."""
        return cls(max_line_bytes=settings.MAX_LINE.read(),
                   max_decompressed_bytes=settings.MAX_DECOMPRESSED.read(),
                   max_tensor_file_bytes=settings.MAX_TENSOR_FILE.read())


def human_size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n:,} bytes"


# DuckDB's memory_limit for `python -m analysis ingest` unless DRIFT_MEMORY_LIMIT says otherwise. DuckDB's own
# default (80% of RAM) lets its buffer pool grow with the file (3.2 GB peak RSS for a CTAS of 40M tokens); with
# this limit it writes out and spills, and the whole ingest stays under 1.5 GB (benchmarks/RESULTS-scale.md).
INGEST_MEMORY_LIMIT = "512MB"
