"""Command line: `python -m analysis {ingest,watch,runs,metrics,corrections,findings,load,eplb,summarize,warm,lab,
probe} ...`
(see README, 'Command line')."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from analysis import settings


def _db_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", default=None, help="DuckDB file (default: $DRIFT_DB or data/drift.duckdb)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m analysis", description="Driftscope: sampler/trainer drift")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ingest", help="validate and load log files/folders into the database")
    p.add_argument("paths", nargs="+")
    p.add_argument("--run", default=None, help="run name for files that carry none (overrides the file's)")
    p.add_argument("--map", action="append", default=[], metavar="COLUMN=FIELD",
                   help="JSON Lines / Parquet whose keys match no format: the field holding a SCHEMA column "
                        "(repeatable), e.g. --map sampler_logprob=rollout_logprobs (docs/frameworks.md)")
    p.add_argument("--pair-of", default=None, metavar="RUN",
                   help="the files are a trainer-vs-trainer rerun of RUN's tokens: stored as a run paired with RUN "
                        "(config pair_of, pair_kind trainer_self; run name: --run, default RUN-trainer-self)")
    _db_arg(p)
    p = sub.add_parser("runs", help="list runs (CSV)")
    _db_arg(p)
    p = sub.add_parser("metrics", help="metrics table (CSV or JSON)")
    _db_arg(p)
    p.add_argument("--run", action="append", default=None, help="run name (repeatable; default: all runs)")
    p.add_argument("--by", choices=("step", "layer", "run"), default="step")
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p.add_argument("--cap", type=float, default=2.0, help="importance-ratio cap C (default 2.0; summaries answer "
                   "1.2, 1.5, 2, 3, 5, 10 exactly, other values are computed from the token rows)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range epsilon (default 0.2; summaries answer "
                   "0.1, 0.2, 0.28, 0.3, 0.5, other values use the token rows)")
    p.add_argument("--as", dest="framework", default=None, metavar="FRAMEWORK",
                   choices=("verl", "verl-actor", "nemo", "prime-rl", "slime"),
                   help="the metrics a framework logs, named and computed as it does (verl, verl-actor, nemo, "
                        "prime-rl, slime; docs/METRICS.md)")
    p.add_argument("--param", action="append", default=[], metavar="K=V",
                   help="with --as: a framework parameter, e.g. --param micro_batch_seqs=2 (repeatable); without "
                        "it, q=Q: the quantum of lattice_share_q (default 0.125, from summaries; others read tokens)")
    p = sub.add_parser("watch", help="load what is in the folders, then each new complete file, until Ctrl-C")
    p.add_argument("paths", nargs="+", metavar="DIR")
    p.add_argument("--run", default=None, help="run name for files that carry none (overrides the file's)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls of the folders (default 1)")
    p.add_argument("--settle", type=float, default=None,
                   help="seconds a file must keep its size and time before it is read (default: the interval)")
    _db_arg(p)
    p = sub.add_parser("corrections", help="what an off-policy correction would mask (METRICS.md Corrections)")
    _db_arg(p)
    p.add_argument("--run", action="append", default=None, help="run name (repeatable; default: all runs)")
    p.add_argument("--method", required=True, choices=("tis", "icepop", "geo_rs", "seq_rs", "veto", "verl_rs"))
    p.add_argument("--param", action="append", default=[], metavar="K=V",
                   help="method parameter, e.g. --param alpha=0.5 (repeatable; defaults in METRICS.md)")
    p.add_argument("--by", choices=("step", "run"), default="step")
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p = sub.add_parser("findings", help="ranked findings: what carries a run's mismatch, evidence, what to try")
    _db_arg(p)
    p.add_argument("--run", action="append", default=None, help="run name (repeatable; default: all runs)")
    p.add_argument("--steps", default=None, metavar="A:B", help="inclusive step range, e.g. 0:99")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--baseline", action="append", default=None, metavar="RUN",
                   help="trusted earlier run (repeatable): gate each metric on a corridor around their mean")
    p.add_argument("--corridor", action="append", default=[], metavar="K=V",
                   help="corridor parameter rel_up, rel_down or floor (defaults 0.5, 0.8, 0.02; repeatable)")
    p.add_argument("--lattice-q", type=float, default=0.125, metavar="Q",
                   help="the quantum of the lattice finding (default 0.125, an FP8 step)")
    p = sub.add_parser("load", help="expert load per (step, layer): every engine's definition (METRICS.md)")
    _db_arg(p)
    p.add_argument("--run", required=True)
    p.add_argument("--steps", default=None, metavar="A:B", help="inclusive step range, e.g. 0:99")
    p.add_argument("--n-experts", type=int, default=None, help="experts of the model (default: config n_experts)")
    p.add_argument("--ep-size", type=int, default=None, help="EP ranks, experts in contiguous blocks (default: "
                   "the stored placement, else config ep_size; without either, no rank columns)")
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p = sub.add_parser("eplb", help="rebalancing what-if: replicate and pack experts, forecast the next window")
    _db_arg(p)
    p.add_argument("--run", required=True)
    p.add_argument("--layers", default=None, help="comma-separated MoE layers (default: all)")
    p.add_argument("--replicas", type=int, required=True, help="physical expert slots in all")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--groups", type=int, default=None, help="expert groups (default: --nodes)")
    p.add_argument("--window", type=int, default=None, help="steps fitted on; the forecast is the next as many "
                   "(default: half the steps)")
    p.add_argument("--steps", default=None, metavar="A:B", help="inclusive step range, e.g. 0:99")
    p.add_argument("--n-experts", type=int, default=None, help="experts of the model (default: config n_experts)")
    p.add_argument("--side", choices=("sampler", "trainer"), default="sampler")
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    from analysis.lake.cli import add_parser as add_summarize
    add_summarize(sub)
    sub.add_parser("warm", help="compile the ingest kernels now (once per install, ~7 s), not in the first ingest")
    sub.add_parser("lab", help="run the torch drift lab (options: python -m analysis lab --help)", add_help=False)
    sub.add_parser("probe", help="where drift starts, layer by layer (options: python -m analysis probe --help)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # a bad DRIFT_* value stops every command before it does anything
        settings.check()
    except settings.SettingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if argv and argv[0] == "lab":  # the lab owns its options; torch is imported only on this path
        from analysis.lab.cli import main as lab_main
        return lab_main(argv[1:])
    if argv and argv[0] == "probe":  # the same for the drift-origin probe (torch, transformers)
        from analysis.probe.cli import main as probe_main
        return probe_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in ("ingest", "watch"):  # a load's start runs on one core: leave out what it never uses
        # kept: the 40M-token ingest took 0.39 s (3.4 %) longer without it, four quiet pairs (RESULTS-scale.md)
        from analysis.ingest.lean import lean_start
        lean_start()
    if args.command == "ingest":  # on the free core while the imports below hold the other one
        from analysis.ingest.hashing import hash_ahead
        hash_ahead(args.paths)
    from analysis.store import Store, StoreError, default_db_path
    if args.command == "warm":  # no database either
        from analysis.ingest.warm import warm
        nice = settings.WARM_NICE.read()
        if nice is not None and hasattr(os, "nice"):  # the app's child gives way to its pages
            os.nice(nice)
        warm()
        return 0
    if args.command == "summarize":  # reads a lake and writes files: no database
        from analysis.lake.cli import main as summarize_main
        return summarize_main(args)
    db = args.db or default_db_path()
    try:
        if args.command == "ingest":
            return _ingest(db, args)
        if args.command == "watch":
            from analysis.ingest.watch import follow
            return follow(db, args.paths, run=args.run, interval=args.interval, settle=args.settle)
        store = Store(db, read_only=True)
        if args.command == "runs":
            out = store.runs().drop("config", "has_trainer_routing")
            sys.stdout.write(out.write_csv())
            return 0
        if args.command in ("corrections", "findings", "load", "eplb"):
            from analysis import commands
            return commands.run(store, args)
        return _metrics(store, args)
    except StoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _ingest(db, args) -> int:
    from analysis.ingest import ingest_paths
    from analysis.ingest.hashing import cancel_ahead
    from analysis.ingest.limits import INGEST_MEMORY_LIMIT
    from analysis.ingest.mapping import ingest_mapped, parse_map_args
    from analysis.ingest.progress import TerminalProgress
    from analysis.ingest import open_store
    try:
        mapping = parse_map_args(args.map)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # An internal error is one "error" line; its traceback (logged by ingest) only with DRIFT_DEBUG=1.
    logging.basicConfig(level=logging.DEBUG if settings.DEBUG.read() else logging.CRITICAL,
                        format="%(levelname)s %(name)s: %(message)s")
    store = open_store(db, memory_limit=settings.MEMORY_LIMIT.read() or INGEST_MEMORY_LIMIT)
    if args.pair_of is not None:
        from analysis.commands import pair_run_name
        try:
            args.run = pair_run_name(store, args.pair_of, args.run)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            store.close()
            return 2
    bar = TerminalProgress()
    if bar.enabled:
        from analysis.ingest.warm import compiled
        if compiled() is False:
            print("compiling the ingest kernels for this install, once (~7 s; `python -m analysis warm` does it "
                  "ahead)", file=sys.stderr)
    try:
        outcomes = (ingest_mapped(store, args.paths, mapping, run=args.run) if mapping
                    else ingest_paths(store, args.paths, run=args.run, progress=bar.file, on_rows=bar.rows))
    finally:
        bar.close()
        cancel_ahead()  # hashes of files that never started loading
    failed, errors = 0, 0
    for outcome in outcomes:
        print(outcome.line(), file=sys.stdout if outcome.status in ("loaded", "skipped") else sys.stderr)
        failed += outcome.status == "refused"
        errors += outcome.status == "error"
    if args.pair_of is not None:
        from analysis.commands import mark_pairs
        for run in mark_pairs(store, args.pair_of, [o for o in outcomes if o.status == "loaded"]):
            print(f"paired {run} with {args.pair_of} (trainer_self)")
    store.close()
    return 3 if errors else 1 if failed else 0


def _metrics(store, args) -> int:
    from analysis.metrics import report
    runs = args.run or store.run_names()
    missing = [r for r in runs if r not in store.run_names()]
    if missing:
        print(f"error: no run named {', '.join(map(repr, missing))} in {store.path} "
              f"(runs: {', '.join(store.run_names()) or 'none'})", file=sys.stderr)
        return 1
    lattice_q = None
    if args.framework is None and args.param and args.by != "layer":
        from analysis.metrics.frameworks import parse_param_args
        try:  # without --as, --param q=Q: lattice_share_q's quantum (METRICS.md v3), from the token rows
            params = parse_param_args(args.param)
            if set(params) == {"q"}:
                lattice_q = float(params["q"])
                args.param = []
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    if args.framework is not None or args.param:
        from analysis.metrics.frameworks import framework_table, parse_param_args
        try:
            if args.framework is None:
                raise ValueError("--param needs --as FRAMEWORK (without it, only q=Q, the quantum of "
                                 "lattice_share_q)")
            if args.by == "layer":
                raise ValueError("--as takes --by step or --by run")
            df = framework_table(store, runs, args.framework, by=args.by, params=parse_param_args(args.param))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    else:
        try:
            df = report.metrics_table(store, runs, by=args.by, cap=args.cap, clip=args.clip, q=lattice_q)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    sys.stdout.write(df.write_csv() if args.format == "csv" else df.write_json())
    if args.format == "json":
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
