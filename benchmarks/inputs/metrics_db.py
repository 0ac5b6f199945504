"""The metrics database: 5M tokens (50 steps of 200 sequences of 500) and 8M routing rows (32 layers, top-8 of 64,
3% set flips, 5% rotations), written straight with DuckDB SQL into a Store, with expert load and the summaries
ingest writes. bench_metrics.py times the metric queries on it; bench_pages.py and bench_load.py open it in the
app (with a second run added)."""
from __future__ import annotations

import time
from pathlib import Path

import harness
from harness import WORK, stamp_built
from inputs import seeded_store

from analysis import schema
from analysis.ingest import summarise as compute

DB = WORK / "bench_metrics.duckdb"
PAGES_LARGE = WORK / "pages_large.duckdb"  # DB plus a second run (bench_pages.py builds it)
RUN = "bench"
STEPS, SEQS, LEN = 50, 200, 500          # 50 × 200 × 500 = 5,000,000 tokens
ROUTED_SEQS, LAYERS, K, EXPERTS = 10, 32, 8, 64  # 50 × 10 × 500 × 32 = 8,000,000 routing rows
BUILD_VERSION = "4"  # 2: routing stored compact in routing_rows; 3: with summaries; 4: run codes


def build(path: Path) -> None:
    """Fill a fresh Store with synthetic tokens, routing (with derived columns) and expert_load, in SQL."""
    store, con = seeded_store(path)
    t0 = time.perf_counter()
    # s ~ −Exp(1.5) (natural log-probs ≤ 0); Δ ~ N(0, 0.05) via Box–Muller, 0.5% of tokens ×20 (heavy tail)
    con.execute(f"""
        INSERT INTO {schema.TOKEN_STORE_FULL} (run_id, step, sample, pos, token_id, sampler_logprob,
                                               trainer_logprob, sampler_version, trainer_version, file_id)
        SELECT {store.run_id(RUN)}, i // {SEQS * LEN}, (i // {LEN}) % {SEQS}, (i % {LEN})::INTEGER, (hash(i) % 50000)::INTEGER,
               s, least(s + d, 0.0), i // {SEQS * LEN} - 1, i // {SEQS * LEN}, 1
        FROM (SELECT i, 1.5 * ln(1.0 - random()) AS s,
                     0.05 * sqrt(-2.0 * ln(1.0 - random())) * cos(2.0 * pi() * random())
                     * CASE WHEN random() < 0.005 THEN 20.0 ELSE 1.0 END AS d
              FROM range({STEPS * SEQS * LEN}) r(i))""")
    t1 = time.perf_counter()
    # Sampler top-k: base + j·m (mod 64) with m odd, so the k ids are distinct. Trainer: 3% of rows swap the
    # top-1 expert for one outside the set (a flip, n_common = k − 1); 5% rotate the list (same set, top-1 flip).
    # stored compact as ingest stores it: the trainer's list only where it differs rank for rank (view `routing`)
    con.execute(f"""
        INSERT INTO {schema.ROUTING_STORE} (run_id, step, sample, pos, layer, sampler_experts, trainer_experts,
                                            k, flip, top1_flip, n_common, file_id)
        SELECT {store.run_id(RUN)}, step, sample, pos, layer, se, CASE WHEN te <> se THEN te END, {K}, swap, swap OR rot,
               CASE WHEN swap THEN {K - 1} ELSE {K} END, 1
        FROM (SELECT step, sample, pos, layer, swap, rot, se,
                     CASE WHEN swap THEN list_concat([((base + {K} * m) % {EXPERTS})::INTEGER], se[2:])
                          WHEN rot THEN list_concat(se[2:], se[1:1]) ELSE se END AS te
              FROM (SELECT step, sample, pos, layer, base, m, u < 0.03 AS swap, u >= 0.03 AND u < 0.08 AS rot,
                           list_transform(range({K}), lambda j: ((base + j * m) % {EXPERTS})::INTEGER) AS se
                    FROM (SELECT t.step, t.sample, t.pos, l.layer, floor(random() * {EXPERTS})::BIGINT AS base,
                                 2 * floor(random() * {EXPERTS // 2})::BIGINT + 1 AS m, random() AS u
                          FROM (SELECT step, sample, pos FROM tokens WHERE sample < {ROUTED_SEQS}) t,
                               range({LAYERS}) l(layer))))""")
    t2 = time.perf_counter()
    con.execute("""
        INSERT INTO expert_load
        SELECT run, step, layer, expert, sum(ns), sum(nt), 1 FROM (
            SELECT run, step, layer, unnest(sampler_experts) AS expert, 1 AS ns, 0 AS nt FROM routing
            UNION ALL
            SELECT run, step, layer, unnest(trainer_experts), 0, 1 FROM routing WHERE trainer_experts IS NOT NULL)
        GROUP BY ALL""")
    con.execute("INSERT INTO runs (run, config) VALUES (?, '{}')", [RUN])
    with store.transaction() as w:  # the summaries ingest writes (routing by layer reads summary_layer)
        compute.add_file(w, 1)
    stamp_built(con, BUILD_VERSION)
    con.execute("CHECKPOINT")
    t3 = time.perf_counter()
    print(f"built {path}: tokens {t1 - t0:.1f}s, routing {t2 - t1:.1f}s, expert_load {t3 - t2:.1f}s")
    store.close()


def is_built(path: Path) -> bool:
    """Whether `path` holds a database built by this version of build()."""
    return harness.is_built(path, BUILD_VERSION)


def ensure(rebuild: bool = False) -> Path:
    """DB, built first when missing, of an earlier version, or `rebuild`."""
    if rebuild or not is_built(DB):
        build(DB)
    return DB
