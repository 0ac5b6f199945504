"""Bounded ingest: streamed INSERTs cut by table, columns and the side-buffer cap lose no row; errors raised
while DuckDB reads a stream still refuse the whole file; per-batch expert-load counts sum exactly; progress."""
from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import ingest_paths, stream
from analysis.ingest.errors import BadValue
from analysis.ingest.limits import Limits
from analysis.ingest.progress import TerminalProgress
from analysis.store import Store

from helpers.ingest import check_derived, make_logs


def _tokens(lo: int, n: int, with_id: bool = False) -> pa.Table:
    cols = {"run": ["r"] * n, "step": pa.array(range(lo, lo + n), pa.int64()), "sample": pa.array([0] * n, pa.int64()),
            "pos": pa.array([0] * n, pa.int32()), "sampler_logprob": [-1.0] * n, "trainer_logprob": [-1.5] * n}
    if with_id:
        cols["token_id"] = pa.array(range(n), pa.int32())
    return pa.table(cols)


def _side(lo: int, n: int) -> pa.Table:
    return pa.table({"v": pa.array(range(lo, lo + n), pa.int64())})


def _items(w, fail_at: int | None = None):
    """A generator (as the loader's prefetch is: closing it early would lose rows) of tokens batches (with run
    codes of the Writer `w`, as the loader hands them over), a change of columns, sequences rows, and side rows
    for two staging tables."""
    plan = [("tokens", _tokens(0, 7)), ("_staged_a", _side(0, 3)), ("tokens", _tokens(7, 5)),
            ("_staged_b", _side(100, 4)), ("tokens", _tokens(12, 6, with_id=True)), ("_staged_a", _side(3, 5)),
            ("sequences", pa.table({"run": ["r"], "step": pa.array([0], pa.int64()),
                                    "sample": pa.array([0], pa.int64())})),
            ("tokens", _tokens(18, 4)), ("_staged_a", _side(8, 2)), ("tokens", _tokens(22, 9))]
    for i, item in enumerate(plan):
        if i == fail_at:
            raise BadValue("f.parquet", "row 3", "log-probability must be finite, got nan", "fix it")
        yield item[0], w.coded(*item)


@pytest.mark.parametrize("cap", [1, 50, 10**9])  # bytes: side rows are 8 bytes each, 16 to 40 per item
def test_streamed_inserts_keep_every_row_whatever_cuts_them(tmp_path, monkeypatch, cap):
    monkeypatch.setattr(stream, "SIDE_CAP_BYTES", cap)
    store = Store(tmp_path / "d.duckdb")
    rows = {"tokens": 0, "sequences": 0}
    seen = []
    with store.transaction() as w:
        stream.insert_items(w, _items(w), ("_staged_a", "_staged_b"), rows, 7, lambda t, n: seen.append((t, n)))
        staged_a = w.cur.execute("SELECT v FROM _staged_a ORDER BY v").fetchall()
        staged_b = w.cur.execute("SELECT v FROM _staged_b ORDER BY v").fetchall()
        w.drop_staged("_staged_a", "_staged_b")
    assert rows == {"tokens": 31, "sequences": 1}
    assert store.rows("SELECT step FROM tokens ORDER BY step") == [(i,) for i in range(31)]
    assert store.rows("SELECT step, token_id FROM tokens WHERE token_id IS NOT NULL ORDER BY step") == \
        [(12 + i, i) for i in range(6)]
    assert store.rows("SELECT DISTINCT file_id FROM tokens UNION SELECT DISTINCT file_id FROM sequences") == [(7,)]
    assert [v for (v,) in staged_a] == list(range(10)) and [v for (v,) in staged_b] == list(range(100, 104))
    assert sum(n for t, n in seen if t == "tokens") == 31


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_an_error_while_duckdb_reads_the_stream_is_raised_and_rolls_back(tmp_path, fail_at):
    store = Store(tmp_path / "d.duckdb")
    with pytest.raises(BadValue, match="row 3.*must be finite"):
        with store.transaction() as w:
            stream.insert_items(w, _items(w, fail_at), ("_staged_a", "_staged_b"), {"tokens": 0, "sequences": 0}, 7)
    assert store.scalar("SELECT count(*) FROM tokens") == 0
    assert store.scalar("SELECT count(*) FROM sequences") == 0
    with store.transaction() as w:  # the staging tables went with the rolled-back transaction
        assert w.cur.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name LIKE '_staged%'").fetchall() \
            == [(0,)]


def test_expert_load_from_many_small_batches_is_summed_to_one_row_per_key(tmp_path):
    tokens, rows = make_logs(seed=3, steps=3, samples=4, length=5, layers=4, k=3, experts=16)
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "routing.parquet", tmp_path / "tokens.parquet"],
                       limits=Limits(batch_rows=7))  # 240 routing rows in 35 batches, most keys in several
    assert [o.status for o in out] == ["loaded", "loaded"]
    check_derived(store, rows)
    assert store.scalar("SELECT count(*) FROM (SELECT DISTINCT run, step, layer, expert FROM expert_load)") == \
        store.scalar("SELECT count(*) FROM expert_load")


def test_orphan_routing_found_across_batches(tmp_path):
    tokens, rows = make_logs(seed=4, steps=2, samples=3, length=4, layers=2)
    keep = [i for i, (s, b, p) in enumerate(zip(tokens["step"], tokens["sample"], tokens["pos"]))
            if (s, b, p) != (1, 2, 3)]  # the last token of all: its routing rows are orphans
    pq.write_table(pa.table({k: [v[i] for i in keep] for k, v in tokens.items()}), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"], limits=Limits(batch_rows=5))
    assert out[1].status == "refused"
    assert "routing row (run='r', step=1, sample=2, pos=3)" in out[1].message
    assert store.scalar("SELECT count(*) FROM routing") == 0 and store.scalar("SELECT count(*) FROM expert_load") == 0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_progress_draws_on_a_tty_only(tmp_path):
    n = 3000
    rng = np.random.default_rng(0)
    s = -rng.exponential(1.0, n)
    pq.write_table(pa.table({"run": ["r"] * n, "step": [0] * n, "sample": np.arange(n) // 100, "pos": np.arange(n) % 100,
                             "sampler_logprob": s, "trainer_logprob": s}), tmp_path / "t.parquet")
    for stream_, drawn in ((_Tty(), True), (io.StringIO(), False)):
        bar = TerminalProgress(stream_, delay=0, mininterval=0)
        totals = []
        ingest_paths(Store(tmp_path / f"{drawn}.duckdb"), [tmp_path / "t.parquet"], limits=Limits(batch_rows=1000),
                     progress=bar.file, on_rows=lambda done, total: (totals.append((done, total)), bar.rows(done, total)))
        bar.close()
        assert totals[-1] == (n, n) and [d for d, _ in totals] == sorted(d for d, _ in totals)
        text = stream_.getvalue()
        assert ("[1/1] t.parquet" in text and "3.00k/3.00k" in text) is drawn
        assert (text == "") is not drawn


@pytest.mark.parametrize("seed", range(5))
def test_whole_row_groups_cuts_first_one_group_then_whole_inserts_and_keeps_every_row(seed):
    """Items of two tables in random sizes, one change of columns: per table the rows come out in order and
    unchanged; the first append of a table is `first` rows, the others `size` rows, except the last one of the
    table and the one let go where the columns change."""
    from analysis.ingest.readahead import whole_row_groups
    rng = np.random.default_rng(seed)
    first, size = 3, 12
    items, sent = [], {"a": [], "b": []}
    switch = int(rng.integers(5, 30))
    for i in range(40):
        table = "a" if rng.random() < 0.7 else "b"
        n = int(rng.integers(1, 20))
        lo = len(sent[table])
        cols = {"v": pa.array(range(lo, lo + n), pa.int64())}
        if table == "a" and i >= switch:  # the columns change once
            cols["w"] = pa.array([0] * n, pa.int64())
        items.append((table, pa.table(cols)))
        sent[table] += list(range(lo, lo + n))
    out = list(whole_row_groups(iter(items), size=size, first=first))
    for table in ("a", "b"):
        mine = [d for t, d in out if t == table]
        assert [v for d in mine for v in d.column("v").to_pylist()] == sent[table]
        lengths = [d.num_rows for d in mine]
        assert lengths[0] == first or len(mine) == 1 or mine[0].schema != mine[1].schema
        cut = next((i for i in range(1, len(mine)) if mine[i].schema != mine[i - 1].schema), None)
        ends = {len(mine) - 1} | ({cut - 1} if cut is not None else set())
        assert all(n == size for i, n in enumerate(lengths[1:], 1) if i not in ends), lengths


@pytest.mark.parametrize("fault", ["value", "corrupt"])
def test_a_large_file_refused_part_way_leaves_nothing_and_no_thread(tmp_path, monkeypatch, fault):
    """A large file is read in a thread of its own ahead of its checks: a refusal in its last batches (a
    log-prob above 0, or bytes the Parquet reader cannot decode, raised in that thread) still refuses the file
    with its message, stores none of it, and stops every thread of the load."""
    import threading
    from analysis.ingest import load
    monkeypatch.setattr(load, "ALONE_BYTES", 0)
    n = 3000
    t = pa.table({"run": ["r"] * n, "step": pa.array(np.arange(n) // 500, pa.int64()),
                  "sample": pa.array((np.arange(n) // 50) % 10, pa.int64()), "pos": pa.array(np.arange(n) % 50, pa.int32()),
                  "sampler_logprob": -np.linspace(0.1, 3, n), "trainer_logprob": -np.linspace(0.1, 3, n) - 0.01})
    f = tmp_path / "t.parquet"
    if fault == "value":
        s = t.column("sampler_logprob").to_numpy().copy()
        s[-5] = 0.5
        t = t.set_column(t.column_names.index("sampler_logprob"), "sampler_logprob", pa.array(s))
        pq.write_table(t, f, row_group_size=200)
    else:
        pq.write_table(t, f, row_group_size=200, compression="snappy")
        meta = pq.ParquetFile(f).metadata
        col = meta.row_group(meta.num_row_groups - 2).column(4)  # a late row group's sampler_logprob pages
        data = bytearray(f.read_bytes())
        start = col.data_page_offset
        data[start + 20:start + 60] = b"\xff" * 40
        f.write_bytes(bytes(data))
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [f], limits=Limits(batch_rows=100))
    assert out[0].status == "refused", out[0].line()
    assert ("must be <= 0" if fault == "value" else "cannot be read") in out[0].message
    assert store.scalar("SELECT count(*) FROM tokens") == 0 and store.scalar("SELECT count(*) FROM files") == 0
    assert not [th.name for th in threading.enumerate() if th.name.startswith("ingest-") and th.is_alive()]
