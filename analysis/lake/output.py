"""Write one run's merged summaries as the summary files DriftLogger writes, so `ingest` loads them alike.

    OUT/<run>/run.json                      the run's config from the lake's run=<run>/run.json
    OUT/<run>/summary-<table>.parquet       every step's rows of one summary table (schema metadata
                                            driftscope.summary = <table>)
    OUT/<run>/summary-token_samples.parquet per step: how many tokens the summaries cover, how many rows kept
    OUT/<run>/tokens-sample.parquet         with --token-sample: the kept token rows, and routing-sample.parquet
                                            their routing rows (driftscope.summarised = 1: not summarised again)
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from analysis.lake.layout import write_parquet


def _sample_records(run: str, kept: list[tuple[int, dict[str, int]]], rate: float) -> pa.Table:
    """DriftLogger's per-step sample record (analysis.logger_summaries.sample_record), one row per step."""
    from analysis.logger_summaries import sample_record
    from analysis.token_sample import Kept, SamplePlan

    plan = SamplePlan(float(rate))
    return pa.concat_tables([sample_record(run, step, Kept(**counts), plan) for step, counts in sorted(kept)])


def write_run_summaries(out: Path, run: str, config: dict | None, tables: dict[str, pa.Table],
                        kept: list[tuple[int, dict[str, int]]], rate: float,
                        sample: dict[str, pa.Table | None] | None = None) -> list[Path]:
    """Write the files of one run under `out`/<run>/; returns their paths."""
    from analysis.logger import safe_run_name
    from analysis.logger_summaries import SAMPLE_TABLE, SUMMARISED_KEY, SUMMARY_KEY

    folder = Path(out) / safe_run_name(run)
    folder.mkdir(parents=True, exist_ok=True)
    fs = pafs.LocalFileSystem()
    written = []
    (folder / "run.json").write_text(json.dumps({"run": run, "config": config}, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    files = {f"summary-{name}": (table, {SUMMARY_KEY: name}) for name, table in tables.items()}
    files[f"summary-{SAMPLE_TABLE}"] = (_sample_records(run, kept, rate), {SUMMARY_KEY: SAMPLE_TABLE})
    for kind, rows in (sample or {}).items():
        if rows is not None and rows.num_rows:
            files[f"{kind}-sample"] = (rows, {SUMMARISED_KEY: "1"})
    for name, (table, metadata) in files.items():
        path = folder / f"{name}.parquet"
        write_parquet(fs, str(path), table, metadata)
        written.append(path)
    return written
