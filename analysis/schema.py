"""The canonical tables of SCHEMA.md (v1.1) in one place: column names, DuckDB types, required flags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

@dataclass(frozen=True)
class Column:
    name: str
    sql_type: str
    required: bool
    doc: str = ""


TOKEN_KEY = ("run", "step", "sample", "pos")
ROUTING_KEY = TOKEN_KEY + ("layer",)
SEQUENCE_KEY = ("run", "step", "sample")

TOKENS = (
    Column("run", "VARCHAR", True, "experiment name"),
    Column("step", "BIGINT", True, "trainer step that consumed the sequence"),
    Column("sample", "BIGINT", True, "sequence id within (run, step)"),
    Column("pos", "INTEGER", True, "0-based position inside the response"),
    Column("token_id", "INTEGER", False, "vocabulary id"),
    Column("token", "VARCHAR", False, "decoded token text"),
    Column("sampler_logprob", "DOUBLE", True, "s: log-prob the sampler reported"),
    Column("trainer_logprob", "DOUBLE", True, "t: log-prob the trainer recomputed"),
    Column("sampler_version", "BIGINT", False, "policy version of the sampler"),
    Column("trainer_version", "BIGINT", False, "policy version of the trainer"),
    Column("sampler_entropy", "DOUBLE", False, "sampler next-token entropy"),
    Column("trainer_entropy", "DOUBLE", False, "trainer next-token entropy"),
    Column("advantage", "DOUBLE", False, "the token's advantage (per-token advantages, e.g. GAE)"),
    Column("segment", "INTEGER", False, "turn index of the token in a multi-turn rollout (0-based)"),
    Column("sampling_support", "INTEGER", False, "tokens the sampler's top-p / top-k kept at this position"),
)

ROUTING = (
    Column("run", "VARCHAR", True),
    Column("step", "BIGINT", True),
    Column("sample", "BIGINT", True),
    Column("pos", "INTEGER", True),
    Column("layer", "INTEGER", True, "0-based MoE layer"),
    Column("sampler_experts", "INTEGER[]", True, "sampler top-k expert ids"),
    Column("trainer_experts", "INTEGER[]", False, "trainer top-k expert ids (NULL: sampler side only)"),
    Column("sampler_weights", "FLOAT[]", False, "sampler router combine weights, in sampler_experts' order (fp32)"),
    Column("trainer_weights", "FLOAT[]", False, "trainer router combine weights, in trainer_experts' order (fp32)"),
    Column("sampler_margin", "FLOAT", False, "sampler router margin: k-th minus (k+1)-th probability (fp32)"),
    Column("trainer_margin", "FLOAT", False, "trainer router margin, the same"),
)

# The J most likely tokens of each side at a position (METRICS.md v3 "Full distribution"): one row per token that
# has them, beside its token row. Log-probs are stored as fp32, what engines return (DOUBLE doubled the bytes:
# benchmarks/RESULTS-logger.md); ids as INTEGER. Both sides together: the columns compare them.
TOPK = (
    Column("run", "VARCHAR", True),
    Column("step", "BIGINT", True),
    Column("sample", "BIGINT", True),
    Column("pos", "INTEGER", True),
    Column("sampler_topk_ids", "INTEGER[]", True, "the sampler's J most likely token ids (distinct)"),
    Column("sampler_topk_logprobs", "FLOAT[]", True, "their log-probs under the sampler, in the same order"),
    Column("trainer_topk_ids", "INTEGER[]", True, "the trainer's J most likely token ids (distinct)"),
    Column("trainer_topk_logprobs", "FLOAT[]", True, "their log-probs under the trainer"),
)

# Derived at ingest so that set comparisons never run at query time (sorting the expert lists with list_sort
# took ~10 s on 8M routing rows).
ROUTING_DERIVED = (
    Column("k", "SMALLINT", True, "top-k size"),
    Column("flip", "BOOLEAN", False, "set(sampler) != set(trainer); NULL when trainer side missing"),
    Column("top1_flip", "BOOLEAN", False, "first-ranked experts differ; NULL when trainer side missing"),
    Column("n_common", "SMALLINT", False, "|E_s ∩ E_t|; NULL when trainer side missing"),
)

SEQUENCES = (
    Column("run", "VARCHAR", True),
    Column("step", "BIGINT", True),
    Column("sample", "BIGINT", True),
    Column("reward", "DOUBLE", False),
    Column("advantage", "DOUBLE", False),
    Column("prompt", "VARCHAR", False),
    Column("response_length", "INTEGER", False),
    Column("response", "VARCHAR", False, "response text as the sampler produced it"),
    Column("tag", "VARCHAR", False, "the sequence's task label (a domain such as code, math, chat)"),
)

# The drift-origin probe (analysis/probe/): one row per (token, layer, op) of a run the probe wrote, comparing the
# sampler-side activation (KV-cache decoding, sampler dtype) with the trainer-side one (one teacher-forced forward,
# trainer dtype); floor_* is the same comparison with both sides in fp32 (the noise floor). Router columns are
# set on op = 'router' rows only. Not part of a log's contract: written by the probe, read by metrics/probe.py.
PROBE_OPS = ("input", "attn", "router", "mlp")  # within a layer, in the order the block computes them
PROBE = (
    Column("run", "VARCHAR", True),
    Column("step", "BIGINT", True),
    Column("sample", "BIGINT", True, "prompt index"),
    Column("pos", "INTEGER", True, "response position (the token predicted from this position's activations)"),
    Column("layer", "INTEGER", True, "0-based decoder layer"),
    Column("op", "VARCHAR", True, "input (block input), attn (attention output), router (router logits), "
                                  "mlp (MoE or MLP output)"),
    Column("rel_l2", "DOUBLE", True, "||a_s - a_t||_2 / ||a_t||_2"),
    Column("max_abs", "DOUBLE", True, "max |a_s - a_t|"),
    Column("floor_rel_l2", "DOUBLE", True, "rel_l2 with both sides in fp32"),
    Column("floor_max_abs", "DOUBLE", True, "max_abs with both sides in fp32"),
    Column("sampler_topk", "INTEGER[]", False, "router top-k ids, sampler side (fp32 softmax order)"),
    Column("trainer_topk", "INTEGER[]", False, "router top-k ids, trainer side"),
    Column("sampler_margin", "DOUBLE", False, "k-th minus (k+1)-th router probability (softmax in fp32), sampler"),
    Column("trainer_margin", "DOUBLE", False, "the same, trainer"),
    Column("flip", "BOOLEAN", False, "set(sampler_topk) != set(trainer_topk)"),
)
PROBE_TABLE = "probe"


def probe_ddl() -> str:
    return f"CREATE TABLE IF NOT EXISTS {PROBE_TABLE} (" + ", ".join(f"{c.name} {c.sql_type}" for c in PROBE) + ")"


TABLES = {"tokens": TOKENS, "routing": ROUTING, "sequences": SEQUENCES, "topk": TOPK}
KEYS = {"tokens": TOKEN_KEY, "routing": ROUTING_KEY, "sequences": SEQUENCE_KEY, "topk": TOKEN_KEY}


def names(table: str) -> list[str]:
    return [c.name for c in TABLES[table]]


def required(table: str) -> list[str]:
    return [c.name for c in TABLES[table] if c.required]


# The stored tables of token and routing rows hold a run's integer code (`run_id`, from the table `run_ids`) where
# SCHEMA.md has the run name: DuckDB compressing 40M copies of a name cost ~3.5 CPU-s of an ~11 CPU-s token load,
# an integer column ~0.7 s (benchmarks/RESULTS-scale.md). The views below join the name back. Tables made before
# the codes keep their names (rewriting them doubled a 1.2 GB database file, which DuckDB does not shrink): each
# view part reads a table as it is stored, and a load writes what its table holds (store.Writer.coded).
RUN_IDS = "run_ids"
RUN_IDS_DDL = f"CREATE TABLE IF NOT EXISTS {RUN_IDS} (run_id INTEGER PRIMARY KEY, run VARCHAR NOT NULL UNIQUE)"


def _run_id() -> Column:
    return Column("run_id", "INTEGER", True, "the run's code in run_ids")


# Routing is stored in `routing_rows`, where trainer_experts is NULL wherever it equals sampler_experts rank for
# rank (most rows: only flipped or reordered top-k lists are kept twice), and the sampler's list is one integer
# where it fits (ROUTING_PACKED); the view `routing` puts the lists back, so every reader sees SCHEMA.md's table.
# NULL trainer_experts *and* NULL flip: the trainer side was not recorded.
ROUTING_STORE = "routing_rows"

# The sampler's top-k as one integer: id c of the list (rank order) in bits c·id_bits .. (c + 1)·id_bits − 1, with
# id_bits the bit length of the largest id of the row's ingest batch; sampler_experts is then NULL. Batches whose
# k ids need more than 64 bits (e.g. top-8 of 384 experts) keep the list, and so do rows stored before the packing.
ROUTING_PACKED = (
    Column("sampler_packed", "UBIGINT", False, "sampler top-k ids, id_bits bits each in rank order"),
    Column("id_bits", "UTINYINT", False, "bits per id in sampler_packed"),
)
SAMPLER_EXPERTS_SQL = ("CASE WHEN x.sampler_packed IS NULL THEN x.sampler_experts ELSE list_transform(range(x.k), "
                       "lambda c: ((x.sampler_packed >> (c * x.id_bits)::UTINYINT) "
                       "& ((1::UBIGINT << x.id_bits) - 1))::INTEGER) END")


# Rows whose sampler list is packed and that carry no weights (the common case) go to the narrower
# ROUTING_PACKED_STORE: DuckDB writes a column that is NULL in every row at about the cost of one with data, and the
# three NULL list columns (sampler_experts, both weights) were ~25 % of the CPU of inserting 16M routing rows
# (benchmarks/RESULTS-scale.md). The view `routing` reads both tables (and the packed one's twin:
# FIXED_COMPRESSION).
ROUTING_PACKED_STORE = "routing_rows_packed"
ROUTING_PACKED_LOOSE = "routing_rows_packed_unordered"  # the same rows of a file not in key order (KEY_RUN)
ROUTING_WIDE_ONLY = ("sampler_experts", "sampler_weights", "trainer_weights", "sampler_margin", "trainer_margin")


def routing_packed(columns) -> bool:
    """Whether routing rows of these columns fit ROUTING_PACKED_STORE (sampler ids packed, no list of them, no
    weights)."""
    return "sampler_packed" in columns and not set(columns) & set(ROUTING_WIDE_ONLY)


def _stored_select(store: str, columns: Sequence[Column], have, coded) -> str:
    """SELECT of the stored table `store` as a view's `columns`, then file_id: the run's name (from run_ids where
    `store` is among the `coded` tables, which hold run codes), and a typed NULL for each column not in `have`."""
    run = "r.run" if store in coded else "x.run"
    cols = ", ".join(run if c.name == "run" else f"x.{c.name}" if c.name in have
                     else f"NULL::{c.sql_type} AS {c.name}" for c in columns)
    join = f" JOIN {RUN_IDS} r ON x.run_id = r.run_id" if store in coded else ""
    return f"SELECT {cols}, x.file_id FROM {store} x{join}"


def by_run_id(table: str, columns: Sequence[str], coded) -> str | None:
    """The rows of `table` (tokens or routing) from every stored table as (run_id, *columns, file_id), without the
    view's join to run names: for SQL that matches rows by key or groups them. Joining a file's 500k routing
    tokens with 40M token rows took 0.04 s this way against 0.14 s through the view, which makes a run name per
    row. None where a stored table holds names (made before run codes): the caller then reads the view."""
    stores = stored_tables(table)
    if not all(s in coded for s in stores):
        return None
    cols = ", ".join(("run_id", *columns, "file_id"))
    return " UNION ALL ".join(f"SELECT {cols} FROM {s}" for s in stores)


def routing_view(coded=(ROUTING_STORE, ROUTING_PACKED_STORE, ROUTING_PACKED_LOOSE)) -> str:
    """The view `routing` over both stored routing tables; `coded`: those that hold run codes rather than names
    (tables made before the codes hold names)."""
    columns = ROUTING + ROUTING_DERIVED + ROUTING_PACKED
    every = [c.name for c in columns]
    packed = [c for c in every if c not in ROUTING_WIDE_ONLY]
    lists = ("EXCLUDE (sampler_packed, id_bits) "
             f"REPLACE ({SAMPLER_EXPERTS_SQL} AS sampler_experts, "
             "CASE WHEN x.trainer_experts IS NOT NULL THEN x.trainer_experts "
             f"WHEN x.flip IS NOT NULL THEN {SAMPLER_EXPERTS_SQL} END AS trainer_experts)")
    return f"""CREATE OR REPLACE VIEW routing AS SELECT x.* {lists} FROM (
    {_stored_select(ROUTING_STORE, columns, every, coded)}
    UNION ALL {_stored_select(ROUTING_PACKED_STORE, columns, packed, coded)}
    UNION ALL {_stored_select(ROUTING_PACKED_LOOSE, columns, packed, coded)}) x"""


# Tokens are stored in two tables behind the view `tokens` (and the narrow one's twin: FIXED_COMPRESSION). DuckDB
# writes a column that is NULL in every row about as slowly as one with data (40M rows: ~1.3 CPU-s each;
# benchmarks/RESULTS-scale.md), and most logs carry none of the optional columns but token_id: their rows go to the
# narrow `token_rows`, the others to `token_rows_full` (every column). The view shows SCHEMA.md's table; every
# reader queries it.
TOKENS_VIEW_NAME = "tokens"
TOKEN_STORE = "token_rows"
TOKEN_STORE_LOOSE = "token_rows_unordered"  # the narrow rows of a file not in key order (KEY_RUN)
TOKEN_STORE_FULL = "token_rows_full"
TOKEN_NARROW = ("run", "step", "sample", "pos", "token_id", "sampler_logprob", "trainer_logprob")


def _file_id() -> Column:
    return Column("file_id", "INTEGER", True)


def token_narrow(columns) -> bool:
    """Whether token rows of these columns fit the narrow table (no optional column but token_id)."""
    return set(columns) - {"file_id", "run_id"} <= set(TOKEN_NARROW)


def tokens_view(coded=(TOKEN_STORE, TOKEN_STORE_LOOSE, TOKEN_STORE_FULL)) -> str:
    """The view `tokens` over the stored tables; `coded`: those that hold run codes rather than names."""
    return f"""CREATE OR REPLACE VIEW {TOKENS_VIEW_NAME} AS
    {_stored_select(TOKEN_STORE, TOKENS, TOKEN_NARROW, coded)}
    UNION ALL {_stored_select(TOKEN_STORE_LOOSE, TOKENS, TOKEN_NARROW, coded)}
    UNION ALL {_stored_select(TOKEN_STORE_FULL, TOKENS, names("tokens"), coded)}"""


# The two narrow tables hold the rows of files in key order, and their columns' compression is fixed: DuckDB
# otherwise tries every method it has (bit-packing, RLE, dictionary, ...) on every column of every row group before
# it writes, and picks the ones below for such rows anyway. Measured on 40M token rows streamed from Arrow (the
# database file the same size): the tokens file's load 6.3–7.1 s against 7.3–8.4 s, 1.5 CPU-s less; 16M routing
# rows 0.6 CPU-s less (benchmarks/RESULTS-scale.md). RLE on a key is only good where the key comes in long runs:
# over shuffled rows it doubled the table, so rows of a file whose (run, step, sample[, pos]) runs are shorter than
# KEY_RUN rows on average go to a twin (_LOOSE) with DuckDB's own choice.
KEY_RUN = 16
FIXED_COMPRESSION = {
    TOKEN_STORE: {"run_id": "rle", "step": "rle", "sample": "rle", "pos": "bitpacking", "token_id": "bitpacking",
                  "file_id": "rle"},
    ROUTING_PACKED_STORE: {"run_id": "rle", "step": "rle", "sample": "rle", "pos": "rle", "layer": "bitpacking",
                           "k": "rle", "n_common": "bitpacking", "sampler_packed": "bitpacking", "id_bits": "rle",
                           "file_id": "rle"},
}
# the columns whose runs decide (besides the run): KEY_RUN
KEY_RUN_COLUMNS = {"tokens": ("step", "sample"), "routing": ("step", "sample", "pos")}

# the stored tables made to hold run codes
RUN_CODED = (TOKEN_STORE, TOKEN_STORE_LOOSE, TOKEN_STORE_FULL, ROUTING_STORE, ROUTING_PACKED_STORE,
             ROUTING_PACKED_LOOSE)
NARROW_STORES = (TOKEN_STORE, TOKEN_STORE_LOOSE, ROUTING_PACKED_STORE, ROUTING_PACKED_LOOSE)


def stored_table(table: str, columns=None, ordered: bool = True) -> str:
    """The DuckDB table that rows of `table` with these columns are inserted into (routing: the compact one
    behind the view, the packed one where the columns allow; tokens: the narrow one where the columns allow, see
    TOKEN_STORE); `ordered` False: a narrow table's twin for files not in key order (KEY_RUN)."""
    if table == "routing":
        if columns is not None and routing_packed(columns):
            return ROUTING_PACKED_STORE if ordered else ROUTING_PACKED_LOOSE
        return ROUTING_STORE
    if table == "tokens":
        if columns is not None and token_narrow(columns):
            return TOKEN_STORE if ordered else TOKEN_STORE_LOOSE
        return TOKEN_STORE_FULL
    return table


def stored_tables(table: str) -> tuple[str, ...]:
    """Every DuckDB table that holds rows of `table` (to delete them)."""
    if table == "tokens":
        return TOKEN_STORE, TOKEN_STORE_LOOSE, TOKEN_STORE_FULL
    if table == "routing":
        return ROUTING_STORE, ROUTING_PACKED_STORE, ROUTING_PACKED_LOOSE
    return (stored_table(table),)


def stored_columns(table: str, narrow: bool = False) -> tuple[Column, ...]:
    """Columns as stored in DuckDB: the schema's (`narrow`: tokens only TOKEN_NARROW, routing none of
    ROUTING_WIDE_ONLY; run_id in place of run for tokens and routing), derived ones, and the id of the file that
    brought the row."""
    if table == "tokens" and narrow:
        cols = tuple(c for c in TOKENS if c.name in TOKEN_NARROW)
    else:
        cols = TABLES[table] + (ROUTING_DERIVED + ROUTING_PACKED if table == "routing" else ())
        if table == "routing" and narrow:
            cols = tuple(c for c in cols if c.name not in ROUTING_WIDE_ONLY)
    if table in ("tokens", "routing"):  # see RUN_IDS
        cols = tuple(_run_id() if c.name == "run" else c for c in cols)
    return cols + (_file_id(),)
