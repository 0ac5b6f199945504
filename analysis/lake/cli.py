"""The `summarize` subcommand's options and its one-line-per-problem report (see analysis/lake/summarize.py)."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("summarize", help="summaries of a Parquet lake of full logs, written as summary files")
    p.add_argument("lake", help="lake root: local path or URI pyarrow reads (s3://, gs://); "
                                "layout run=<name>/step=<n>/*.parquet (docs/SCHEMA.md)")
    p.add_argument("--out", required=True, help="folder for the summary files (then: python -m analysis ingest OUT)")
    p.add_argument("--engine", choices=("duckdb", "ray"), default="duckdb",
                   help="duckdb: in this process (default); ray: one Ray task per (run, step) partition")
    p.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray with 2 CPUs)")
    p.add_argument("--run", default=None, help="only this run of the lake")
    p.add_argument("--token-sample", type=float, default=0.0, metavar="P",
                   help="also write this share of token rows (plus the worst sequences and top |Δ| tokens) "
                        "for the drill-down views (default 0: summaries only)")


def main(args: argparse.Namespace) -> int:
    from analysis.lake.summarize import summarize
    try:
        report = summarize(args.lake, args.out, engine=args.engine, address=args.address, run=args.run,
                           token_sample=args.token_sample)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for line in report.notes:
        print(f"note: {line}", file=sys.stderr)
    for line in report.refused:
        print(f"refused {line}", file=sys.stderr)
    for line in report.failed:
        print(f"failed {line}", file=sys.stderr)
    done = report.partitions - len(report.refused) - len(report.failed)
    print(f"summarised {done} of {report.partitions} partitions ({report.tokens} tokens) -> "
          f"{len(report.written)} files in {args.out}")
    return 0 if report.ok else 1
