"""The ingest summaries hook alone (analysis.ingest.summarise: add_tokens and add_routing), CPU seconds, this
checkout against another (`--code`), side by side on the same inputs.

    python benchmarks/bench_summary_hook.py --code OTHER_CHECKOUT [--tokens 4000000] [--steps 40]
                                            [--routing-tokens 400000] [--repeat 3]

Uses bench_scale.py's inputs (benchmarks/inputs/scale_files.py: one tokens and one routing Parquet file, built with
DuckDB under benchmarks/work/scale/ and kept). Each checkout, in its own child process: `ingest` both files into a fresh
database (its own code), then per repeat delete every summary row and run that checkout's hook again inside a
transaction, timing the process CPU (user + system, every DuckDB thread) and wall time of the token part and the
routing part. Reports the best repeat of each side and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import harness
from harness import ROOT, timed
from inputs import scale_files

CHILD = r"""
import json, resource, sys, time
code, db, repeat, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
sys.path.insert(0, code)
from analysis.ingest import ingest_paths
from analysis.store import Store
from analysis.ingest import summarise as compute
from analysis.summaries import schema as S

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

store = Store(db)
assert all(o.status == "loaded" for o in ingest_paths(store, files))
fids = {t: store.scalar(f"SELECT min(file_id) FROM {t}") for t in ("tokens", "routing")}
out = []
for _ in range(repeat):
    with store.transaction() as w:
        for table in S.TABLES:
            if table != "summary_skip":
                w.execute(f"DELETE FROM {table}")
    row = {}
    # the hook's two parts, public since the load-path refactor (underscored in a checkout older than it)
    hooks = [getattr(compute, n, None) or getattr(compute, "_" + n) for n in ("add_tokens", "add_routing")]
    for part, fn in zip(("tokens", "routing"), hooks):
        if fids[part] is None:
            continue
        c0, t0 = cpu(), time.perf_counter()
        with store.transaction() as w:
            fn(w, fids[part])
        row[part] = (cpu() - c0, time.perf_counter() - t0)
    out.append(row)
store.close()
print(json.dumps(out))
"""


def side(code: Path, files: list[Path], repeat: int, name: str) -> list[dict]:
    db = harness.fresh_db(scale_files.WORK / f"hook-{name}.duckdb")
    res = timed([sys.executable, "-c", CHILD, str(code), str(db), str(repeat), *map(str, files)], cwd=code)
    db.unlink(missing_ok=True)
    return json.loads(res["stdout"].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--code", type=Path, required=True, help="the other checkout (e.g. a `git archive main` copy)")
    ap.add_argument("--tokens", type=int, default=4_000_000)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--routing-tokens", type=int, default=400_000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side's hook; the best counts")
    a = ap.parse_args()
    files = scale_files.make(a.tokens, a.steps, a.routing_tokens, a.layers)
    print(f"{a.tokens:,} tokens / {a.steps} steps + {a.routing_tokens * a.layers:,} routing rows; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    best = {}
    for name, code in (("this", ROOT), ("other", a.code.resolve())):
        rows = side(code, files, a.repeat, name)
        for part in ("tokens", "routing"):
            vals = [r[part] for r in rows if part in r]
            if vals:
                best[(name, part)] = min(vals)
                print(f"{name:>5} ({code}) {part:>7}: cpu {', '.join(f'{c:.2f}' for c, _ in vals)} s; "
                      f"wall {', '.join(f'{w:.2f}' for _, w in vals)} s", flush=True)
    for part in ("tokens", "routing"):
        if ("this", part) in best and ("other", part) in best:
            (c1, w1), (c0, w0) = best[("this", part)], best[("other", part)]
            print(f"best {part}: this {c1:.2f} s cpu ({w1:.2f} s wall) vs other {c0:.2f} s cpu ({w0:.2f} s wall): "
                  f"{c1 / c0:.2f}x cpu")
    print(f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
