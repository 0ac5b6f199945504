"""The `corrections`, `findings`, `load` and `eplb` commands of `python -m analysis` (parsers in
analysis/__main__.py)."""
from __future__ import annotations

import json
import sys

from analysis.store import Store


def _runs(store: Store, asked: list[str] | None) -> list[str]:
    known = store.run_names()
    missing = [r for r in (asked or []) if r not in known]
    if missing:
        raise ValueError(f"no run named {', '.join(map(repr, missing))} in {store.path} "
                         f"(runs: {', '.join(known) or 'none'})")
    return asked or known


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """'A:B' as the inclusive range (A, B); 'A:' and ':B' leave a side open; None stays None."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        rng = (int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"--steps takes A:B (inclusive step range, e.g. 0:99), got {text!r}") from None
    if rng[0] is not None and rng[1] is not None and rng[0] > rng[1]:
        raise ValueError(f"--steps {text}: the first step must not exceed the last")
    return rng  # type: ignore[return-value]


def run(store: Store, args) -> int:
    try:
        if args.command in ("load", "eplb"):
            _runs(store, [args.run])
            return _load(store, args) if args.command == "load" else _eplb(store, args)
        runs = _runs(store, args.run)
        if args.command == "corrections":
            return _corrections(store, runs, args)
        return _findings(store, runs, args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _corrections(store: Store, runs: list[str], args) -> int:
    from analysis.metrics.corrections import corrections, parse_param_args
    df = corrections(store, runs, args.method, parse_param_args(args.param), by=args.by)
    sys.stdout.write(df.write_csv() if args.format == "csv" else df.write_json() + "\n")
    return 0


def _findings(store: Store, runs: list[str], args) -> int:
    from analysis.findings import gates
    from analysis.findings.ranking import findings_many
    baselines = _runs(store, args.baseline) if args.baseline else None
    corridor = gates.parse_corridor(args.corridor)
    if args.corridor and not baselines:
        raise ValueError("--corridor sets the corridor of --baseline RUN: name the baseline runs")
    steps = parse_steps(args.steps)
    if baselines and not args.run:  # every run but the baselines
        runs = [r for r in runs if r not in baselines]
        if not runs:
            raise ValueError("every run is a --baseline: name the run to gate with --run")
    found = findings_many(store, runs, steps=steps, baselines=baselines, corridor=corridor, q=args.lattice_q)
    out = {run: [f.as_dict() for f in items] for run, items in found.items()}
    table = gates.corridor_gates(store, runs, baselines, corridor, steps) if baselines else None
    if args.format == "json":
        result = out if len(runs) > 1 else out[runs[0]]
        if table is not None:  # the corridor's every gate, passed ones too, beside the findings
            result = {"findings": result, "corridor": table.to_dicts()}
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    for run, items in out.items():
        print(f"== {run}")
        for i, f in enumerate(items, 1):
            print(f"{i}. [{f['severity']}] {f['kind']}: {f['title']}")
            for key, value in f["evidence"]["numbers"].items():
                print(f"     {key} = {value:.6g}" if isinstance(value, float) else f"     {key} = {value}")
            print(f"     see: {f['evidence']['url']}")
            print(f"     try: {f['action']} (source: {f['source']})")
        if table is not None:
            print(f"   corridor gates against {', '.join(baselines)} ({corridor.text()}):")
            for g in table.filter(table["run"] == run).iter_rows(named=True):
                shares = "" if g["n_tokens"] is None or g["status"] != "fail" else \
                    f"; tokens beyond: {g['n_beyond_max']} of {g['n_tokens']}"
                print(f"     {g['status']:8} {g['metric']}: {g['detail']}{shares}")
    return 0


def pair_run_name(store: Store, of: str, run: str | None) -> str:
    """The run name of a trainer-vs-trainer rerun of `of` (`ingest --pair-of`): `run`, or `of`-trainer-self;
    refuses a missing `of` and a rerun named as `of` itself (its rows would join the run they are compared with)."""
    known = store.run_names()
    if of not in known:
        raise ValueError(f"--pair-of: no run named {of!r} in {store.path} (runs: {', '.join(known) or 'none'}); "
                         "ingest the run first")
    name = run or f"{of}-trainer-self"
    if name == of:
        raise ValueError(f"--pair-of {of}: the rerun needs a name of its own (--run NAME), not {of!r}")
    return name


def mark_pairs(store: Store, of: str, loaded) -> list[str]:
    """Record in each run loaded by `loaded` (ingest Outcomes) that it is a trainer-vs-trainer rerun of `of`:
    config pair_of = of, pair_kind = trainer_self (the rest of its config kept). Returns those runs."""
    from analysis.findings.pairs import TRAINER_SELF
    runs = sorted({r for o in loaded for r in o.runs if r != of})
    for run in runs:
        store.set_run_config(run, store.run_config(run) | {"pair_of": of, "pair_kind": TRAINER_SELF})
    return runs


def _write(df, fmt: str) -> None:
    sys.stdout.write(df.write_csv() if fmt == "csv" else df.write_json() + "\n")


def _load(store: Store, args) -> int:
    from analysis.metrics.load import load_table
    _write(load_table(store, args.run, parse_steps(args.steps), args.n_experts, args.ep_size), args.format)
    return 0


def _eplb(store: Store, args) -> int:
    from analysis.metrics.rebalance import what_if
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    except ValueError:
        raise ValueError(f"--layers takes comma-separated layer numbers, got {args.layers!r}") from None
    df, _ = what_if(store, args.run, args.replicas, args.nodes, args.gpus, args.groups, layers, args.window,
                    parse_steps(args.steps), args.n_experts, args.side)
    _write(df, args.format)
    return 0
