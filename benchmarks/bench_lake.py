"""Benchmark `summarize` of a Parquet lake: in-process DuckDB vs local Ray (2 CPUs) vs `ingest` of the same files.

    python benchmarks/bench_lake.py [--tokens 40000000] [--partitions 50 400] [--rebuild] [--no-write]

Builds (once per partition count, cached in benchmarks/work/, git-ignored) a lake of `--tokens` tokens over P
steps (one partition per step, each written as 2 rank files), routing of both sides for 500,000 of the tokens
(32 layers, top-8 of 64: 16M routing rows), with numpy. Then times, as whole processes, side by side:
  (a) python -m analysis summarize LAKE --out OUT --engine duckdb
  (b) python -m analysis summarize LAKE --out OUT --engine ray        (a local Ray, num_cpus=2, started inside)
  (c) python -m analysis ingest LAKE --db DB                          (every token into a database: the baseline)
and the per-partition overhead: (d) summarize of lakes of tiny partitions (10 tokens each) at both partition
counts, on both engines (slope: cost per partition; intercept: fixed cost), (e) a Ray no-op task round trip. Results are appended to benchmarks/RESULTS-lake.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import harness
from harness import ROOT, append_result, fresh_db, header

from analysis.lake.layout import write_file

WORK = harness.WORK / "lake"
RESULTS = ROOT / "benchmarks" / "RESULTS-lake.md"
RUN, LEN, RANKS = "bench", 500, 2
ROUTED_TOKENS, LAYERS, K, EXPERTS = 500_000, 32, 8, 64
BUILD_VERSION = "1"


def _list_column(ids: np.ndarray) -> pa.ListArray:
    n, k = ids.shape
    return pa.ListArray.from_arrays(pa.array(np.arange(0, (n + 1) * k, k, dtype=np.int32)),
                                    pa.array(ids.reshape(-1).astype(np.int32)))


def build(lake: Path, tokens: int, partitions: int, routed: int = ROUTED_TOKENS) -> None:
    """`partitions` steps of tokens // partitions tokens (sequences of LEN), each step split over RANKS files."""
    if lake.exists():
        shutil.rmtree(lake)
    per_step = tokens // partitions
    routed_per_step = routed // partitions
    rng = np.random.default_rng(42)
    for step in range(partitions):
        i = np.arange(per_step)
        sample, pos = i // LEN, (i % LEN).astype(np.int32)
        s = -rng.exponential(1.5, per_step)
        d = rng.normal(0.0, 0.05, per_step) * np.where(rng.random(per_step) < 0.005, 20.0, 1.0)
        t = np.minimum(s + d, 0.0)
        rank_of = sample % RANKS
        for rank in range(RANKS):
            m = rank_of == rank
            n = int(m.sum())
            write_file(str(lake), RUN, step, "tokens", rank, pa.table({
                "run": pa.repeat(pa.scalar(RUN), n), "step": pa.array(np.full(n, step, np.int64)),
                "sample": pa.array(sample[m]), "pos": pa.array(pos[m]),
                "token_id": pa.array(rng.integers(0, 50_000, n).astype(np.int32)),
                "sampler_logprob": pa.array(s[m]), "trainer_logprob": pa.array(t[m]),
                "sampler_version": pa.array(np.full(n, step - 1, np.int64)),
                "trainer_version": pa.array(np.full(n, step, np.int64))}))
            # routing for the first routed_per_step tokens of the step, every layer; 3% of rows flip one expert
            r = np.flatnonzero(m[:routed_per_step])
            if not len(r):
                continue
            rows = len(r) * LAYERS
            base = rng.integers(0, EXPERTS, rows)[:, None]
            mult = (2 * rng.integers(0, EXPERTS // 2, rows) + 1)[:, None]
            se = (base + np.arange(K)[None, :] * mult) % EXPERTS
            te = se.copy()
            swap = rng.random(rows) < 0.03
            te[swap, 0] = ((base + K * mult) % EXPERTS)[swap, 0]
            write_file(str(lake), RUN, step, "routing", rank, pa.table({
                "run": pa.repeat(pa.scalar(RUN), rows), "step": pa.array(np.full(rows, step, np.int64)),
                "sample": pa.array(np.repeat(sample[r], LAYERS)), "pos": pa.array(np.repeat(pos[r], LAYERS)),
                "layer": pa.array(np.tile(np.arange(LAYERS, dtype=np.int32), len(r))),
                "sampler_experts": _list_column(se), "trainer_experts": _list_column(te)}))
    (lake / f".built-{BUILD_VERSION}").write_text(f"{tokens} {partitions} {routed}\n")


def lake_for(tokens: int, partitions: int, routed: int, rebuild: bool) -> Path:
    lake = WORK / f"lake-{tokens}-{partitions}-{routed}"
    if rebuild or not (lake / f".built-{BUILD_VERSION}").exists():
        t0 = time.perf_counter()
        build(lake, tokens, partitions, routed)
        print(f"built {lake} in {time.perf_counter() - t0:.1f}s", flush=True)
    return lake


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of a whole process (imports, Ray start-up and shutdown included); it must succeed.
    CPU is user + system time of the process and the descendants it waited for (not Ray's workers), which other
    processes on shared cores inflate far less than wall time."""
    r = harness.timed(cmd)
    return r["seconds"], r["cpu_seconds"]


def run_three(lake: Path) -> dict[str, tuple[float, float]]:
    out = WORK / f"out-{os.getpid()}"
    walls = {}
    for engine in ("duckdb", "ray"):
        shutil.rmtree(out, ignore_errors=True)
        walls[engine] = timed([sys.executable, "-m", "analysis", "summarize", str(lake), "--out", str(out),
                               "--engine", engine])
    db = fresh_db(WORK / f"ingest-{os.getpid()}.duckdb")
    walls["ingest"] = timed([sys.executable, "-m", "analysis", "ingest", str(lake), "--db", str(db)])
    db.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    return walls


def ray_noop_overhead(n: int = 400) -> tuple[float, float]:
    """(ray.init seconds, seconds per no-op task) on a local Ray with 2 CPUs."""
    import ray
    t0 = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    init = time.perf_counter() - t0

    @ray.remote(num_cpus=1)
    def noop(i):
        return i

    ray.get([noop.remote(i) for i in range(8)])  # warm the workers
    t0 = time.perf_counter()
    ray.get([noop.remote(i) for i in range(n)])
    per = (time.perf_counter() - t0) / n
    ray.shutdown()
    return init, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40_000_000)
    ap.add_argument("--partitions", type=int, nargs="*", default=[50, 400],
                    help="partition counts of the --tokens lake (none: only the overhead runs)")
    ap.add_argument("--overhead", type=int, nargs=2, default=[50, 400], metavar=("LO", "HI"),
                    help="partition counts of the tiny lakes that measure the per-partition overhead")
    ap.add_argument("--routed", type=int, default=ROUTED_TOKENS, help="tokens that also get routing rows")
    ap.add_argument("--rebuild", action="store_true", help="build the lakes again even if they exist")
    ap.add_argument("--no-write", action="store_true", help="print, do not append to RESULTS-lake.md")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    lines = []
    for p in args.partitions:
        lake = lake_for(args.tokens, p, args.routed, args.rebuild)
        w = run_three(lake)
        wall = {k: v[0] for k, v in w.items()}
        cpu = {k: v[1] for k, v in w.items()}
        line = (f"- {p} partitions ({args.tokens // p:,} tokens each, {RANKS} files each): wall (CPU) seconds: "
                f"summarize duckdb {wall['duckdb']:.1f} ({cpu['duckdb']:.1f}), summarize ray {wall['ray']:.1f} "
                f"({cpu['ray']:.1f}), ingest {wall['ingest']:.1f} ({cpu['ingest']:.1f}) -> against ingest: "
                f"duckdb {wall['duckdb'] / wall['ingest']:.2f}x ({cpu['duckdb'] / cpu['ingest']:.2f}x CPU), "
                f"ray {wall['ray'] / wall['ingest']:.2f}x ({cpu['ray'] / cpu['ingest']:.2f}x CPU)")
        print(line, flush=True)
        lines.append(line)
        record(args, lines[-1:])
    # per-partition overhead: the same job on lakes of tiny partitions (10 tokens each); the slope between the two
    # partition counts is the cost of one more partition, the intercept the fixed cost (process, Ray start-up)
    lo, hi = sorted(args.overhead)
    out = WORK / f"out-{os.getpid()}"
    for engine in ("duckdb", "ray"):
        walls, cpus = {}, {}
        for n in (lo, hi):
            shutil.rmtree(out, ignore_errors=True)
            walls[n], cpus[n] = timed([sys.executable, "-m", "analysis", "summarize",
                                       str(lake_for(10 * n, n, 0, args.rebuild)), "--out", str(out), "--engine", engine])
        slope = (walls[hi] - walls[lo]) / (hi - lo)
        cpu_slope = (cpus[hi] - cpus[lo]) / (hi - lo)
        line = (f"- overhead, {engine}: {lo} vs {hi} partitions of 10 tokens: {walls[lo]:.1f}s vs {walls[hi]:.1f}s "
                f"wall -> {1000 * slope:.0f} ms per partition ({1000 * cpu_slope:.0f} ms CPU), fixed "
                f"{walls[lo] - slope * lo:.1f}s ({cpus[lo] - cpu_slope * lo:.1f}s CPU)")
        print(line, flush=True)
        lines.append(line)
        record(args, lines[-1:])
    init, per = ray_noop_overhead()
    line = f"- Ray itself: ray.init(num_cpus=2) {init:.1f}s, a no-op Ray task {1000 * per:.1f} ms (400 in a batch)"
    print(line, flush=True)
    record(args, [line], last=True)


_started: set[int] = set()
INTRO = "# Lake summarize benchmarks (benchmarks/bench_lake.py)\n"


def record(args, lines: list[str], last: bool = False) -> None:
    """Append result lines to RESULTS-lake.md as they come (a long run on shared cores may be cut short): the
    entry's header first, then the lines, and the load average when the run ends."""
    if args.no_write:
        return
    import ray
    out, first = [], not _started
    if first:
        _started.add(1)
        out.append(header({"ray": ray.__version__}, note=(
            f"Data: {args.tokens:,} tokens (sequences of {LEN}), routing for {args.routed:,} of them "
            f"({args.routed * LAYERS:,} rows: {LAYERS} layers, top-{K} of {EXPERTS}, 3% flips), each step one "
            "partition of 2 rank files; wall and CPU seconds of whole processes, one run each")))
    out += lines
    if last:
        out += ["", f"Load average at the end: {os.getloadavg()[0]:.1f}"]
    append_result(RESULTS, "\n".join(out), INTRO, new_entry=first)


if __name__ == "__main__":
    main()
