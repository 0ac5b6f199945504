"""Content hashes of large files computed while they load (load.HashInThread) or before (hashing.hash_ahead, which
the command line starts): the recorded sha256 is the file's, a second load of the same content is still skipped, a
file of a loaded file's size is hashed first, and a refusal leaves no row behind. "Large" is lowered to a few kB
here (ALONE_BYTES) so that small files take that path."""
from __future__ import annotations

import hashlib
from pathlib import Path

import polars as pl
import pytest

from analysis.ingest import batches, hashing, ingest_paths, load
from analysis.store import Store

from helpers.data import metrics_make_tokens


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
    real = hashing.content_hash
    monkeypatch.setattr(hashing, "content_hash", lambda paths, stop=None: (real(paths, stop)[0], 1))
    store = Store(tmp_path / "db.duckdb")
    out = ingest_paths(store, [a])
    assert [o.status for o in out] == ["refused"], out
    assert "changed while it was loaded" in out[0].message and "once it is completely written" in out[0].message
    assert store.scalar("SELECT count(*) FROM files") == 0 and store.scalar("SELECT count(*) FROM tokens") == 0


# -- hashes started ahead by the command line (hashing.hash_ahead) ---------------------------------------------

@pytest.fixture
def no_ahead_left():
    yield
    hashing.cancel_ahead()


def test_content_hash_over_many_chunks_and_its_stop(tmp_path, monkeypatch):
    """The digest over chunks of CHUNK bytes equals hashlib's over the whole file; a set `stop` gives up after
    the first chunk."""
    monkeypatch.setattr(hashing, "CHUNK", 1000)
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(bytes(range(256)) * 17)  # 4,352 bytes: four whole chunks and a part
    b.write_bytes(b"xyz" * 5)
    assert hashing.content_hash([a, b]) == (hashlib.sha256(a.read_bytes() + b.read_bytes()).hexdigest(), 4367)
    stop = __import__("threading").Event()
    stop.set()
    assert hashing.content_hash([a], stop)[1] == 1000


def test_a_hash_started_ahead_is_the_one_the_load_records(tmp_path, monkeypatch, small_alone, no_ahead_left):
    """hash_ahead hashes the large file before the load; the load takes that hash (no second hash of the file)
    and records it."""
    a = write(tmp_path / "a.parquet", 4)
    hashing.hash_ahead([a, tmp_path], min_bytes=4096)  # a folder is left to the load
    monkeypatch.setattr(load, "content_hash", lambda paths, stop=None: pytest.fail("hashed again"))
    store = Store(tmp_path / "db.duckdb")
    assert [o.status for o in ingest_paths(store, [a])] == ["loaded"]
    assert small_alone == []  # no HashInThread of the load's own
    assert store.rows("SELECT sha256, size FROM files") == [(sha(a), a.stat().st_size)]


def test_a_file_rewritten_after_its_hash_started_is_hashed_again(tmp_path, small_alone, no_ahead_left):
    a = write(tmp_path / "a.parquet", 5)
    hashing.hash_ahead([a], min_bytes=4096)
    write(a, 6)  # another content (and time) before the load starts
    assert hashing.take_ahead([a]) is None
    store = Store(tmp_path / "db.duckdb")
    assert [o.status for o in ingest_paths(store, [a])] == ["loaded"]
    assert small_alone == [["a.parquet"]]
    assert store.rows("SELECT sha256 FROM files") == [(sha(a),)]


def test_hashes_nobody_takes_are_stopped(tmp_path, no_ahead_left):
    files = [write(tmp_path / f"{i}.parquet", i) for i in range(3)]
    hashing.hash_ahead(files, min_bytes=0)
    hashing.cancel_ahead()
    assert hashing.take_ahead([files[0]]) is None
    assert not [t for t in __import__("threading").enumerate() if t.name == "ingest-hash"]


@pytest.mark.slow  # a process of its own
def test_the_command_line_starts_the_hash_before_its_heavy_imports(tmp_path):
    """hashing.py needs only the standard library, and `python -m analysis ingest` calls hash_ahead before it
    imports DuckDB, numba or pyarrow: the hash runs while they load."""
    import subprocess
    import sys
    import textwrap
    f = write(tmp_path / "a.parquet", 7)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, '.')
        import analysis.ingest.hashing as hashing
        assert not {{'duckdb', 'numba', 'pyarrow', 'numpy', 'polars'}} & set(sys.modules), sys.modules.keys()
        seen = []
        real = hashing.hash_ahead
        def spy(paths):
            seen.append(sorted(m for m in ('duckdb', 'numba', 'pyarrow') if m in sys.modules))
            real(paths, min_bytes=0)
        hashing.hash_ahead = spy
        from analysis.__main__ import main
        assert main(['ingest', {str(f)!r}, '--db', {str(tmp_path / 'db.duckdb')!r}]) == 0
        assert seen == [[]], seen
        """)
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Store(tmp_path / "db.duckdb", read_only=True).rows("SELECT sha256 FROM files") == [(sha(f),)]
