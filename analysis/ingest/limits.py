"""Caps that keep memory bounded whatever the input (overridable by environment for hosted use)."""
from __future__ import annotations

import os
from dataclasses import dataclass

MiB = 1 << 20

# A file larger than this gets a transaction of its own (batches.py), as before batching: its own load is long enough
# that a commit does not matter, and a refusal of a later file never makes it load twice. It is also hashed while it
# loads, and the command line starts that hash ahead (hashing.py).
ALONE_BYTES = 8 << 20


def _env_mib(name: str, default_mib: int) -> int:
    return int(float(os.environ.get(name, default_mib)) * MiB)


@dataclass(frozen=True)
class Limits:
    max_line_bytes: int = 64 * MiB          # one JSON line (one sequence) at most
    max_decompressed_bytes: int = 4096 * MiB  # a .gz stream, decompressed
    max_tensor_file_bytes: int = 2048 * MiB  # .pt / .safetensors are read whole
    batch_rows: int = 491_520               # rows per read batch (4 DuckDB row groups)

    @classmethod
    def from_env(cls) -> "Limits":
        return cls(max_line_bytes=_env_mib("DRIFT_MAX_LINE_MB", 64),
                   max_decompressed_bytes=_env_mib("DRIFT_MAX_DECOMPRESSED_MB", 4096),
                   max_tensor_file_bytes=_env_mib("DRIFT_MAX_TENSOR_FILE_MB", 2048))


def human_size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n:,} bytes"


# DuckDB's memory_limit for `python -m analysis ingest` unless DRIFT_MEMORY_LIMIT says otherwise. DuckDB's own
# default (80% of RAM) lets its buffer pool grow with the file (3.2 GB peak RSS for a CTAS of 40M tokens); with
# this limit it writes out and spills, and the whole ingest stays under 1.5 GB (benchmarks/RESULTS-scale.md).
INGEST_MEMORY_LIMIT = "512MB"
