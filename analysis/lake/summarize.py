"""`python -m analysis summarize LAKE --out DIR`: the summaries of every (run, step) of a lake, as summary files.

The driver lists the partitions, runs one task per partition on an engine (analysis.lake.engines), merges the
partial summaries exactly, and writes per run the summary files `python -m analysis ingest DIR` loads. A
partition that breaks SCHEMA.md, or whose task fails for good, is reported by its path; the others complete.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from analysis.lake import partial
from analysis.lake.engines import MAX_RETRIES, Failed, run_local, run_ray
from analysis.lake.layout import list_partitions
from analysis.lake.task import PartitionResult, summarize_partition


@dataclass
class Report:
    partitions: int = 0
    tokens: int = 0
    refused: list[str] = field(default_factory=list)  # "run=a/step=3: <file>: <place>: <rule>"
    failed: list[str] = field(default_factory=list)  # "run=a/step=3: <error after retries>"
    notes: list[str] = field(default_factory=list)  # folders that are not the layout
    written: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.refused or self.failed)


def _progress(total: int, enabled: bool):
    """A progress bar on stderr when it is a terminal (tqdm's disable=None), none otherwise."""
    from tqdm import tqdm
    return tqdm(total=total, unit="partition", desc="summarize", disable=None if enabled else True,
                file=sys.stderr)


def summarize(lake: str, out: str | Path, engine: str = "duckdb", address: str | None = None,
              run: str | None = None, token_sample: float = 0.0, progress: bool = True,
              task: Callable[..., PartitionResult] = summarize_partition, max_retries: int = MAX_RETRIES) -> Report:
    """Summarise every partition of `lake` (of run `run` only, if given) into summary files under `out`."""
    from analysis.lake.output import write_run_summaries

    if not 0.0 <= token_sample <= 1.0:
        raise ValueError(f"--token-sample: expected a share of tokens in [0, 1], got {token_sample}")
    listing = list_partitions(lake, run)
    report = Report(partitions=len(listing.partitions), notes=list(listing.problems))
    if not listing.partitions:
        raise ValueError(f"no partitions under {lake!r}" + (f" for run {run!r}" if run else "")
                         + " (lake layout: run=<name>/step=<n>/*.parquet, see docs/SCHEMA.md)")
    if engine == "ray":
        results = run_ray(lake, listing.partitions, token_sample, address, max_retries, task)
    elif engine == "duckdb":
        results = run_local(lake, listing.partitions, token_sample, task)
    else:
        raise ValueError(f"--engine: expected duckdb or ray, got {engine!r}")

    parts: dict[str, list[PartitionResult]] = {}  # per run: the partitions' partial summaries
    bar = _progress(len(listing.partitions), progress)
    for res in results:
        if isinstance(res, Failed):
            report.failed.append(f"{res.partition.name}: {res.error}")
        elif res.refused:
            report.refused.append(f"run={res.run}/step={res.step}: {res.refused}")
        else:
            parts.setdefault(res.run, []).append(res)
            report.tokens += res.n_tokens
        bar.update(1)
    bar.close()

    for name, results_of_run in sorted(parts.items()):
        tables = {t: partial.merge(t, (r.tables.get(t) for r in results_of_run)) for t in partial.MERGED_TABLES}
        sample = {k: partial.concat([r.sample.get(k) for r in results_of_run]) for k in ("tokens", "routing")}
        report.written.extend(write_run_summaries(out, name, listing.configs.get(name), tables, sample))
    return report
