"""Run-scale Parquet inputs: one tokens file (`n_tokens` over `steps` steps, sequences of 500; s uniform in
[-5, 0], t = s + U(-0.01, 0.01) kept <= 0) and, unless routing_tokens is 0, one routing file (the first tokens of
every step, `layers` layers, top-8 of 64 on both sides, ~3% of rows with another top-1), written with DuckDB
under benchmarks/work/scale/ once per shape. bench_scale.py and bench_summary_hook.py load them."""
from __future__ import annotations

from pathlib import Path

import duckdb

from harness import WORK as _WORK

WORK = _WORK / "scale"
SEQ_LEN = 500


def make(n_tokens: int, steps: int, routing_tokens: int, layers: int) -> list[Path]:
    """tokens.parquet (and routing.parquet when routing_tokens > 0), written once per shape."""
    out = WORK / f"t{n_tokens}_s{steps}_r{routing_tokens}_l{layers}"
    done = out / "DONE"
    files = [out / "tokens.parquet"] + ([out / "routing.parquet"] if routing_tokens else [])
    if done.exists():
        return files
    out.mkdir(parents=True, exist_ok=True)
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = true")
    per_step = n_tokens // steps
    # t = s + small noise (kept <= 0); token i of the run is token (i % per_step) of step i // per_step
    con.execute(f"""COPY (
        SELECT 'bench' AS run, (i // {per_step})::BIGINT AS step, ((i % {per_step}) // {SEQ_LEN})::BIGINT AS sample,
               (i % {SEQ_LEN})::INTEGER AS pos, (hash(i) % 50000)::INTEGER AS token_id, s AS sampler_logprob,
               least(0.0, s + (random() - 0.5) * 0.02) AS trainer_logprob
        FROM (SELECT i, -(random() * 5) AS s FROM range({per_step * steps}) t(i)))
        TO '{files[0]}' (FORMAT parquet)""")
    if routing_tokens:
        per_r = routing_tokens // steps  # the first per_r tokens of every step carry routing
        con.execute(f"""COPY (
            WITH base AS (
                SELECT 'bench' AS run, (j // {per_r})::BIGINT AS step, ((j % {per_r}) // {SEQ_LEN})::BIGINT AS sample,
                       (j % {SEQ_LEN})::INTEGER AS pos, l::INTEGER AS layer,
                       list_transform(range(8), lambda e: (e * 8 + hash(j, l, e) % 8)::INTEGER) AS se,
                       hash(j, l, 7) % 100 < 3 AS flip
                FROM range({per_r * steps}) t(j), range({layers}) u(l))
            SELECT run, step, sample, pos, layer, se AS sampler_experts,
                   CASE WHEN flip THEN list_transform(range(8), lambda e:
                        CASE WHEN e = 0 THEN ((se[1] + 1) % 8)::INTEGER ELSE se[e + 1] END)
                        ELSE se END AS trainer_experts
            FROM base ORDER BY step, sample, pos, layer) TO '{files[1]}' (FORMAT parquet)""")
    con.close()
    done.touch()
    return files
