"""Ingest at run scale: `python -m analysis ingest` as a whole process vs DuckDB's own CTAS of the same files.

    python benchmarks/bench_scale.py [--tokens 40000000] [--steps 400] [--routing-tokens 500000] [--layers 32]
                                     [--repeat 1] [--keep]
    python benchmarks/bench_scale.py --tokens 100000000 --routing-tokens 0
    python benchmarks/bench_scale.py --keep --repeat 2 --per-file --code OTHER_CHECKOUT   # also each file alone
    python benchmarks/bench_scale.py --only checkouts --repeat 8 --code OTHER_CHECKOUT     # the two ingests alone

Builds one tokens Parquet file (`--tokens` tokens over `--steps` steps, sequences of 500) and, unless
`--routing-tokens 0`, one routing Parquet file (the first tokens of every step, `--layers` layers, top-8 of 64
experts on both sides, ~3 % flips), both with DuckDB under benchmarks/work/scale/ (git-ignored). Then, per
repeat, in alternating order so background load hits both alike:

- **ctas**: a Python process that runs `CREATE TABLE tokens AS SELECT * FROM read_parquet(...)` (and the same for
  routing) into a fresh database: DuckDB alone, no checks, no derived columns.
- **ingest**: `python -m analysis ingest FILES --db fresh.duckdb`, the command a user runs.

`--floor` times, per file and each in a process of its own, what an ingest cannot do without: **insert**, the
file's batches read by pyarrow and streamed into a table of the stored layout (run codes, file_id; for routing
the two expert lists as they are) with no check; **stages**, the Python work of a load done serially in one
thread with no database (read, normalise and checks, keys, the token summaries or the expert-load counts), each
stage's CPU seconds, and the import and first-call (numba) cost; **hash**, the file's sha256. On two cores an
ingest's wall time cannot fall below about (insert CPU + the stages' CPU beyond reading + hash) / 2. With
`--code`, the stages also run three times each with this checkout and with the other one, alternating (medians).

Each side is one child process; wall time, CPU (user + system) and peak RSS come from `os.wait4` for that
child. The database size per routing row is the growth of the ingest database when the routing file is
loaded after the tokens (`--routing-bytes`, a separate pass).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import harness
from harness import ROOT, timed
from inputs.scale_files import WORK
from inputs.scale_files import make as make_inputs


CTAS = """
import sys, duckdb
con = duckdb.connect(sys.argv[1])
for f in sys.argv[2:]:
    table = 'routing' if f.endswith('routing.parquet') else 'tokens'
    con.execute(f"CREATE TABLE {table} AS SELECT * FROM read_parquet(?)", [f])
con.close()
"""


INSERT = """
import sys, duckdb, pyarrow as pa, pyarrow.parquet as pq
f, db = sys.argv[1], sys.argv[2]
con = duckdb.connect(db)
con.execute("SET memory_limit = '512MB'")  # as python -m analysis ingest
pf = pq.ParquetFile(f, pre_buffer=False, read_dictionary=["run"])
cols = [c for c in pf.schema_arrow.names if c != "run"]
types = {"step": "BIGINT", "sample": "BIGINT", "pos": "INTEGER", "layer": "INTEGER", "token_id": "INTEGER",
         "sampler_experts": "INTEGER[]", "trainer_experts": "INTEGER[]"}
defs = ", ".join(c + " " + types.get(c, "DOUBLE") for c in cols)
con.execute("CREATE TABLE t (run_id INTEGER, " + defs + ", file_id INTEGER)")
schema = pa.schema([pf.schema_arrow.field(c) for c in cols])
reader = pa.RecordBatchReader.from_batches(schema, pf.iter_batches(batch_size=491520, columns=cols))
con.register("s", reader)
con.execute("BEGIN")
con.execute(f"INSERT INTO t SELECT 1, {', '.join(cols)}, 1 FROM s")
con.execute("COMMIT")
con.close()
"""

STAGES = """
import json, sys, time
t_start = time.process_time()
sys.path.insert(0, sys.argv[2])
from analysis.ingest import long
from analysis.ingest.keys import TableKeys, expert_load, routing_tokens
from analysis.ingest.limits import Limits
from analysis.ingest.hashing import content_hash
from analysis.ingest.validate import normalise
from analysis.ingest import summary_stream as stream
from pathlib import Path
cpu = {"imports": time.process_time() - t_start}
def timed(name, fn, *args):
    t0 = time.process_time()
    out = fn(*args)
    cpu[name] = cpu.get(name, 0.0) + time.process_time() - t0
    return out
f = sys.argv[1]
summaries, keys = stream.StepSummaries(), None
with open(f, "rb") as fp:
    batches = long.read_parquet(fp, f, Limits.from_env())
    first = True
    while (batch := timed("read", next, batches, None)) is not None:
        data, experts, runs = timed("normalise" + (" (first)" if first else ""), normalise, f, batch, None, 1)
        keys = keys or TableKeys(batch.table)
        timed("keys", keys.add, data, runs)
        if batch.table == "tokens":
            timed("summaries" + (" (first)" if first else ""), summaries.feed, data, runs)
        else:
            timed("expert load" + (" (first)" if first else ""), expert_load, data, experts.S, experts.T,
                  experts.t_rows, runs)
            timed("routing tokens", routing_tokens, data)
        first = False
timed("summaries", summaries.finish)
timed("hash", content_hash, [Path(f)])
print(json.dumps(cpu))
"""


def stage_cpu(f: Path, code: Path) -> dict[str, float]:
    """CPU seconds of each Python stage of loading `f` with the checkout `code`, serially in a child (STAGES)."""
    out = timed([sys.executable, "-c", STAGES, str(f), str(code)])
    return json.loads(out["stdout"].strip().splitlines()[-1])


def floor(files: list[Path], code: Path | None = None, pairs: int = 3) -> None:
    """--floor: per file, CTAS, the plain streamed insert and the serial Python stages (see the docstring);
    with --code, also `pairs` alternating runs of the stages with this checkout and with the other one."""
    for f in files:
        if code:
            runs = {"this": [], "other": []}
            for _ in range(pairs):
                for side, root in (("this", ROOT), ("other", code)):
                    runs[side].append(stage_cpu(f, root))
            for side in runs:
                keys = list(runs[side][0])
                print(f"{f.name} stages, {side} ({ROOT if side == 'this' else code}), median of {pairs}: "
                      + ", ".join(f"{k} {statistics.median(r[k] for r in runs[side]):.2f}" for k in keys)
                      + " s cpu", flush=True)
        db = fresh_db("floor")
        ctas = timed([sys.executable, "-c", CTAS, str(db), str(f)])
        db = fresh_db("floor")
        ins = timed([sys.executable, "-c", INSERT, str(f), str(db)])
        fresh_db("floor")
        cpu = stage_cpu(f, ROOT)
        extra = sum(v for k, v in cpu.items() if k != "read")
        print(f"{f.name}: ctas {ctas['seconds']:.2f} s wall, {ctas['cpu_seconds']:.2f} s cpu | plain insert "
              f"{ins['seconds']:.2f} s wall, {ins['cpu_seconds']:.2f} s cpu | stages (one thread, no database) "
              + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()) + f" s cpu | floor on 2 cores "
              f"({ins['cpu_seconds']:.2f} + {extra:.2f}) / 2 = {(ins['cpu_seconds'] + extra) / 2:.2f} s = "
              f"{(ins['cpu_seconds'] + extra) / 2 / ctas['seconds']:.2f}x ctas wall", flush=True)


def fresh_db(name: str) -> Path:
    return harness.fresh_db(WORK / f"{name}.duckdb")


def run_side(which: str, files: list[Path], code: Path | None = None) -> dict:
    """ctas, ingest (this checkout) or other (the ingest of the checkout `code`)."""
    db = fresh_db(which)
    if which == "ctas":
        cmd = [sys.executable, "-c", CTAS, str(db), *map(str, files)]
    else:
        cmd = [sys.executable, "-m", "analysis", "ingest", *map(str, files), "--db", str(db)]
    res = timed(cmd, code if which == "other" else None)
    res["db_mb"] = db.stat().st_size / 2**20
    db.unlink(missing_ok=True)
    return res


def run_per_file(which: str, files: list[Path], code: Path | None = None) -> list[dict]:
    """Each file timed alone, in order, into one fresh database (routing after its tokens): ctas, ingest or
    other, as run_side."""
    db = fresh_db(f"{which}-per-file")
    out = []
    for f in files:
        if which == "ctas":
            cmd = [sys.executable, "-c", CTAS, str(db), str(f)]
        else:
            cmd = [sys.executable, "-m", "analysis", "ingest", str(f), "--db", str(db)]
        out.append(timed(cmd, code if which == "other" else None))
    db.unlink(missing_ok=True)
    return out


def routing_bytes(files: list[Path], code: Path | None) -> None:
    """Database growth per routing row: ingest the tokens (closing the database checkpoints it), then the
    routing file; `code`: another checkout of the project to run the ingest from (a before/after comparison)."""
    db = fresh_db("routing-bytes")
    ingest = [sys.executable, "-m", "analysis", "ingest"]
    timed(ingest + [str(files[0]), "--db", str(db)], code)
    before = db.stat().st_size
    timed(ingest + [str(files[1]), "--db", str(db)], code)
    after = db.stat().st_size
    import duckdb
    con = duckdb.connect(str(db), read_only=True)
    n = con.execute("SELECT count(*) FROM routing").fetchall()[0][0]
    con.close()
    db.unlink(missing_ok=True)
    print(f"routing ({code or 'this checkout'}): {n:,} rows, database +{(after - before) / 2**20:.0f} MiB = "
          f"{(after - before) / n:.2f} bytes per (token, layer) row")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40_000_000)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--routing-tokens", type=int, default=500_000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--routing-bytes", action="store_true", help="also measure database bytes per routing row")
    ap.add_argument("--code", type=Path, help="another checkout of the project: its ingest is timed too ('other') "
                                              "and, with --routing-bytes, its bytes per routing row")
    ap.add_argument("--only", choices=("ctas", "ingest", "checkouts", "none"),
                    help="time one side only, this checkout and --code's (no ctas), or none")
    ap.add_argument("--per-file", action="store_true", help="also time each file alone (tokens, then routing into "
                                                                "the same database), per side")
    ap.add_argument("--floor", action="store_true", help="also time, per file, a plain insert and the load's Python "
                                                              "stages alone (what ingest cannot do without)")
    ap.add_argument("--keep", action="store_true", help="keep the input files (default: delete them at the end)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    # built in a child process: Linux hands a parent's peak RSS down to the children it forks, so building the
    # inputs with DuckDB in this process would inflate every side's peak RSS measured below
    shape = [a.tokens, a.steps, a.routing_tokens, a.layers]
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                    f"from inputs import scale_files; scale_files.make(*{shape!r})"], check=True)
    files = make_inputs(*shape)  # already built: only the paths
    print(f"inputs: {', '.join(f'{f.name} {f.stat().st_size / 2**20:.0f} MiB' for f in files)} "
          f"({time.perf_counter() - t0:.1f} s to prepare)")
    print(f"{a.tokens:,} tokens over {a.steps} steps + {a.routing_tokens * a.layers:,} routing rows "
          f"({a.layers} layers, top-8 of 64); python {platform.python_version()}, {os.cpu_count()} cpus, "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    best: dict[str, dict[str, list[float]]] = {}
    sides = () if a.only == "none" else ("ingest", "other") if a.only == "checkouts" else (a.only,) if a.only \
        else ("ctas", "ingest") + (("other",) if a.code else ())
    code = a.code.resolve() if a.code else None
    for r in range(a.repeat):
        for which in sides if r % 2 == 0 else sides[::-1]:
            res = run_side(which, files, code)
            for key in ("seconds", "cpu_seconds", "peak_rss_mb"):
                best.setdefault(which, {}).setdefault(key, []).append(res[key])
            print(f"repeat {r + 1} {which:>6}: {res['seconds']:6.2f} s wall, {res['cpu_seconds']:6.2f} s cpu, "
                  f"{res['peak_rss_mb']:5.0f} MB peak RSS, db {res['db_mb']:.0f} MiB", flush=True)
            if a.per_file:
                for f, res in zip(files, run_per_file(which, files, code)):
                    for key in ("seconds", "cpu_seconds"):
                        best.setdefault(f"{which} {f.stem}", {}).setdefault(key, []).append(res[key])
                    print(f"repeat {r + 1} {which:>6} {f.name} alone: {res['seconds']:6.2f} s wall, "
                          f"{res['cpu_seconds']:6.2f} s cpu, {res['peak_rss_mb']:5.0f} MB peak RSS", flush=True)
    if "other" in best and "ctas" in best:
        b, o = best["ctas"], best["other"]
        print(f"best of {a.repeat}: other ({code}) {min(o['seconds']):.2f} s = {min(o['seconds']) / min(b['seconds']):.2f}x "
              f"ctas wall, {min(o['cpu_seconds']) / min(b['cpu_seconds']):.2f}x cpu, peak RSS {max(o['peak_rss_mb']):.0f} MB")
    if "ctas" in best and "ingest" in best:
        b, o = best["ctas"], best["ingest"]
        print(f"best of {a.repeat}: ctas {min(b['seconds']):.2f} s | ingest {min(o['seconds']):.2f} s | "
              f"wall ratio {min(o['seconds']) / min(b['seconds']):.2f}x | cpu ratio "
              f"{min(o['cpu_seconds']) / min(b['cpu_seconds']):.2f}x | ingest peak RSS {max(o['peak_rss_mb']):.0f} MB "
              f"(ctas {max(b['peak_rss_mb']):.0f} MB) | load {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if "ingest" in best and "other" in best:  # side by side: the medians of the CPU of each repeat
        cpu = {s: best[s]["cpu_seconds"] for s in ("ingest", "other")}
        mine, other = statistics.median(cpu["ingest"]), statistics.median(cpu["other"])
        lower = sum(x < y for x, y in zip(cpu["ingest"], cpu["other"]))
        print(f"median cpu of {a.repeat}: ingest {mine:.2f} s | other {other:.2f} s | {mine / other - 1:+.1%}; "
              f"ingest lower in {lower} of {a.repeat} repeats")
    for key in sorted(k for k in best if " " in k):
        print(f"best of {a.repeat}: {key} alone {min(best[key]['seconds']):.2f} s wall, "
              f"{min(best[key]['cpu_seconds']):.2f} s cpu")
    if a.floor:
        floor(files, code)
    if a.routing_bytes and a.routing_tokens:
        for c in ([code] if code else []) + [None]:
            routing_bytes(files, c)
    if not a.keep:
        for f in files:
            f.unlink(missing_ok=True)
        (files[0].parent / "DONE").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
