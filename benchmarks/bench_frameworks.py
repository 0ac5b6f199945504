"""Benchmark `metrics --as FRAMEWORK` against the plain `metrics` table, in process, on the database of
bench_summaries.py (benchmarks/inputs/summaries_db.py: 40M token rows, 400 steps; built once and cached in
benchmarks/work/, git-ignored).

    python benchmarks/bench_frameworks.py [--repeat 3] [--no-write]

Times, best of N in one process: report.metrics_table(by="step") (the summaries), and framework_table(by="step")
for every framework. The views that read the token rows (Σ s and Σ t per sequence for verl's perplexities, NeMo's
JS term, prime-rl's median) scan every token; slime reads the per-sequence summaries only. Results are appended
to benchmarks/RESULTS-frameworks.md.
"""
from __future__ import annotations

import argparse

from harness import ROOT, record, repeat
from inputs import summaries_db as D

from analysis.metrics import report
from analysis.metrics.frameworks import FRAMEWORKS, framework_table
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-frameworks.md"
INTRO = ("# Framework views: `metrics --as` against `metrics`\n\n"
         "Command: `python benchmarks/bench_frameworks.py` (see its docstring).\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    db, _ = D.ensure()
    store = Store(db, read_only=True)
    n_tokens = store.scalar("SELECT count(*) FROM tokens")
    tables = {"metrics --by step": lambda: report.metrics_table(store, [D.RUN], by="step")}
    for name in FRAMEWORKS:
        tables[f"metrics --by step --as {name}"] = lambda name=name: framework_table(store, [D.RUN], name, by="step")
    body = (f"{n_tokens:,} token rows, best of {args.repeat}\n\n| table (in process) | seconds |\n|---|---|\n"
            + "".join(f"| `{label}` | {repeat(fn, args.repeat).best:.3f} |\n" for label, fn in tables.items()))
    record(RESULTS, body, INTRO, write=not args.no_write)


if __name__ == "__main__":
    main()
