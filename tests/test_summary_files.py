"""Summary files (SCHEMA.md, "Summary files"): recognised by content, loaded all-or-nothing, refused with the
file, place and rule named when a value breaks the format's rules."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from analysis.ingest import ingest_paths, summary_files
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers.logger import make_step

TABLES = ("summary_step", "summary_seq", "summary_seq_band", "summary_hist", "summary_bucket", "summary_bucket_band",
          "summary_layer", "expert_load", "summary_sample")


@pytest.fixture(scope="module")
def summary_table(tmp_path_factory) -> pa.Table:
    out = tmp_path_factory.mktemp("logs")
    paths = DriftLogger(out, "r", token_sample=0.0).log_step(2, **make_step(B=4, T=9, seed=1))
    return pq.read_table(paths["summary"])


def write(table: pa.Table, path) -> None:
    pq.write_table(table.replace_schema_metadata({summary_files.SUMMARY_KEY: summary_files.FORMAT_VERSION}), path)


def set_value(table: pa.Table, column: str, table_name: str, value) -> tuple[pa.Table, int]:
    """Set `column` of the first row of `table_name` to value; returns the table and that row (1-based)."""
    rows = table.column("summary").to_pylist()
    i = rows.index(table_name)
    values = table.column(column).to_pylist()
    values[i] = value
    j = table.column_names.index(column)
    return table.set_column(j, column, pa.array(values, table.schema.field(column).type)), i + 1


def ingest_one(tmp_path, path, db="db.duckdb"):
    store = Store(tmp_path / db)
    (outcome,) = ingest_paths(store, [path])
    return store, outcome


def test_a_summary_file_is_recognised_and_loaded(tmp_path, summary_table):
    write(summary_table, tmp_path / "anything.parquet")  # recognised by its metadata, whatever its name
    store, outcome = ingest_one(tmp_path, tmp_path / "anything.parquet")
    assert outcome.status == "loaded" and outcome.format == "summary", outcome.line()
    for table in TABLES:
        want = pc.sum(pc.equal(summary_table.column("summary"), table)).as_py()
        assert want > 0 and store.scalar(f"SELECT count(*) FROM {table}") == want, table
    fid = store.scalar("SELECT file_id FROM files")
    assert store.scalar("SELECT count(DISTINCT file_id) FROM summary_seq") == 1
    assert store.scalar("SELECT min(file_id) FROM summary_step") == fid
    again = ingest_paths(store, [tmp_path / "anything.parquet"])[0]
    assert again.status == "skipped"
    assert store.runs()["run"].to_list() == ["r"]


def test_run_override(tmp_path, summary_table):
    write(summary_table, tmp_path / "s.parquet")
    store = Store(tmp_path / "db.duckdb")
    assert ingest_paths(store, [tmp_path / "s.parquet"], run="renamed")[0].status == "loaded"
    for table in TABLES:
        assert store.rows(f"SELECT DISTINCT run FROM {table}") == [("renamed",)], table


@pytest.mark.parametrize("column, table, value, message", [
    ("n_tokens", "summary_seq", -3, "column 'n_tokens': a count must be >= 0, got -3"),
    ("n_flip", "summary_layer", -1, "column 'n_flip': a count must be >= 0, got -1"),
    ("n_sampler", "expert_load", -2, "column 'n_sampler': a count must be >= 0, got -2"),
    ("sample", "summary_seq", None, "column 'sample': key value is missing (null)"),
    ("layer", "summary_layer", None, "column 'layer': key value is missing (null)"),
    ("band", "summary_seq_band", 500, "band must be in [0, 63)"),
    ("band", "summary_bucket_band", -1, "band must be in [0, 63)"),
    ("bin", "summary_hist", -1, "bin must be in [0, 703)"),
    ("sum_k3", "summary_step", float("nan"), "column 'sum_k3': value must be finite, got nan"),
    ("dim", "summary_bucket", "colour", "unknown bucket dimension 'colour'"),
    ("token_sample", "summary_sample", 1.5, "a share must be in [0, 1], got 1.5"),
    ("summary", "summary_step", "summary_colour", "column 'summary': unknown summary table 'summary_colour'"),
])
def test_bad_values_refuse_the_whole_file(tmp_path, summary_table, column, table, value, message):
    bad, row = set_value(summary_table, column, table, value)
    write(bad, tmp_path / "bad.parquet")
    store, outcome = ingest_one(tmp_path, tmp_path / "bad.parquet")
    assert outcome.status == "refused"
    assert outcome.message.startswith(f"bad.parquet: row {row}"), outcome.message
    assert message in outcome.message, outcome.message
    assert "SCHEMA.md" in outcome.message  # says where the rules are
    for t in TABLES + ("files", "runs"):
        assert store.scalar(f"SELECT count(*) FROM {t}") == 0, t  # nothing of a refused file


def test_missing_key_column_and_unknown_version(tmp_path, summary_table):
    write(summary_table.drop(["band"]), tmp_path / "nokey.parquet")
    _, outcome = ingest_one(tmp_path, tmp_path / "nokey.parquet")
    assert outcome.status == "refused" and "column 'band' is missing" in outcome.message, outcome.message
    pq.write_table(summary_table.replace_schema_metadata({summary_files.SUMMARY_KEY: b"7"}), tmp_path / "v7.parquet")
    _, outcome = ingest_one(tmp_path, tmp_path / "v7.parquet", db="v7.duckdb")
    assert outcome.status == "refused" and "summary file format b'7' is not known" in outcome.message


def test_logger_refuses_bad_settings_and_negative_expert_ids(tmp_path):
    with pytest.raises(ValueError, match=r"token_sample: expected a share of tokens in \[0, 1\], got 2"):
        DriftLogger(tmp_path, "r", token_sample=2)
    d = make_step(B=3, T=4)
    d["sampler_experts"] = d["sampler_experts"].clone()
    d["sampler_experts"][1, 2, 0, 1] = -1
    with pytest.raises(ValueError, match=r"sampler_experts\[1, 2, 0\] = \[\d+, -1\]: expert ids are 0-based"):
        DriftLogger(tmp_path, "r").log_step(0, **d)
    assert not list((tmp_path / "r").glob("*.parquet"))  # nothing written
    d = make_step(B=3, T=4)
    d["trainer_logprobs"] = torch.zeros(3, 4, dtype=torch.float32) + 0.5
    with pytest.raises(ValueError, match=r"trainer_logprobs\[0, 0\] = 0.5: a log-probability must be finite"):
        DriftLogger(tmp_path, "r", token_sample=0.0).log_step(0, **d)
