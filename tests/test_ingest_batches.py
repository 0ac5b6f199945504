"""Small files share transactions (analysis/ingest/batches.py) and the database still ends as one transaction
per file would leave it: a file refused in the middle of a shared transaction leaves nothing, the files before
it are loaded again, a failure at the end of a transaction is pinned on the right file; the range probe that
spares the duplicate and k checks never hides a clash."""
from __future__ import annotations

import shutil

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import batches, ingest_paths, load
from analysis.record.logger import DriftLogger
from analysis.store import Store, Writer

from helpers.logger import make_step

FILE_TABLES = ("tokens", "routing", "sequences", "expert_load", "summary_step", "summary_seq", "summary_hist",
               "summary_bucket", "summary_layer", "summary_sample", "summary_skip")


def contents(store: Store, tables=FILE_TABLES) -> dict:
    """Every stored row, its file_id replaced by the file's name (ids are not reused after a rollback, so
    they differ between loads that end with the same rows)."""
    out = {"runs": store.rows("SELECT run, config FROM runs ORDER BY ALL"),
           "files": store.rows("SELECT name, sha256, size, format, run_override, rows FROM files ORDER BY ALL")}
    for t in tables:
        out[t] = store.rows(f"SELECT t.* EXCLUDE (file_id), f.name FROM {t} t JOIN files f USING (file_id) "
                            "ORDER BY ALL")
        assert store.scalar(f"SELECT count(*) FROM {t}") == len(out[t]), t  # no row of an unknown file
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Six DriftLogger steps with routing (a summary, a tokens and a routing file each: 18 small files)."""
    out = tmp_path_factory.mktemp("logs")
    logger = DriftLogger(out, "r", token_sample=0.5)
    for step in range(6):
        logger.log_step(step, **make_step(B=4, T=9, seed=step))
    return logger.dir


def one_per_transaction(monkeypatch):
    monkeypatch.setattr(batches, "ALONE_BYTES", -1)  # every file alone: the behaviour before batching


def test_batched_load_equals_one_transaction_per_file(tmp_path, logs, monkeypatch):
    calls = []
    batched = Store(tmp_path / "batched.duckdb")
    monkeypatch.setattr(batches, "BATCH_FILES", 7)  # three shared transactions
    out = ingest_paths(batched, [logs], progress=lambda i, n, name: calls.append((i, n, name)))
    assert [o.status for o in out] == ["loaded"] * 18
    assert calls == [(i, 18, o.name) for i, o in enumerate(out)] + [(18, 18, "")]
    one_per_transaction(monkeypatch)
    alone = Store(tmp_path / "alone.duckdb")
    assert [o.status for o in ingest_paths(alone, [logs])] == ["loaded"] * 18
    assert contents(batched) == contents(alone)
    assert batched.rows("SELECT file_id, name FROM files ORDER BY 1") == alone.rows("SELECT file_id, name FROM files "
                                                                                  "ORDER BY 1")


def bad_files(logs, folder):
    """The logs plus, among them, a tokens file with a NaN and a rewritten copy of step 1's token rows (other
    bytes, same keys: a duplicate of a file loaded earlier in the same transaction)."""
    shutil.copytree(logs, folder)
    tokens = pq.read_table(folder / "tokens-step000003.parquet")
    lp = tokens.column("sampler_logprob").to_pylist()
    lp[2] = float("nan")
    pq.write_table(tokens.set_column(tokens.column_names.index("sampler_logprob"), "sampler_logprob",
                                     pa.array(lp, pa.float64())), folder / "summary-step000003-nan.parquet")
    pq.write_table(pq.read_table(folder / "tokens-step000001.parquet"), folder / "tokens-step000001_again.parquet",
                   compression="none")
    return folder


def test_a_refusal_inside_a_shared_transaction_leaves_nothing_and_the_others_load(tmp_path, logs, monkeypatch):
    folder = bad_files(logs, tmp_path / "r")
    calls = []
    store = Store(tmp_path / "batched.duckdb")
    out = {o.name: o for o in ingest_paths(store, [folder], progress=lambda i, n, name: calls.append(i))}
    nan, again = out.pop("r/summary-step000003-nan.parquet"), out.pop("r/tokens-step000001_again.parquet")
    assert nan.status == "refused" and nan.message.startswith(
        "r/summary-step000003-nan.parquet: row 3, column 'sampler_logprob': log-probability must be finite")
    assert again.status == "refused" and "is already loaded from r/tokens-step000001.parquet" in again.message
    assert [o.status for o in out.values()] == ["loaded"] * 18
    assert calls == list(range(20)) + [20]  # the files loaded again after a refusal are not announced twice
    # the same rows as loading only the good files, one transaction each
    one_per_transaction(monkeypatch)
    for f in ("summary-step000003-nan.parquet", "tokens-step000001_again.parquet"):
        (folder / f).unlink()
    good = Store(tmp_path / "good.duckdb")
    assert [o.status for o in ingest_paths(good, [folder])] == ["loaded"] * 18
    assert contents(store) == contents(good)


def test_the_same_content_twice_in_one_call_is_loaded_once(tmp_path, logs):
    shutil.copytree(logs, tmp_path / "a")
    shutil.copy(logs / "summary-step000002.parquet", tmp_path / "a" / "summary-step000002_copy.parquet")
    out = {o.name: o for o in ingest_paths(Store(tmp_path / "d.duckdb"), [tmp_path / "a"])}
    assert out["a/summary-step000002_copy.parquet"].line() == \
        "skipped a/summary-step000002_copy.parquet: same content already loaded"
    assert sum(o.status == "loaded" for o in out.values()) == 18


def test_a_failure_at_the_end_of_a_shared_transaction_is_pinned_on_its_file(tmp_path, logs, monkeypatch):
    """The summary rows of a transaction are inserted together at its end; when that INSERT fails, each file is
    loaded again alone, so only the file whose rows fail is reported, and the others load."""
    real = Writer.insert_arrow

    def insert_arrow(self, table, data):
        if table == "summary_step" and 4 in data.column("step").to_pylist():
            raise duckdb.IOException("disk full")
        return real(self, table, data)

    monkeypatch.setattr(Writer, "insert_arrow", insert_arrow)
    store = Store(tmp_path / "d.duckdb")
    out = {o.name: o for o in ingest_paths(store, [logs])}
    failed = out.pop(f"{logs.name}/summary-step000004.parquet")
    assert failed.status == "error" and "(IOException)" in failed.message
    assert [o.status for o in out.values()] == ["loaded"] * 17
    assert store.rows("SELECT DISTINCT step FROM summary_seq ORDER BY 1") == [(0,), (1,), (2,), (3,), (5,)]
    assert store.scalar("SELECT count(*) FROM files WHERE name LIKE '%summary-step000004%'") == 0


def routing_file(path, step: int, positions: range, k: int, run: str = "r") -> None:
    rows = [{"run": run, "step": step, "sample": 0, "pos": p, "layer": 0, "sampler_experts": list(range(k)),
             "trainer_experts": list(range(k))} for p in positions]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_range_probe_keeps_the_k_and_duplicate_checks_across_files(tmp_path):
    tokens = {"run": ["r"] * 8 + ["s"] * 4, "step": [0] * 4 + [1] * 4 + [0] * 4, "sample": [0] * 12,
              "pos": list(range(4)) * 3, "sampler_logprob": [-0.5] * 12, "trainer_logprob": [-0.6] * 12}
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    routing_file(tmp_path / "a.parquet", 0, range(0, 2), k=2)
    routing_file(tmp_path / "b.parquet", 0, range(2, 4), k=3)  # same (run, step, layer), other k: refused
    routing_file(tmp_path / "c.parquet", 1, range(0, 4), k=3)  # another step may have another k
    routing_file(tmp_path / "d.parquet", 0, range(0, 4), k=3, run="s")  # same step, other run: no clash
    routing_file(tmp_path / "e.parquet", 0, range(1, 2), k=2)  # a key of a.parquet again
    store = Store(tmp_path / "d.duckdb")
    out = {o.name: o for o in ingest_paths(store, [tmp_path / n for n in
                                                  ("tokens.parquet", "a.parquet", "b.parquet", "c.parquet",
                                                   "d.parquet", "e.parquet")])}
    assert {n: o.status for n, o in out.items()} == {"tokens.parquet": "loaded", "a.parquet": "loaded",
                                                     "b.parquet": "refused", "c.parquet": "loaded",
                                                     "d.parquet": "loaded", "e.parquet": "refused"}
    assert out["b.parquet"].message == ("b.parquet: run 'r', step 0, layer 0: top-k has 3 experts here but 2 in "
                                        "rows already loaded (every routing row of a layer needs the same k)")
    assert "routing key (run='r', step=0, sample=0, pos=1, layer=0): duplicate key: this key is already loaded " \
           "from a.parquet" in out["e.parquet"].message
    assert store.rows("SELECT run, step, count(*), min(k), max(k) FROM routing GROUP BY ALL ORDER BY ALL") == \
        [("r", 0, 2, 2, 2), ("r", 1, 4, 3, 3), ("s", 0, 4, 3, 3)]


def test_plan_cuts_groups_by_files_bytes_and_large_files(tmp_path, monkeypatch):
    monkeypatch.setattr(batches, "ALONE_BYTES", 100)
    monkeypatch.setattr(batches, "BATCH_BYTES", 250)
    monkeypatch.setattr(batches, "BATCH_FILES", 3)

    class U:
        def __init__(self, n):
            self.paths = [tmp_path / f"f{n}_{len(list(tmp_path.iterdir()))}"]
            self.paths[0].write_bytes(b"x" * n)

    sizes = [10, 10, 10, 10, 150, 90, 90, 90, 10, 200]
    assert batches.plan([U(n) for n in sizes]) == [[0, 1, 2], [3], [4], [5, 6], [7, 8], [9]]


def test_runs_keep_the_order_their_files_were_loaded_in(tmp_path):
    """Runs are listed by creation time, which is their transaction's start: a file that creates a run ends its
    shared transaction, so runs met in one call are still listed in load order, not by name."""
    for i, run in enumerate(("zeta", "alpha", "mid", "alpha")):
        pq.write_table(pa.table({"run": [run], "step": [i], "sample": [0], "pos": [0], "sampler_logprob": [-0.5],
                                 "trainer_logprob": [-0.6]}), tmp_path / f"{i}.parquet")
    store = Store(tmp_path / "d.duckdb")
    assert [o.status for o in ingest_paths(store, [tmp_path])] == ["loaded"] * 4
    assert store.run_names() == ["zeta", "alpha", "mid"]


def test_small_files_summary_rows_join_their_transactions_end(tmp_path, logs, monkeypatch):
    """Token files that ingest summarises itself (the logs without DriftLogger's summarised mark): a small file's
    summary rows wait for its transaction's end (Transaction.append), a large one's go through staging tables.
    Both give the same rows, with a refused file in the middle of a shared transaction too."""
    folder = tmp_path / "plain"
    folder.mkdir()
    for f in sorted(logs.glob("*.parquet")):
        if f.name.startswith(("tokens-", "routing-")):
            pq.write_table(pq.read_table(f).replace_schema_metadata({}), folder / f.name)
    tokens = pq.read_table(folder / "tokens-step000003.parquet")
    lp = tokens.column("sampler_logprob").to_pylist()
    lp[1] = float("nan")
    bad = folder / "tokens-step000003-nan.parquet"
    pq.write_table(tokens.set_column(tokens.column_names.index("sampler_logprob"), "sampler_logprob",
                                     pa.array(lp, pa.float64())), bad)
    held = Store(tmp_path / "held.duckdb")
    out = {o.name: o.status for o in ingest_paths(held, [folder])}
    assert out.pop("plain/tokens-step000003-nan.parquet") == "refused"
    assert list(out.values()) == ["loaded"] * 12
    assert held.scalar("SELECT count(*) FROM summary_seq_band") > 0
    bad.unlink()
    monkeypatch.setattr(load, "ALONE_BYTES", -1)  # every file "large": summary rows staged as they come
    staged = Store(tmp_path / "staged.duckdb")
    assert [o.status for o in ingest_paths(staged, [folder])] == ["loaded"] * 12
    tables = FILE_TABLES + ("summary_seq_band", "summary_bucket_band")
    assert contents(held, tables) == contents(staged, tables)
