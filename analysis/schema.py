"""The canonical tables of SCHEMA.md (v1.1) in one place: column names, DuckDB types, required flags."""
from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = "1.1"


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
)

ROUTING = (
    Column("run", "VARCHAR", True),
    Column("step", "BIGINT", True),
    Column("sample", "BIGINT", True),
    Column("pos", "INTEGER", True),
    Column("layer", "INTEGER", True, "0-based MoE layer"),
    Column("sampler_experts", "INTEGER[]", True, "sampler top-k expert ids"),
    Column("trainer_experts", "INTEGER[]", False, "trainer top-k expert ids (NULL: sampler side only)"),
    Column("sampler_weights", "DOUBLE[]", False),
    Column("trainer_weights", "DOUBLE[]", False),
)

# Derived at ingest so that set comparisons never run at query time (PITFALLS: list_sort on 8M rows ~10 s).
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
)

TABLES = {"tokens": TOKENS, "routing": ROUTING, "sequences": SEQUENCES}
KEYS = {"tokens": TOKEN_KEY, "routing": ROUTING_KEY, "sequences": SEQUENCE_KEY}


def names(table: str) -> list[str]:
    return [c.name for c in TABLES[table]]


def required(table: str) -> list[str]:
    return [c.name for c in TABLES[table] if c.required]


def stored_columns(table: str) -> tuple[Column, ...]:
    """Columns as stored in DuckDB: the schema's, derived ones, and the id of the file that brought the row."""
    extra = ROUTING_DERIVED if table == "routing" else ()
    return TABLES[table] + extra + (Column("file_id", "INTEGER", True),)
