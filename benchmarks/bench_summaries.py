"""Benchmark the summaries: `python -m analysis metrics --by step|run` as whole processes on a database with
40M summarised tokens (400 steps) and 16M routing rows (32 layers, top-8 of 64), against the token-level SQL.

    python benchmarks/bench_summaries.py [--repeat 5] [--rebuild] [--no-write]

Builds (once, cached in benchmarks/work/, git-ignored) a database straight from DuckDB SQL: 40M token rows
and, for the routed tokens, routing rows with their derived columns and expert_load (as bench_metrics does);
then summarises the first 40 steps with the ingest hook (summaries.compute.add_file, one "file" per 10 steps,
timed) and repeats those summary rows over the other 360 steps (the query times depend on the row counts only).
Times, best of N, in the same run: the CLI as a whole process (`metrics --by step`, `--by run`,
`corrections --method icepop --by run`), the same tables in process from summaries (report.metrics_table) and
from token rows (metrics.token_metrics, the pre-summaries path), the correction simulator's default query
(corrections.compare_methods of icepop, geo_rs and seq_rs) from the per-sequence summaries and from every token
row, plus the process start-up alone (`python -c "import analysis.metrics.report"`).
Results are appended to benchmarks/RESULTS-summaries.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analysis import schema  # noqa: E402
from analysis.ingest import summarise as compute  # noqa: E402
from analysis.metrics import corrections, report
from analysis.metrics import token as metrics
from analysis.store import Store  # noqa: E402

WORK = ROOT / "benchmarks" / "work"
DB = WORK / "bench_summaries.duckdb"
RESULTS = ROOT / "benchmarks" / "RESULTS-summaries.md"
RUN = "bench"
STEPS, SEQS, LEN = 400, 200, 500              # 400 × 200 × 500 = 40,000,000 tokens
ROUTED_LEN, LAYERS, K, EXPERTS = 1250, 32, 8, 64  # per step 1,250 tokens × 32 layers: 400 × 40,000 = 16M rows
FILE_STEPS = 10                               # steps per summarised "file"
COMPUTED_FILES = 4  # files summarised by the ingest hook (timed); their summary rows are then repeated with
# shifted steps to cover all STEPS (a 2-core shared machine summarises ~0.2M tokens/s: 40M would take minutes)
SUMMARY_TABLES = ("summary_step", "summary_seq", "summary_seq_band", "summary_hist", "summary_bucket",
                  "summary_bucket_band", "summary_layer")
BUILD_VERSION = "6"  # 2: routing into routing_rows; 3: summary layout 2 (band tables); 4: run codes;
# 5: the sampler's list packed (schema.ROUTING_PACKED); 6: into routing_rows_packed, as ingest stores such rows
ID_BITS = (EXPERTS - 1).bit_length()  # as ingest packs these ids (K · ID_BITS <= 64)


def build(path: Path) -> dict:
    if path.exists():
        path.unlink()
    WORK.mkdir(parents=True, exist_ok=True)
    store = Store(path)
    con = store.cursor()
    con.execute("SELECT setseed(0.42)")
    t0 = time.perf_counter()
    n_files = STEPS // FILE_STEPS
    # s ~ −Exp(1.5); Δ ~ N(0, 0.05), 0.5% ×20; staleness 0–1; entropy ~ Exp(1); file_id = 1 + step // FILE_STEPS
    con.execute(f"""
        INSERT INTO {schema.TOKEN_STORE_FULL} (run_id, step, sample, pos, token_id, sampler_logprob, trainer_logprob,
                                               sampler_version, trainer_version, sampler_entropy, file_id)
        SELECT {store.run_id(RUN)}, st, (i // {LEN}) % {SEQS}, (i % {LEN})::INTEGER, (hash(i) % 50000)::INTEGER, s,
               least(s + d, 0.0), st - (hash(i // {LEN}) % 2)::BIGINT, st, -ln(1.0 - random()),
               (1 + st // {FILE_STEPS})::INTEGER
        FROM (SELECT i, i // {SEQS * LEN} AS st, 1.5 * ln(1.0 - random()) AS s,
                     0.05 * sqrt(-2.0 * ln(1.0 - random())) * cos(2.0 * pi() * random())
                     * CASE WHEN random() < 0.005 THEN 20.0 ELSE 1.0 END AS d
              FROM range({STEPS * SEQS * LEN}) r(i))""")
    t1 = time.perf_counter()
    # routing of the first ROUTED_LEN tokens of each step (samples 0..2, positions in order), file_id 1000 + ...;
    # stored compact as ingest stores it (the trainer's list only where it differs, the sampler's packed in one
    # integer; the `routing` view gives both lists back)
    con.execute(f"""
        INSERT INTO {schema.ROUTING_PACKED_STORE} (run_id, step, sample, pos, layer, sampler_packed, id_bits, trainer_experts,
                                            k, flip, top1_flip, n_common, file_id)
        SELECT {store.run_id(RUN)}, step, sample, pos, layer,
               list_sum(list_transform(se, lambda x, j: x::UBIGINT << ((j - 1) * {ID_BITS})::UTINYINT))::UBIGINT,
               {ID_BITS}, CASE WHEN flip THEN te END, {K}, flip, top1, nc, (1000 + step // {FILE_STEPS})::INTEGER
        FROM (SELECT step, sample, pos, layer, se,
                     CASE WHEN sw THEN list_transform(se, lambda x, j: CASE WHEN j = 1 THEN (x + 1) % {EXPERTS} ELSE x END)
                          ELSE se END AS te, sw AS flip, sw AS top1, CASE WHEN sw THEN {K - 1} ELSE {K} END AS nc
              FROM (SELECT i // ({ROUTED_LEN} * {LAYERS}) AS step, (i // {LAYERS}) % {ROUTED_LEN} // {LEN} AS sample,
                           ((i // {LAYERS}) % {ROUTED_LEN} % {LEN})::INTEGER AS pos, (i % {LAYERS})::INTEGER AS layer,
                           list_transform(range({K}), lambda j: ((hash(i) % {EXPERTS}) + j * 8 + 1)::INTEGER % {EXPERTS}) AS se,
                           random() < 0.03 AS sw
                    FROM range({STEPS * ROUTED_LEN * LAYERS}) r(i)))""")
    con.execute(f"""INSERT INTO expert_load (run, step, layer, expert, n_sampler, n_trainer, file_id)
        SELECT '{RUN}', step, layer, e, count(*), count(*), 1000 + step // {FILE_STEPS}
        FROM (SELECT step, layer, unnest(sampler_experts) AS e FROM routing) GROUP BY ALL""")
    con.execute("INSERT INTO runs (run, config) VALUES (?, '{}')", [RUN])
    t2 = time.perf_counter()
    with store.transaction() as w:  # the ingest hook, once per "file", as ingest calls it
        for f in range(COMPUTED_FILES):
            compute.add_file(w, 1 + f)
    t3 = time.perf_counter()
    with store.transaction() as w:
        for f in range(COMPUTED_FILES):
            compute.add_file(w, 1000 + f)
    t4 = time.perf_counter()
    block = COMPUTED_FILES * FILE_STEPS
    with store.transaction() as w:  # repeat the computed block's summary rows over the other steps
        for j in range(1, STEPS // block):
            for table in SUMMARY_TABLES:
                w.execute(f"INSERT INTO {table} SELECT * REPLACE (step + {j * block} AS step, "
                          f"file_id + {j * COMPUTED_FILES} AS file_id) FROM {table} WHERE step < {block}")
    con.execute(f"CREATE OR REPLACE TABLE build_info AS SELECT '{BUILD_VERSION}' AS version")
    store.close()
    return {"tokens_s": t1 - t0, "routing_s": t2 - t1, "summaries_tokens_s": t3 - t2, "summaries_routing_s": t4 - t3,
            "computed_tokens": block * SEQS * LEN, "computed_routing": block * ROUTED_LEN * LAYERS}


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "analysis", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def is_built(path: Path) -> bool:
    """Whether `path` holds a database built by this version of build()."""
    if not path.exists():
        return False
    with Store(path, read_only=True) as s:
        return bool(s.scalar("SELECT count(*) FROM information_schema.tables WHERE table_name = 'build_info'")) \
            and s.scalar("SELECT version FROM build_info") == BUILD_VERSION


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    built = {}
    if args.rebuild or not is_built(DB):
        built = build(DB)
        print("built", built, flush=True)
    with Store(DB, read_only=True) as s:
        n_tok = s.scalar("SELECT sum(n_tokens)::BIGINT FROM summary_step")
        n_rout = s.scalar("SELECT count(*) FROM routing")
        rows = {t: s.scalar(f"SELECT count(*) FROM {t}") for t in
                SUMMARY_TABLES}
    res = {}
    res["startup"] = best(lambda: subprocess.run([sys.executable, "-c", "import analysis.metrics.report"], check=True),
                          args.repeat)
    for by in ("step", "run"):
        res[f"cli_{by}"] = best(lambda: cli("metrics", "--db", str(DB), "--by", by), args.repeat)
    res["cli_corr"] = best(lambda: cli("corrections", "--db", str(DB), "--method", "icepop", "--by", "run"), args.repeat)
    sim = [(m, dict(corrections.METHODS[m].defaults)) for m in ("icepop", "geo_rs", "seq_rs")]
    with Store(DB, read_only=True) as s:
        for by in ("step", "run"):
            res[f"summ_{by}"] = best(lambda: report.metrics_table(s, [RUN], by=by), args.repeat)
        for by in ("step", "run"):  # the token-row path the CLI took before: one scan of 40M rows
            res[f"tok_{by}"] = best(lambda: metrics.token_metrics(s, [RUN], by=by), 1)
        res["summ_corr"] = best(lambda: corrections.compare_methods(s, [RUN], sim, source="summaries"), args.repeat)
        res["tok_corr"] = best(lambda: corrections.compare_methods(s, [RUN], sim, source="tokens"), 2)
    load = os.getloadavg()[0]
    lines = [
        f"\n## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC · {platform.machine()} · {os.cpu_count()} cores · "
        f"load {load:.1f} · best of {args.repeat}",
        f"{n_tok:,} summarised tokens, {n_rout:,} routing rows; summary rows: "
        + ", ".join(f"{t} {n:,}" for t, n in rows.items()),
        "",
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
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        if not RESULTS.exists():
            RESULTS.write_text("# Summaries: metrics tables from summaries vs token rows\n\n"
                               "Command: `python benchmarks/bench_summaries.py` (see its docstring).\n")
        with open(RESULTS, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
