"""Benchmark `metrics --as FRAMEWORK` against the plain `metrics` table, in process, on the database of
bench_summaries.py (40M token rows, 400 steps; built once and cached in benchmarks/work/, git-ignored).

    python benchmarks/bench_frameworks.py [--repeat 3] [--no-write]

Times, best of N in one process: report.metrics_table(by="step") (the summaries), and framework_table(by="step")
for every framework. The views that read the token rows (Σ s and Σ t per sequence for verl's perplexities, NeMo's
JS term, prime-rl's median) scan every token; slime reads the per-sequence summaries only. Results are appended
to benchmarks/RESULTS-frameworks.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_summaries import DB, RUN, best, build, is_built  # noqa: E402

from analysis.metrics import report  # noqa: E402
from analysis.metrics.frameworks import FRAMEWORKS, framework_table  # noqa: E402
from analysis.store import Store  # noqa: E402

RESULTS = ROOT / "benchmarks" / "RESULTS-frameworks.md"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if not is_built(DB):
        build(DB)
    store = Store(DB, read_only=True)
    n_tokens = store.scalar("SELECT count(*) FROM tokens")
    rows = [("metrics --by step", best(lambda: report.metrics_table(store, [RUN], by="step"), args.repeat))]
    for name in FRAMEWORKS:
        rows.append((f"metrics --by step --as {name}",
                     best(lambda: framework_table(store, [RUN], name, by="step"), args.repeat)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = (f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC · {platform.machine()} · {os.cpu_count()} cores"
            f" · load {os.getloadavg()[0]:.1f} · best of {args.repeat} · {commit}\n{n_tokens:,} token rows\n\n"
            "| table (in process) | seconds |\n|---|---|\n")
    text = head + "".join(f"| `{name}` | {t:.3f} |\n" for name, t in rows)
    print(text)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text("# Framework views: `metrics --as` against `metrics`\n\n"
                               "Command: `python benchmarks/bench_frameworks.py` (see its docstring).\n\n")
        with RESULTS.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
