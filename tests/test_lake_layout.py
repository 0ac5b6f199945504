"""The lake layout: writing (hidden temporary name, then rename), listing, what is passed over, and one
partition's task (validation by the ingest's checks, partition columns from the path, non-local files)."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from analysis.lake import task
from analysis.lake.layout import list_partitions, write_file

TOKENS = pa.table({"run": ["r"] * 3, "step": pa.array([4] * 3, pa.int64()), "sample": pa.array([0, 0, 1], pa.int64()),
                   "pos": pa.array([0, 1, 0], pa.int32()), "sampler_logprob": [-0.5, -1.0, -0.1],
                   "trainer_logprob": [-0.4, -1.2, -0.1]})


def test_write_file_renames_into_place_and_lists(tmp_path):
    path = write_file(str(tmp_path), "r", 4, "tokens", 2, TOKENS)
    assert path == f"{tmp_path}/run=r/step=4/tokens-r00002.parquet"
    assert sorted(p.name for p in (tmp_path / "run=r" / "step=4").iterdir()) == ["tokens-r00002.parquet"]
    assert pq.read_table(path).equals(TOKENS)
    write_file(str(tmp_path), "r", 12, "tokens", 0, TOKENS.slice(0, 1))
    listing = list_partitions(str(tmp_path))
    assert [(p.run, p.step, len(p.files)) for p in listing.partitions] == [("r", 4, 1), ("r", 12, 1)]
    assert listing.problems == []
    with pytest.raises(ValueError, match="kind"):
        write_file(str(tmp_path), "r", 4, "summary", 0, TOKENS)


def test_listing_passes_over_hidden_and_reports_foreign_folders(tmp_path):
    write_file(str(tmp_path), "r", 1, "tokens", 0, TOKENS)
    step = tmp_path / "run=r" / "step=1"
    (step / ".tokens-r00001.parquet.tmp").write_bytes(b"half a file")
    (step / "_SUCCESS").write_bytes(b"")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("not a partition")
    (tmp_path / "run=r" / "step=x").mkdir()
    pq.write_table(TOKENS, tmp_path / "run=r" / "step=x" / "part-0.parquet")
    (tmp_path / "run=r" / "step=2" / "kind=tokens").mkdir(parents=True)  # one level too deep
    pq.write_table(TOKENS, tmp_path / "run=r" / "step=2" / "kind=tokens" / "part-0.parquet")
    (tmp_path / "run=my%20run" / "step=0").mkdir(parents=True)
    pq.write_table(TOKENS, tmp_path / "run=my%20run" / "step=0" / "part-0.parquet")
    (tmp_path / "run=r" / "run.json").write_text('{"run": "r", "config": {"dtype": "bf16"}}')
    listing = list_partitions(str(tmp_path))
    assert [(p.run, p.step, [f.rsplit("/", 1)[1] for f in p.files]) for p in listing.partitions] == [
        ("my run", 0, ["part-0.parquet"]), ("r", 1, ["tokens-r00000.parquet"])]
    assert listing.configs == {"r": {"dtype": "bf16"}}
    assert [p.split(": ")[0][len(str(tmp_path)) + 1:] for p in listing.problems] == [
        "notes", "run=r/step=2/kind=tokens", "run=r/step=x"]
    assert all("not in the lake layout" in p for p in listing.problems)
    assert [p.run for p in list_partitions(str(tmp_path), run="r").partitions] == ["r"]


def test_missing_lake_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        list_partitions(str(tmp_path / "nowhere"))


def _only_tokens(monkeypatch):
    """Summaries are checked by the summarize tests; here only the task's loading and refusals matter."""
    monkeypatch.setattr(task.partial, "summary_tables", lambda store: {})


def test_partition_columns_come_from_the_path(tmp_path, monkeypatch):
    _only_tokens(monkeypatch)
    write_file(str(tmp_path), "r", 4, "tokens", 0, TOKENS.drop_columns(["run", "step"]))
    part = list_partitions(str(tmp_path)).partitions[0]
    res = task.summarize_partition(str(tmp_path), part, token_sample=1.0)
    assert res.refused is None and res.n_tokens == 3
    kept = res.sample["tokens"]
    assert set(kept.column("run").to_pylist()) == {"r"} and set(kept.column("step").to_pylist()) == {4}


def test_rows_of_another_step_are_refused_with_file_and_rule(tmp_path, monkeypatch):
    _only_tokens(monkeypatch)
    write_file(str(tmp_path), "r", 5, "tokens", 0, TOKENS)  # rows say step 4
    res = task.summarize_partition(str(tmp_path), list_partitions(str(tmp_path)).partitions[0])
    assert res.refused.startswith("run=r/step=5/tokens-r00000.parquet: row with run='r', step=4")
    assert "a partition holds only its own run and step" in res.refused


def test_schema_violation_names_file_row_and_rule(tmp_path, monkeypatch):
    _only_tokens(monkeypatch)
    bad = TOKENS.set_column(4, "sampler_logprob", pa.array([-0.5, float("nan"), -0.1]))
    write_file(str(tmp_path), "r", 4, "tokens", 0, bad)
    res = task.summarize_partition(str(tmp_path), list_partitions(str(tmp_path)).partitions[0])
    assert res.refused.startswith("run=r/step=4/tokens-r00000.parquet: row 2, column 'sampler_logprob': "
                                  "log-probability must be finite")


def test_keys_must_be_unique_across_a_partitions_files(tmp_path, monkeypatch):
    _only_tokens(monkeypatch)
    write_file(str(tmp_path), "r", 4, "tokens", 0, TOKENS)
    write_file(str(tmp_path), "r", 4, "tokens", 1, TOKENS.slice(2).set_column(4, "sampler_logprob", pa.array([-2.0])))
    res = task.summarize_partition(str(tmp_path), list_partitions(str(tmp_path)).partitions[0])
    assert "tokens-r00001.parquet" in res.refused and "duplicate key" in res.refused


def test_files_on_a_non_local_filesystem_are_copied_then_removed(tmp_path, monkeypatch):
    _only_tokens(monkeypatch)
    write_file(str(tmp_path / "lake"), "r", 4, "tokens", 0, TOKENS)
    part = list_partitions(str(tmp_path / "lake")).partitions[0]
    remote = pafs.SubTreeFileSystem("/", pafs.LocalFileSystem())  # any filesystem that is not local
    monkeypatch.setattr(task, "open_lake", lambda lake: (remote, str(tmp_path / "lake")))
    seen = []
    real = task.local_files

    def spy(lake, partition):
        cm = real(lake, partition)
        paths = cm.__enter__()
        seen.extend(paths)
        return _Exit(cm, paths)
    monkeypatch.setattr(task, "local_files", spy)
    res = task.summarize_partition(str(tmp_path / "lake"), part)
    assert res.refused is None and res.n_tokens == 3
    assert seen and all(str(tmp_path) not in str(p) for p in seen)  # read from a scratch copy
    assert not any(p.exists() for p in seen)  # and the copy is gone


class _Exit:
    def __init__(self, cm, value):
        self.cm, self.value = cm, value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return self.cm.__exit__(*exc)
