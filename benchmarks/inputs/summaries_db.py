"""The summaries database: 40M summarised tokens (400 steps of 200 sequences of 500) and 16M routing rows (the
first 1,250 tokens of each step, 32 layers, top-8 of 64), written with DuckDB SQL into a Store; the ingest hook
summarises the first 40 steps (timed) and those summary rows are repeated over the other 360 (query times depend
on the row counts only). bench_summaries.py times the metrics tables on it; bench_pages.py --only scale opens it
in the app (with a second run added)."""
from __future__ import annotations

import time
from pathlib import Path

import harness
from harness import WORK, stamp_built
from inputs import seeded_store

from analysis import schema
from analysis.ingest import summarise as compute

DB = WORK / "bench_summaries.duckdb"
RUN = "bench"
STEPS, SEQS, LEN = 400, 200, 500              # 400 × 200 × 500 = 40,000,000 tokens
ROUTED_LEN, LAYERS, K, EXPERTS = 1250, 32, 8, 64  # per step 1,250 tokens × 32 layers: 400 × 40,000 = 16M rows
FILE_STEPS = 10                               # steps per summarised "file"
COMPUTED_FILES = 4  # files summarised by the ingest hook (timed); their summary rows are then repeated with
# shifted steps to cover all STEPS (a 2-core shared machine summarises ~0.2M tokens/s: 40M would take minutes)
SUMMARY_TABLES = ("summary_step", "summary_seq", "summary_seq_band", "summary_hist", "summary_bucket",
                  "summary_bucket_band", "summary_layer")
BUILD_VERSION = "7"  # 2: routing into routing_rows; 3: summary layout 2 (band tables); 4: run codes;
# 5: the sampler's list packed (schema.ROUTING_PACKED); 6: into routing_rows_packed, as ingest stores such rows;
# 7: summary_seq with its log-prob sums (schema.SEQ_SUMS)
ID_BITS = (EXPERTS - 1).bit_length()  # as ingest packs these ids (K · ID_BITS <= 64)


def build(path: Path) -> dict:
    store, con = seeded_store(path)
    t0 = time.perf_counter()
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
              FROM range({TOKEN_STEPS * SEQS * LEN}) r(i))""")
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
                    FROM range({TOKEN_STEPS * ROUTED_LEN * LAYERS}) r(i)))""")
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
    stamp_built(con, BUILD_VERSION)
    store.close()
    return {"tokens_s": t1 - t0, "routing_s": t2 - t1, "summaries_tokens_s": t3 - t2, "summaries_routing_s": t4 - t3,
            "computed_tokens": block * SEQS * LEN, "computed_routing": block * ROUTED_LEN * LAYERS}


TOKEN_STEPS = STEPS  # steps that get token and routing rows (the summaries cover STEPS either way)


def use_steps(steps: int, token_steps: int | None = None) -> None:
    """Build and read a database of `steps` steps (a multiple of FILE_STEPS * COMPUTED_FILES; 400 = 40M tokens,
    40 = 4M) instead of STEPS, kept in its own file. token_steps: only the first ones get token and routing rows
    (at least the summarised block): the summaries of a 40M-token run over 4M token rows, for a busy machine
    (what reads token rows then reads fewer)."""
    global STEPS, TOKEN_STEPS, DB
    block = FILE_STEPS * COMPUTED_FILES
    token_steps = steps if token_steps is None else token_steps
    if steps < block or steps % block or not block <= token_steps <= steps:
        raise ValueError(f"steps must be a positive multiple of {block} and token_steps within [{block}, steps], "
                         f"got {steps} and {token_steps}")
    STEPS, TOKEN_STEPS = steps, token_steps
    name = "bench_summaries" + ("" if steps == 400 else f"_{steps}")
    DB = WORK / f"{name}{'' if token_steps == steps else f'_t{token_steps}'}.duckdb"


def is_built(path: Path) -> bool:
    """Whether `path` holds a database built by this version of build()."""
    return harness.is_built(path, BUILD_VERSION)


def ensure(rebuild: bool = False) -> tuple[Path, dict]:
    """(DB, the build's timings: {} when it was already built), built first when missing, of an earlier version,
    or `rebuild`."""
    built = build(DB) if rebuild or not is_built(DB) else {}
    return DB, built
