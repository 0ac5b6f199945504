"""Benchmark the summaries: `python -m analysis metrics --by step|run` as whole processes on a database with
40M summarised tokens (400 steps) and 16M routing rows (32 layers, top-8 of 64), against the token-level SQL.

    python benchmarks/bench_summaries.py [--repeat 5] [--rebuild] [--no-write]

The database (benchmarks/inputs/summaries_db.py, built once under benchmarks/work/, git-ignored) is written
straight with DuckDB SQL: 40M token rows and, for the routed tokens, routing rows with their derived columns and
expert_load (as inputs/metrics_db.py does); its build summarises the first 40 steps with the ingest hook
(summaries.compute.add_file, one "file" per 10 steps, timed) and repeats those summary rows over the other 360
steps (the query times depend on the row counts only).
Times, best of N, in the same run: the CLI as a whole process (`metrics --by step`, `--by run`,
`corrections --method icepop --by run`), the same tables in process from summaries (report.metrics_table) and
from token rows (metrics.token_metrics, the pre-summaries path), the correction simulator's default query
(corrections.compare_methods of icepop, geo_rs and seq_rs) from the per-sequence summaries and from every token
row, plus the process start-up alone (`python -c "import analysis.metrics.report"`).
Results are appended to benchmarks/RESULTS-summaries.md.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from harness import ROOT, record, repeat
from inputs import summaries_db as D

from analysis.metrics import corrections, report
from analysis.metrics import token as metrics
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-summaries.md"


def best(fn, rounds: int) -> float:
    return repeat(fn, rounds).best


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "analysis", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best counts")
    ap.add_argument("--rebuild", action="store_true", help="build the database again even if it exists")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-summaries.md")
    args = ap.parse_args()
    DB, built = D.ensure(args.rebuild)
    if built:
        print("built", built, flush=True)
    with Store(DB, read_only=True) as s:
        n_tok = s.scalar("SELECT sum(n_tokens)::BIGINT FROM summary_step")
        n_rout = s.scalar("SELECT count(*) FROM routing")
        rows = {t: s.scalar(f"SELECT count(*) FROM {t}") for t in
                D.SUMMARY_TABLES}
    res = {}
    res["startup"] = best(lambda: subprocess.run([sys.executable, "-c", "import analysis.metrics.report"], check=True),
                          args.repeat)
    for by in ("step", "run"):
        res[f"cli_{by}"] = best(lambda: cli("metrics", "--db", str(DB), "--by", by), args.repeat)
    res["cli_corr"] = best(lambda: cli("corrections", "--db", str(DB), "--method", "icepop", "--by", "run"), args.repeat)
    sim = [(m, dict(corrections.METHODS[m].defaults)) for m in ("icepop", "geo_rs", "seq_rs")]
    with Store(DB, read_only=True) as s:
        for by in ("step", "run"):
            res[f"summ_{by}"] = best(lambda: report.metrics_table(s, [D.RUN], by=by), args.repeat)
        for by in ("step", "run"):  # the token-row path the CLI took before: one scan of 40M rows
            res[f"tok_{by}"] = best(lambda: metrics.token_metrics(s, [D.RUN], by=by), 1)
        res["summ_corr"] = best(lambda: corrections.compare_methods(s, [D.RUN], sim, source="summaries"), args.repeat)
        res["tok_corr"] = best(lambda: corrections.compare_methods(s, [D.RUN], sim, source="tokens"), 2)
    lines = [
        "| | summaries | token rows (before) | ratio |",
        "|---|---:|---:|---:|",
        f"| `metrics --by step` in process | {res['summ_step']:.3f} s | {res['tok_step']:.3f} s | "
        f"{res['tok_step'] / res['summ_step']:.0f}× |",
        f"| `metrics --by run` in process | {res['summ_run']:.3f} s | {res['tok_run']:.3f} s | "
        f"{res['tok_run'] / res['summ_run']:.0f}× |",
        f"| correction simulator (icepop, geo_rs, seq_rs; per step and per run) in process | {res['summ_corr']:.3f} s | "
        f"{res['tok_corr']:.3f} s | {res['tok_corr'] / res['summ_corr']:.0f}× |",
        f"| `python -m analysis metrics --by step` (whole process) | {res['cli_step']:.3f} s | | |",
        f"| `python -m analysis metrics --by run` (whole process) | {res['cli_run']:.3f} s | | |",
        f"| `python -m analysis corrections --method icepop --by run` (whole process) | {res['cli_corr']:.3f} s | | |",
        f"| start-up alone (`python -c 'import analysis.metrics.report'`) | {res['startup']:.3f} s | | |",
    ]
    if built:
        lines.append(f"\nBuild: token rows {built['tokens_s']:.1f} s, routing rows {built['routing_s']:.1f} s; "
                     f"summaries via the ingest hook of the first {built['computed_tokens']:,} tokens: "
                     f"{built['summaries_tokens_s']:.1f} s ({built['computed_tokens'] / built['summaries_tokens_s'] / 1e6:.2f}"
                     f" M tokens/s), of their {built['computed_routing']:,} routing rows {built['summaries_routing_s']:.1f} s; "
                     "those summary rows repeated over the other steps.")
    record(RESULTS, "\n".join(lines), "# Summaries: metrics tables from summaries vs token rows",
           write=not args.no_write,
           note=f"Best of {args.repeat}; {n_tok:,} summarised tokens, {n_rout:,} routing rows; summary rows: "
                + ", ".join(f"{t} {n:,}" for t, n in rows.items()))


if __name__ == "__main__":
    main()
