"""Write one run's merged summaries as the summary files DriftLogger writes, so `ingest` loads them alike.

    OUT/run=<run>/run.json                  the run's config from the lake's run=<run>/run.json
    OUT/run=<run>/summary-<table>.parquet       every step's rows of one summary table (schema metadata
                                            driftscope.summary = <table>)
    OUT/run=<run>/summary-token_samples.parquet per step: how many tokens the summaries cover, how many rows kept
    OUT/run=<run>/tokens-sample.parquet         with --token-sample: the kept token rows, and routing-sample.parquet
                                            their routing rows (driftscope.summarised = 1: not summarised again)
"""
from __future__ import annotations

import json
from urllib.parse import quote
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from analysis.lake.layout import write_parquet


# The names DriftLogger's files use (analysis/logger_summaries.py; repeated here so that summarize does not import
# torch, which that module needs for its reductions; tests/test_lake_summarize.py checks that they agree).
SUMMARY_KEY = "driftscope.summary"
SUMMARISED_KEY = "driftscope.summarised"
SAMPLE_TABLE = "token_samples"
SAMPLE_COUNTS = ("n_tokens", "n_kept", "n_uniform", "n_worst_sequence_tokens", "n_top_tokens")


def sample_records(run: str, kept: list[tuple[int, dict[str, int]]], rate: float) -> pa.Table:
    """DriftLogger's per-step sample record (logger_summaries.sample_record), one row per step."""
    from analysis.lake.partial import TOP_TOKENS, WORST_SEQUENCES

    kept = sorted(kept)
    n = len(kept)
    columns = {"run": pa.array([run] * n, pa.string()), "step": pa.array([s for s, _ in kept], pa.int64()),
               "token_sample": pa.array([float(rate)] * n, pa.float64()),
               "worst_sequences": pa.array([WORST_SEQUENCES] * n, pa.int64()),
               "top_tokens": pa.array([TOP_TOKENS] * n, pa.int64())}
    for c in SAMPLE_COUNTS:
        columns[c] = pa.array([k[c] for _, k in kept], pa.int64())
    return pa.table(columns)


def write_run_summaries(out: Path, run: str, config: dict | None, tables: dict[str, pa.Table],
                        kept: list[tuple[int, dict[str, int]]], rate: float,
                        sample: dict[str, pa.Table | None] | None = None) -> list[Path]:
    """Write the files of one run under `out`/run=<run>/ (percent-encoded, as hive writers do); returns their paths."""
    folder = Path(out) / f"run={quote(run, safe='')}"  # one folder level whatever the name holds
    folder.mkdir(parents=True, exist_ok=True)
    fs = pafs.LocalFileSystem()
    written = []
    (folder / "run.json").write_text(json.dumps({"run": run, "config": config}, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    files = {f"summary-{name}": (table, {SUMMARY_KEY: name}) for name, table in tables.items()}
    files[f"summary-{SAMPLE_TABLE}"] = (sample_records(run, kept, rate), {SUMMARY_KEY: SAMPLE_TABLE})
    for kind, rows in (sample or {}).items():
        if rows is not None and rows.num_rows:
            files[f"{kind}-sample"] = (rows, {SUMMARISED_KEY: "1"})
    for name, (table, metadata) in files.items():
        path = folder / f"{name}.parquet"
        write_parquet(fs, str(path), table, metadata)
        written.append(path)
    return written
