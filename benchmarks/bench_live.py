"""Measure what decides how a live run's writer (the folder watcher) and the app's readers share one DuckDB file.

    python benchmarks/bench_live.py [--tokens 1000000] [--files 2000] [--seconds 6] [--no-write]

On a database of --tokens tokens (built in benchmarks/work/, git-ignored):
  (a) poll cost: analysis.ingest.watch.scan over --files files, against a bare os.listdir of the same folder;
  (b) the CLI watcher holding the database while another process opens it read-only (what an app reading a
      database that `python -m analysis watch` fills would do): how many opens fail;
  (c) both sides short-lived (the watcher opens the database for each file and closes it, the reader opens
      read-only for each query): how many reader opens fail while a step lands every 0.2 s, and what a
      connect + query + close costs against the same query on an open connection;
  (d) the in-app design: the watcher thread loads a step every 0.2 s through the app's one Store while a
      reader thread queries through its own cursor: query latency against the same queries with no loads.
Results are appended to benchmarks/RESULTS-live.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import numpy as np

from harness import ROOT, WORK, best_of_pairs, record, repeat

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.ingest.watch import scan
from analysis.record.logger import DriftLogger
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-live.md"
QUERY = "SELECT run, count(*), max(step), avg(trainer_logprob - sampler_logprob) FROM tokens GROUP BY run"

# A writer in its own process: opens the database for each step's file, loads it, closes it.
SHORT_LIVED_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from analysis.ingest import ingest_paths
from analysis.store import Store
db, files, pause = sys.argv[2], sys.argv[3:-1], float(sys.argv[-1])
for f in files:
    while True:
        try:
            store = Store(db)
            break
        except Exception:
            time.sleep(0.01)  # the reader holds it this instant
    ingest_paths(store, [f])
    store.close()
    time.sleep(pause)
"""
HOLDING_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from analysis.store import Store
store = Store(sys.argv[2])
print("open", flush=True)
time.sleep(float(sys.argv[3]))
"""


def build_db(path: Path, n_tokens: int) -> None:
    store = Store(path)
    with store.transaction() as w:
        w.execute(f"""INSERT INTO {schema.TOKEN_STORE} (run_id, step, sample, pos, sampler_logprob, trainer_logprob,
                                                       file_id)
                     SELECT {w.run_id('base', now=True)}, i // 10000, (i // 100) % 100, i % 100, -1.0 - (i % 7) / 10.0,
                            -1.0 - (i % 5) / 10.0, 0 FROM range(?) t(i)""", [n_tokens])
        w.execute("INSERT INTO runs (run) VALUES ('base')")
    store.close()


def write_steps(folder: Path, n: int) -> list[Path]:
    log = DriftLogger(folder, run="live")
    rng = np.random.default_rng(0)
    out = []
    for step in range(n):
        s = -rng.exponential(1.0, (32, 64))
        out.append(log.log_step(step, s, np.minimum(s + rng.normal(0, 0.01, s.shape), 0), np.ones(s.shape))["tokens"])
    return out


def poll_cost(n_files: int) -> str:
    folder = Path(tempfile.mkdtemp(dir=WORK))
    for i in range(n_files):
        (folder / f"tokens-step{i:06d}.parquet").write_bytes(b"x")
    scans, listings, _ = best_of_pairs(lambda: scan([folder]), lambda: os.listdir(folder), 5)
    t_scan, t_list = scans.best, listings.best
    shutil.rmtree(folder)
    return (f"- (a) poll of {n_files:,} files: scan {t_scan * 1e3:.1f} ms ({t_scan / n_files * 1e6:.1f} µs a file) vs "
            f"bare os.listdir {t_list * 1e3:.1f} ms -> {t_scan / t_list:.0f}x a listing, best of 5, alternating")


def holding_conflict(db: Path, tries: int = 20) -> str:
    proc = subprocess.Popen([sys.executable, "-c", HOLDING_WRITER, str(ROOT), str(db), "30"],
                            stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    failed, message = 0, ""
    for _ in range(tries):
        try:
            duckdb.connect(str(db), read_only=True).close()
        except duckdb.Error as e:
            failed += 1
            message = str(e).split("\n")[0][:120]
    proc.kill()
    proc.wait()
    return f"- (b) CLI watcher holds the file, another process opens it read-only: {failed}/{tries} opens fail ({message})"


def short_lived(db: Path, files: list[Path], seconds: float) -> str:
    con = duckdb.connect(str(db), read_only=True)
    warm = repeat(lambda: con.execute(QUERY).fetchall(), 5).best
    con.close()

    def open_query_close():
        c = duckdb.connect(str(db), read_only=True)
        c.execute(QUERY).fetchall()
        c.close()
    cold = repeat(open_query_close, 5).best
    writer = subprocess.Popen([sys.executable, "-c", SHORT_LIVED_WRITER, str(ROOT), str(db)]
                              + [str(f) for f in files] + ["0.2"])
    ok = failed = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and writer.poll() is None:
        try:
            open_query_close()
            ok += 1
        except duckdb.Error:
            failed += 1
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    return (f"- (c) both short-lived, a step loaded every 0.2 s: {failed}/{ok + failed} reader opens fail; "
            f"connect + query + close {cold * 1e3:.1f} ms vs the query on an open connection {warm * 1e3:.1f} ms "
            f"-> {cold / warm:.1f}x")


def in_app(db: Path, files: list[Path], seconds: float) -> str:
    store = Store(db)

    def latencies(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            store.sql(QUERY)
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)
        return out
    quiet = latencies(40)
    stop = threading.Event()
    loaded = []

    def load():
        for f in files:
            if stop.is_set():
                return
            loaded.extend(o.status for o in ingest_paths(store, [f]))
            time.sleep(0.2)
    t = threading.Thread(target=load)
    t.start()
    busy, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and t.is_alive():
        busy += latencies(1)
    stop.set()
    t.join()
    store.close()
    p50 = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    p95 = lambda xs: sorted(xs)[int(0.95 * (len(xs) - 1))] * 1e3  # noqa: E731
    return (f"- (d) in-app watcher thread on the app's Store, a step loaded every 0.2 s ({loaded.count('loaded')} "
            f"loaded), reader queries on their own cursor: 0 failures; p50 {p50(busy):.1f} ms / p95 {p95(busy):.1f} ms "
            f"vs p50 {p50(quiet):.1f} ms / p95 {p95(quiet):.1f} ms with no loads -> {p50(busy) / p50(quiet):.2f}x "
            f"p50, {p95(busy) / p95(quiet):.2f}x p95")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens in the database the readers query")
    ap.add_argument("--files", type=int, default=2000, help="files in the folder a poll scans")
    ap.add_argument("--seconds", type=float, default=6.0, help="how long each shared-file phase runs")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-live.md")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=WORK) as tmp:
        tmp = Path(tmp)
        steps = write_steps(tmp / "logs", 2 * int(args.seconds / 0.2) + 4)
        lines = [poll_cost(args.files)]
        for name, fn in (("b", holding_conflict), ("c", short_lived), ("d", in_app)):
            db = tmp / f"{name}.duckdb"
            build_db(db, args.tokens)
            half = steps[: len(steps) // 2] if name == "c" else steps[len(steps) // 2:]
            lines.append(fn(db) if name == "b" else fn(db, half, args.seconds))
            print(lines[-1], flush=True)
    intro = ("# Live runs: writer and readers sharing one DuckDB file (benchmarks/bench_live.py)\n\n"
             "Each entry is one run of the command shown; the ratios compare the two sides measured in the same run.")
    record(RESULTS, "\n".join(lines), intro, write=not args.no_write,
           note=f"Data: {args.tokens:,} tokens in the database; steps of 2,048 tokens written with DriftLogger")


if __name__ == "__main__":
    main()
