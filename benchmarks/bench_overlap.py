"""Two overlaps of `python -m analysis ingest`, each timed with and without, alternating, in child processes:

    python benchmarks/bench_overlap.py [--pairs 4] [--tokens FILE]

- **commit**: the streamed INSERT of a tokens Parquet file into a fresh database (bench_scale's plain insert),
  then COMMIT, with and without `Writeback` syncing the database file every 0.5 s meanwhile. Reported: the
  COMMIT's seconds, and the insert's + COMMIT's wall and CPU seconds.
- **start**: a process's start of an ingest (the imports of the CLI's load path and the first call of the token
  kernel) with the file's sha256 started ahead by `hash_ahead`, as the CLI does, and without; then the time
  at which that hash is done. Without it the hash (`hash alone`) runs later, beside the insert.

The default file is bench_scale's 40M-token tokens.parquet (run bench_scale.py --keep first).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / "work" / "scale"
DEFAULT = WORK / "t40000000_s400_r500000_l32" / "tokens.parquet"

COMMIT = """
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[3])
import duckdb, pyarrow as pa, pyarrow.parquet as pq
from analysis.ingest.writeback import Writeback
f, db, on = sys.argv[1], sys.argv[2], sys.argv[4] == "1"
con = duckdb.connect(db)
con.execute("SET memory_limit = '512MB'")
pf = pq.ParquetFile(f, pre_buffer=False, read_dictionary=["run"])
cols = [c for c in pf.schema_arrow.names if c != "run"]
types = {"step": "BIGINT", "sample": "BIGINT", "pos": "INTEGER", "token_id": "INTEGER"}
con.execute("CREATE TABLE t (run_id INTEGER, " + ", ".join(c + " " + types.get(c, "DOUBLE") for c in cols)
            + ", file_id INTEGER)")
reader = pa.RecordBatchReader.from_batches(pa.schema([pf.schema_arrow.field(c) for c in cols]),
                                           pf.iter_batches(batch_size=491520, columns=cols))
con.register("s", reader)
r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
con.execute("BEGIN")
wb = Writeback(db) if on else None
if wb:
    wb.__enter__()
con.execute(f"INSERT INTO t SELECT 1, {', '.join(cols)}, 1 FROM s")
if wb:
    wb.__exit__(None, None, None)
t1 = time.perf_counter()
con.execute("COMMIT")
t2, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"commit": t2 - t1, "wall": t2 - t0, "syncs": wb.syncs if wb else 0,
                  "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime}))
"""

START = """
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[2])
f, on = sys.argv[1], sys.argv[3] == "1"
import analysis.ingest.hashing as hashing
if on:
    hashing.hash_ahead([f])
import numpy as np
import analysis.ingest.load
from analysis.summaries import kernel
kernel.Accumulators.zeros(4).add(np.full(8, -1.0), np.full(8, -1.0), pos=np.arange(8), seq=np.zeros(8, np.int64))
t1 = time.perf_counter()
if on:
    hashing.take_ahead([__import__("pathlib").Path(f)]).result()
else:
    hashing.content_hash([f])
t2 = time.perf_counter()
print(json.dumps({"imports": t1 - t0, "hash_done": t2 - t0}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--tokens", type=Path, default=DEFAULT)
    a = ap.parse_args()
    if not a.tokens.exists():
        raise SystemExit(f"{a.tokens} missing: run `python benchmarks/bench_scale.py --keep` first")
    print(f"{a.tokens} ({a.tokens.stat().st_size / 2**20:.0f} MiB), {a.pairs} pairs, load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    db = WORK / "overlap.duckdb"
    runs: dict[str, list[dict]] = {"commit off": [], "commit on": [], "start off": [], "start on": []}
    for i in range(a.pairs):
        for on in ("0", "1") if i % 2 == 0 else ("1", "0"):
            for p in (db, Path(f"{db}.wal")):
                p.unlink(missing_ok=True)
            runs[f"commit {'on' if on == '1' else 'off'}"].append(child(COMMIT, str(a.tokens), str(db), str(ROOT), on))
            runs[f"start {'on' if on == '1' else 'off'}"].append(child(START, str(a.tokens), str(ROOT), on))
    db.unlink(missing_ok=True)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])
    for side in ("off", "on"):
        name = f"commit {side}"
        each = ", ".join(f"{r['commit']:.3f}" for r in runs[name])
        print(f"insert + COMMIT, writeback {side:>3}: COMMIT {med(name, 'commit'):.3f} s (runs: "
              f"{each}), insert + COMMIT {med(name, 'wall'):.2f} s "
              f"wall, {med(name, 'cpu'):.2f} s cpu, {med(name, 'syncs'):.0f} syncs (medians)")
    print(f"COMMIT on / off: {med('commit on', 'commit') / med('commit off', 'commit'):.2f}x; insert + COMMIT "
          f"wall {med('commit on', 'wall') / med('commit off', 'wall'):.2f}x, cpu "
          f"{med('commit on', 'cpu') / med('commit off', 'cpu'):.2f}x")
    for side in ("off", "on"):
        name = f"start {side}"
        print(f"start, hash ahead {side:>3}: imports + first kernel call {med(name, 'imports'):.2f} s, hash done at "
              f"{med(name, 'hash_done'):.2f} s after the process started (medians)")


if __name__ == "__main__":
    main()
