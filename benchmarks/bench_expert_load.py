"""Time the Expert load page's queries in process, each cold (a fresh Store) and warm, on a database of one run:

    python benchmarks/bench_expert_load.py [--db PATH --run NAME] [--rounds 3] [--no-write]

Without --db: a database of expert_load only, 400 steps × 32 layers × 64 experts (the run-scale database's shape,
benchmarks/inputs/summaries_db.py: 819,200 rows), built in SQL under benchmarks/work/. With --db (e.g. the page
benchmark's run-scale database, benchmarks/work/pages_scale.duckdb, 40M tokens + 16M routing rows), its run's
routing rows also feed the two bounded views (hot vs other drift, load by tag). The page reads `views` on open
and the others on their tabs; the first visit of every page at 40M tokens is timed by bench_pages.py. Results go
to benchmarks/RESULTS-expert-load.md."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import WORK, fresh_db, record, repeat

from analysis.metrics import hot_experts, load_views, rebalance
from analysis.store import Store

RESULTS = Path(__file__).resolve().parent / "RESULTS-expert-load.md"
INTRO = """# Expert load page queries

Seconds per call (best of the rounds, cold = the first call on a fresh Store). `views` is what the page computes
on open; the others run on their tabs. Budget: the other pages' first visit, 1 s at 40M tokens (RESULTS-pages.md).
"""
SYNTH = WORK / "expert_load.duckdb"
STEPS, LAYERS, EXPERTS = 400, 32, 64


def build_synthetic(path: Path) -> None:
    store = Store(fresh_db(path))
    with store.transaction() as w:
        w.execute("INSERT INTO runs (run, config) VALUES ('bench', '{\"ep_size\": 8}')")
        # a persistent hot set (every 7th expert ×5) and noise
        w.execute(f"""INSERT INTO expert_load SELECT 'bench', st, la, e,
                          (100 + 50 * random() * CASE WHEN e % 7 = 0 THEN 5 ELSE 1 END)::BIGINT,
                          (100 + 50 * random())::BIGINT, 1
                      FROM range({STEPS}) a(st), range({LAYERS}) b(la), range({EXPERTS}) c(e)""")
    store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", type=Path, default=None)
    ap.add_argument("--run", default="bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    db = args.db
    if db is None:
        WORK.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        build_synthetic(SYNTH)
        print(f"built {SYNTH} in {time.perf_counter() - t0:.1f}s")
        db = SYNTH
    probe = Store(db, read_only=True)
    n_experts = load_views.views(probe, args.run)["n_experts"]
    probe.close()
    calls = {
        "views (on open)": lambda s: load_views.views(s, args.run, None, "sampler", None, None),
        "layer_timeline (Hot experts)": lambda s: load_views.layer_timeline(s, args.run, 0),
        "hot_drift (Hot experts, ≤ 8 steps of routing rows)": lambda s: hot_experts.hot_drift(s, args.run),
        "what_if (What-if, 8 GPUs, 1 extra slot each)": lambda s: rebalance.what_if(s, args.run, n_experts + 8, 1, 8),
        "domain_load (By domain, ≤ 8 steps)": lambda s: hot_experts.domain_load(s, args.run),
    }
    rows = []
    for name, fn in calls.items():
        store = Store(db, read_only=True)
        t0 = time.perf_counter()
        fn(store)
        cold = time.perf_counter() - t0
        warm = repeat(lambda: fn(store), args.rounds)
        store.close()
        rows.append(f"| {name} | {cold:.3f} | {warm.best:.3f} |")
    n = Store(db, read_only=True)
    size = n.scalar("SELECT count(*) FROM expert_load WHERE run = ?", [args.run])
    routing = n.scalar("SELECT count(*) FROM routing WHERE run = ?", [args.run])
    n.close()
    body = "\n".join([f"Database: {db.name}, run {args.run}: {size:,} expert_load rows, {routing:,} routing rows.", "",
                      "| call | cold s | warm s (best) |", "|---|---:|---:|", *rows])
    record(RESULTS, body, INTRO, write=not args.no_write)


if __name__ == "__main__":
    main()
