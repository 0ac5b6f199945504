"""Benchmark `metrics --as FRAMEWORK` against the plain `metrics` table on the database of bench_summaries.py
(benchmarks/inputs/summaries_db.py: 40M token rows, 400 steps; `--steps 80` builds an 8M-token one for a busy
machine; built once and cached in benchmarks/work/, git-ignored).

    python benchmarks/bench_frameworks.py [--steps 400] [--repeat 3] [--no-write] [--no-cli]

Times, best of N: the whole command as a child process (`python -m analysis metrics --by step [--as X]`, what a
user waits for: start, imports, the table, its CSV), and in one process report.metrics_table(by="step") (the
summaries) against framework_table(by="step") for every framework. The target (issue 41): each `--as` from
summaries as fast as plain `metrics` as a command (within ~1.1x), prime-rl excepted (its median and std read every
token row: about `metrics --source tokens`). Results are appended to benchmarks/RESULTS-frameworks.md.
"""
from __future__ import annotations

import argparse
import math
import sys

from harness import ROOT, record, repeat, timed
from inputs import summaries_db as D

from analysis.metrics import report
from analysis.metrics.frameworks import FRAMEWORKS, framework_table
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-frameworks.md"
INTRO = ("# Framework views: `metrics --as` against `metrics`\n\n"
         "Command: `python benchmarks/bench_frameworks.py` (see its docstring).\n")


def cli_seconds(db, names: list[str | None], rounds: int) -> dict[str | None, tuple[float, float]]:
    """(best wall, best CPU) seconds of `python -m analysis metrics --by step [--as name]` as a child process, per
    name; the commands take turns in each round, so that a burst of load on a shared machine hits them alike (CPU
    time, user + system, moves less with the load than wall time)."""
    best: dict[str | None, tuple[float, float]] = {}
    for _ in range(rounds):
        for name in names:
            cmd = [sys.executable, "-m", "analysis", "metrics", "--db", str(db), "--run", D.RUN, "--by", "step"]
            cmd += ["--as", name] if name else []
            res = timed(cmd)
            wall, cpu = best.get(name, (math.inf, math.inf))
            best[name] = (min(wall, res["seconds"]), min(cpu, res["cpu_seconds"]))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-cli", action="store_true", help="time in process only")
    ap.add_argument("--steps", type=int, default=D.STEPS,
                    help="steps of the database (200 sequences of 500 tokens each; 400 = 40M tokens)")
    ap.add_argument("--token-steps", type=int, default=None,
                    help="only this many steps get token rows (the summaries cover --steps): prime-rl, which reads "
                         "token rows, is left out")
    args = ap.parse_args()
    D.use_steps(args.steps, args.token_steps)
    names = [f for f in FRAMEWORKS if args.token_steps is None or f != "prime-rl"]
    db, _ = D.ensure()
    body = ""
    if not args.no_cli:
        secs = cli_seconds(db, [None, *names], args.repeat)
        (wall0, cpu0) = secs[None]
        body += "| command (child process) | wall s | × `metrics` | CPU s | × `metrics` |\n|---|---|---|---|---|\n"
        for name in [None, *names]:
            wall, cpu = secs[name]
            label = "metrics --by step" + (f" --as {name}" if name else "")
            body += f"| `{label}` | {wall:.2f} | {wall / wall0:.2f} | {cpu:.2f} | {cpu / cpu0:.2f} |\n"
        body += "\n"
    store = Store(db, read_only=True)
    n_tokens = store.scalar("SELECT sum(n_tokens) FROM summary_step")
    n_rows = store.scalar("SELECT count(*) FROM tokens")
    tables = {"metrics --by step": lambda: report.metrics_table(store, [D.RUN], by="step")}
    for name in names:
        tables[f"metrics --by step --as {name}"] = lambda name=name: framework_table(store, [D.RUN], name, by="step")
    body += ("| table (in process) | seconds |\n|---|---|\n"
             + "".join(f"| `{label}` | {repeat(fn, args.repeat).best:.3f} |\n" for label, fn in tables.items()))
    store.close()
    size = f"{n_tokens:,} summarised tokens" + ("" if n_rows == n_tokens else f" ({n_rows:,} token rows)")
    record(RESULTS, f"{size}, best of {args.repeat}\n\n" + body, INTRO, write=not args.no_write)


if __name__ == "__main__":
    main()
