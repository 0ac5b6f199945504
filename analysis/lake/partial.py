"""Read one partition's results out of its private database, and merge partial summaries exactly.

The summary rows themselves are written by ingest (analysis.summaries, the same code for every writer); here
they are only read back, merged by their key (SUM of `n_*`/`sum_*`, MIN of `min_*`, MAX of `max_*`: the merge
rule of analysis/summaries/schema.py) and stripped of the private database's file ids.
"""
from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from analysis import schema
from analysis.ingest import summary_files as sf
from analysis.store import Store
from analysis.summaries import schema as summary_schema

# what a summary file holds: every summary table (summary_sample included) and expert_load, without file_id
MERGED_TABLES = tuple(sf.TABLES)
SAMPLE_TABLE = "summary_sample"

# --token-sample: whole sequences kept by |Σ Δ| and single tokens by |Δ| per step: DriftLogger's defaults
# (analysis/record/token_sample.py, which needs torch; tests/test_lake_summarize.py checks that they agree)
WORST_SEQUENCES = 1
TOP_TOKENS = 256
SAMPLE_COUNTS = ("n_tokens", "n_kept", "n_uniform", "n_worst_seq_tokens", "n_top_tokens")


def table_columns(table: str) -> list[str]:
    return [c.name for c in sf.TABLES[table]]


def merge_plan(table: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(key columns, [(column, 'sum'|'min'|'max')]) of a merged table."""
    keys, aggs = [], []
    for c in table_columns(table):
        kind = summary_schema.merge_kind(c)
        if kind == "key":
            keys.append(c)
        else:
            aggs.append((c, kind))
    return keys, aggs


def merge(table: str, parts: Iterable[pa.Table]) -> pa.Table:
    """Rows of `table` from any number of partial summaries, one row per key: exact (addition, min, max)."""
    parts = [p for p in parts if p is not None and p.num_rows]
    cols = table_columns(table)
    if not parts:
        return pa.table({c: pa.array([], t) for c, t in zip(cols, empty_types(table))})
    data = pa.concat_tables([p.select(cols) for p in parts], promote_options="permissive")
    if table == "sequences":  # rows, not sums: each sequence's row as written (ingest refuses a key twice)
        return data.sort_by([(k, "ascending") for k in schema.SEQUENCE_KEY])
    keys, aggs = merge_plan(table)
    out = data.group_by(keys, use_threads=False).aggregate(aggs)
    out = out.rename_columns([c.rsplit("_", 1)[0] if c.endswith(("_sum", "_min", "_max")) else c
                              for c in out.column_names])
    return out.select(cols).sort_by([(k, "ascending") for k in keys])


def empty_types(table: str) -> list[pa.DataType]:
    return [sf.ARROW[c.sql_type] for c in sf.TABLES[table]]


def summary_tables(store: Store) -> dict[str, pa.Table]:
    """Every summary table ingest writes (and expert_load) of the partition's database, merged over its files."""
    out = {}
    for table in MERGED_TABLES:
        if table == SAMPLE_TABLE:  # written by DriftLogger only; the lake job adds its own (sample_row)
            continue
        cols = ", ".join(table_columns(table))
        rows = store.arrow(f"SELECT {cols} FROM {table}")
        out[table] = merge(table, [rows])
    return out


def token_count(store: Store) -> int:
    return int(store.scalar("SELECT count(*) FROM tokens"))


def first_row_outside(store: Store, run: str, step: int) -> tuple | None:
    """(file name, run, step) of a token or routing row whose run or step is not the partition's."""
    for table in ("tokens", "routing", "sequences"):
        row = store.rows(f"SELECT f.name, t.run, t.step FROM {table} t JOIN files f USING (file_id) "
                         "WHERE t.run <> ? OR t.step <> ? LIMIT 1", [run, step])
        if row:
            return row[0]
    return None


def token_sample(store: Store, rate: float) -> tuple[dict[str, pa.Table], dict[str, int]]:
    """Token rows (and their routing rows) kept for drill-down views, and how many of each part, as DriftLogger
    keeps them (analysis/record/token_sample.py): a uniform share `rate` (a hash of the token's key, so reruns keep the
    same tokens), every token of the WORST_SEQUENCES sequences with the largest |Σ Δ| and the TOP_TOKENS tokens
    with the largest |Δ|. rate 0 keeps nothing, rate 1 every token."""
    n = token_count(store)
    if rate <= 0.0 or rate >= 1.0:
        every = rate >= 1.0
        counts = dict(zip(SAMPLE_COUNTS, (n, n * every, n * every, 0, 0)))
        where = "TRUE" if every else "FALSE"
        flagged, params = f"SELECT *, {where} AS kept FROM tokens", []
    else:
        flagged = f"""
            WITH worst AS (SELECT sample FROM tokens GROUP BY sample
                           ORDER BY abs(sum(trainer_logprob - sampler_logprob)) DESC, sample LIMIT {WORST_SEQUENCES}),
                 top AS (SELECT sample, pos FROM tokens
                         ORDER BY abs(trainer_logprob - sampler_logprob) DESC, sample, pos LIMIT {TOP_TOKENS})
            SELECT *, u OR w OR tp AS kept FROM (
                SELECT *, (hash(run, step, sample, pos) & 4294967295) < ? AS u,
                       sample IN (SELECT sample FROM worst) AS w,
                       (sample, pos) IN (SELECT (sample, pos) FROM top) AS tp
                FROM tokens)"""
        params = [min(int(rate * (1 << 32)), 1 << 32)]
        row = store.rows(f"SELECT count(*), count_if(kept), count_if(u), count_if(w), count_if(tp) FROM ({flagged})",
                         params)[0]
        counts = dict(zip(SAMPLE_COUNTS, row))
    if rate <= 0.0:
        return {}, counts
    token_cols = ", ".join(c.name for c in schema.TOKENS)
    kept = f"SELECT {token_cols} FROM ({flagged}) WHERE kept"
    rows = {"tokens": store.arrow(f"{kept} ORDER BY sample, pos", params)}
    routing_cols = ", ".join(c.name for c in schema.ROUTING)
    rows["routing"] = store.arrow(f"""SELECT {routing_cols} FROM routing SEMI JOIN ({kept}) k USING (sample, pos)
                                      ORDER BY sample, pos, layer""", params)
    return rows, {k: int(v) for k, v in counts.items()}


def concat(tables: list[pa.Table]) -> pa.Table | None:
    """Token-sample rows of several partitions as one table (None when there are none)."""
    tables = [t for t in tables if t is not None and t.num_rows]
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def sample_row(run: str, step: int, rate: float, counts: dict[str, int]) -> pa.Table:
    """The step's summary_sample row (what DriftLogger records): the summaries cover n_tokens, rows hold n_kept."""
    values = {"run": run, "step": step, "token_sample": float(rate), "worst_sequences": WORST_SEQUENCES,
              "top_tokens": TOP_TOKENS} | counts
    return pa.table({c: pa.array([values[c]], t) for c, t in zip(table_columns(SAMPLE_TABLE),
                                                                  empty_types(SAMPLE_TABLE))})
