"""Content hashes of large files computed while they load (load.HashInThread): the recorded sha256 is the file's,
a second load of the same content is still skipped, a file of a loaded file's size is hashed first, and a refusal
leaves no row behind. "Large" is lowered to a few kB here (ALONE_BYTES) so that small files take that path."""
from __future__ import annotations

import hashlib

import polars as pl
import pytest

from analysis.ingest import batches, ingest_paths, load
from analysis.store import Store
from conftest import metrics_make_tokens


@pytest.fixture
def small_alone(monkeypatch):
    monkeypatch.setattr(batches, "ALONE_BYTES", 4096)
    monkeypatch.setattr(load, "ALONE_BYTES", 4096)
    calls = []
    real = load.HashInThread

    class Spy(real):
        def __init__(self, paths):
            calls.append([p.name for p in paths])
            super().__init__(paths)
    monkeypatch.setattr(load, "HashInThread", Spy)
    return calls


def write(path, seed: int):
    metrics_make_tokens(seed=seed, runs=("h",), steps=(0, 1), n_seq=6, optional=False).write_parquet(path)
    return path


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_hash_while_loading_records_the_files_hash_and_skips_a_repeat(tmp_path, small_alone):
    a = write(tmp_path / "a.parquet", 1)
    assert a.stat().st_size > 4096
    store = Store(tmp_path / "db.duckdb")
    assert [o.status for o in ingest_paths(store, [a])] == ["loaded"]
    assert small_alone == [["a.parquet"]]  # no loaded file had its size: hashed in the thread
    assert store.rows("SELECT name, sha256, size FROM files") == [("a.parquet", sha(a), a.stat().st_size)]
    copy = tmp_path / "copy.parquet"
    copy.write_bytes(a.read_bytes())
    out = ingest_paths(store, [copy])
    assert [o.status for o in out] == ["skipped"] and "same content" in out[0].message
    assert small_alone == [["a.parquet"]]  # a loaded file has this size: hashed first, then skipped


def test_a_file_of_a_loaded_size_with_other_content_loads(tmp_path, small_alone):
    """Two CSV files of the same byte size that differ in one log-prob digit: the second is hashed before it
    loads (a loaded file has its size), and loads (its content differs)."""
    tokens = metrics_make_tokens(seed=1, runs=("h",), steps=(0, 1), n_seq=6, optional=False)
    lines = ["run,step,sample,pos,sampler_logprob,trainer_logprob"] + [
        f"{r},{st},{q},{pos},{s:.6f},{t:.6f}" for r, st, q, pos, s, t in
        tokens.select("run", "step", "sample", "pos", "sampler_logprob", "trainer_logprob").iter_rows()]
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("\n".join(lines) + "\n")
    first = lines[1].rsplit(",", 1)
    lines[1] = first[0] + "," + (first[1][:-1] + ("1" if first[1][-1] != "1" else "2"))
    b.write_text("\n".join(lines) + "\n")
    assert a.stat().st_size == b.stat().st_size > 4096 and sha(a) != sha(b)
    store = Store(tmp_path / "db.duckdb")
    assert [o.status for o in ingest_paths(store, [a])] == ["loaded"]
    assert [o.status for o in ingest_paths(store, [b], run="h2")] == ["loaded"]
    assert small_alone == [["a.csv"]]  # b: hashed first
    assert sorted(store.rows("SELECT sha256 FROM files")) == sorted([(sha(a),), (sha(b),)])


def test_a_refused_large_file_leaves_nothing_and_stops_the_hash(tmp_path, small_alone):
    tokens = metrics_make_tokens(seed=2, runs=("h",), steps=(0, 1), n_seq=6, optional=False)
    bad = tokens.with_columns(sampler_logprob=pl.when(pl.int_range(pl.len()) == 50).then(float("nan"))
                              .otherwise(pl.col("sampler_logprob")))
    bad.write_parquet(tmp_path / "bad.parquet")
    store = Store(tmp_path / "db.duckdb")
    out = ingest_paths(store, [tmp_path / "bad.parquet"])
    assert [o.status for o in out] == ["refused"] and "finite" in out[0].message
    assert small_alone == [["bad.parquet"]]
    assert store.scalar("SELECT count(*) FROM files") == 0 and store.scalar("SELECT count(*) FROM tokens") == 0
    assert not [t for t in __import__("threading").enumerate() if t.name == "ingest-hash"]


def test_a_file_that_changes_while_it_loads_is_refused(tmp_path, small_alone, monkeypatch):
    """The hash thread reads more (or fewer) bytes than the file had when its load started: the file was still
    being written; nothing of it stays."""
    a = write(tmp_path / "a.parquet", 3)
    real = load.content_hash
    monkeypatch.setattr(load, "content_hash", lambda paths, stop=None: (real(paths, stop)[0], 1))
    store = Store(tmp_path / "db.duckdb")
    out = ingest_paths(store, [a])
    assert [o.status for o in out] == ["refused"], out
    assert "changed while it was loaded" in out[0].message and "once it is completely written" in out[0].message
    assert store.scalar("SELECT count(*) FROM files") == 0 and store.scalar("SELECT count(*) FROM tokens") == 0
