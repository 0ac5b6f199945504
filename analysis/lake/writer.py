"""DriftLogger's lake layout: each rank writes its full token (and routing) rows of a step as one file per kind
into `LAKE/run=<run>/step=<n>/` (analysis/lake/layout.py), for `summarize` to reduce later, on any machine."""
from __future__ import annotations

import pyarrow as pa

from analysis.lake.layout import write_file, write_run_json


class LakeWriter:
    """Writes the files of one (run, rank) into a lake; `lake` is a local path or a URI pyarrow opens."""

    def __init__(self, lake: str, run: str, rank: int, config: dict | None):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank: expected an int >= 0, got {rank!r}")
        self.lake, self.run, self.rank = str(lake), run, rank
        write_run_json(self.lake, run, config)

    def write_step(self, step: int, tokens: pa.Table, routing: pa.Table | None,
                   sequences: pa.Table | None = None) -> dict[str, str]:
        """tokens-r<rank>.parquet, routing-r<rank>.parquet and sequences-r<rank>.parquet of `step` (the last
        two where given); returns {kind: path}."""
        written = {"tokens": write_file(self.lake, self.run, step, "tokens", self.rank, tokens)}
        for kind, rows in (("routing", routing), ("sequences", sequences)):
            if rows is not None:
                written[kind] = write_file(self.lake, self.run, step, kind, self.rank, rows)
        return written
