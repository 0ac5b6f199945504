"""Ingest's token summaries computed while a file streams (analysis/ingest/summary_stream.py) equal those of the SQL
over the stored rows (compute.py) at rel 1e-12: a step split across batches and across files, sequences whose
tokens span batches, lag ranges that widen from batch to batch, null entropy and versions; and a file the stream
cannot handle (not ordered by step, too many sequences in a step) falls back to the SQL with the same rows."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from analysis.ingest import ingest_paths, load, summarise
from analysis.ingest import summary_stream as stream_summaries
from analysis.ingest.limits import Limits
from analysis.store import Store

from helpers.ingest import NARROW
from helpers.logger import assert_same_rows, merged

TABLES = stream_summaries.TOKEN_TABLES
SMALL = Limits(batch_rows=37)  # steps and sequences split over many batches


def tokens(steps=(1, 2, 3), n_seq=6, seed=5, samples_from=0) -> dict[int, pa.Table]:
    """Per step, shuffled long-format tokens with null entropy and versions and lags growing with the step."""
    rng = np.random.default_rng(seed)
    out = {}
    for step in steps:
        lengths = rng.integers(1, 30, n_seq)
        sample = np.repeat(samples_from + rng.choice(1000, n_seq, replace=False), lengths)
        pos = np.concatenate([np.arange(k) for k in lengths])
        n = len(sample)
        s = -rng.exponential(1.5, n)
        t = np.minimum(s + rng.normal(0, 0.2, n), 0.0)
        entropy = rng.exponential(1.0, n)
        sv = rng.integers(10 - step, 11, n)  # lags 0 .. step, the first batches see fewer
        tv = np.full(n, 10, np.int64)
        tv[rng.random(n) < 0.1] = 8  # lag −2 .. : below the range seen so far
        order = rng.permutation(n)
        out[step] = pa.table({
            "run": pa.array(["r"] * n), "step": pa.array(np.full(n, step, np.int64)),
            "sample": pa.array(sample[order]), "pos": pa.array(pos[order].astype(np.int32)),
            "sampler_logprob": pa.array(s[order]), "trainer_logprob": pa.array(t[order]),
            "sampler_entropy": pa.array(entropy[order], mask=rng.random(n) < 0.2),
            "sampler_version": pa.array(sv[order], mask=rng.random(n) < 0.1),
            "trainer_version": pa.array(tv[order], mask=rng.random(n) < 0.05)})
    return out


def write(path, parts) -> str:
    pq.write_table(pa.concat_tables(parts), path)
    return str(path)


def ingest(db, paths, monkeypatch, streamed=True, limits=SMALL) -> dict[str, list[dict]]:
    """The token summaries of loading `paths`; streamed False: those of the SQL over the stored rows
    (summarise.add_tokens) in their place."""
    store = Store(db)
    assert {o.status for o in ingest_paths(store, paths, limits=limits)} == {"loaded"}
    if not streamed:
        with store.transaction() as w:
            files = [r[0] for r in w.execute("SELECT DISTINCT file_id FROM tokens ORDER BY file_id").fetchall()]
            for fid in files:
                for t in TABLES:
                    w.execute(f"DELETE FROM {t} WHERE file_id = ?", [fid])
                summarise.add_tokens(w, fid)
    return {t: merged(store, t) for t in TABLES}


def assert_same(got, want):
    for t in TABLES:
        assert want[t], t
        assert_same_rows(got[t], want[t], t)


def messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_step_split_across_batches_equals_sql(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    steps = tokens()
    f = write(tmp_path / "a.parquet", [steps[k] for k in sorted(steps)])
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "token summaries of 3 steps computed while streaming" in messages(caplog)
    want = ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False)
    assert_same(got, want)
    lags = {r["bucket"] for r in want["summary_bucket"] if r["dim"] == "lag"}
    assert min(lags) < 0 and max(lags) == 3 and {r["dim"] for r in got["summary_bucket"]} >= {"entropy", "lag"}


def test_step_split_across_two_files_equals_one_file(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    first, second = tokens(seed=1), tokens(steps=(3, 4), seed=2, samples_from=5000)  # step 3 in both files
    a = write(tmp_path / "a.parquet", [first[k] for k in (1, 2, 3)])
    b = write(tmp_path / "b.parquet", [second[k] for k in (3, 4)])
    got = ingest(tmp_path / "k.duckdb", [a, b], monkeypatch)
    assert messages(caplog).count("computed while streaming") == 2
    one = write(tmp_path / "one.parquet", [first[1], first[2], first[3], second[3], second[4]])
    assert_same(got, ingest(tmp_path / "s.duckdb", [one], monkeypatch, streamed=False))


def test_unordered_file_falls_back_to_sql(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    steps = tokens()
    f = write(tmp_path / "a.parquet", [steps[1], steps[2], steps[1].slice(0, 0), steps[3]])
    mixed = pa.concat_tables([steps[1].slice(0, 20), steps[2], steps[1].slice(20), steps[3]])  # step 1 comes back
    pq.write_table(mixed, f)
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "step 1 comes back after another step: not ordered by step" in messages(caplog)
    assert "computed while streaming" not in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False))


def test_too_many_sequences_falls_back_to_sql(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    monkeypatch.setattr(stream_summaries, "MAX_SEQUENCES", 4)
    steps = tokens()
    f = write(tmp_path / "a.parquet", [steps[k] for k in sorted(steps)])
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "has more than 4 sequences" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False))


def test_many_small_steps_fall_back_to_sql(tmp_path, monkeypatch, caplog):
    """Past SMALL_STEPS steps of fewer than SMALL_STEP_TOKENS tokens on average the stream gives way to the SQL
    (faster there), with the same rows; steps above the average keep streaming."""
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    monkeypatch.setattr(stream_summaries, "SMALL_STEPS", 5)
    steps = tokens(steps=range(1, 9))
    n = sum(t.num_rows for t in steps.values())
    f = write(tmp_path / "a.parquet", [steps[k] for k in sorted(steps)])
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "5 steps of" in messages(caplog) and "the SQL summarises many small steps faster" in messages(caplog)
    assert "computed while streaming" not in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False))
    caplog.clear()
    monkeypatch.setattr(stream_summaries, "SMALL_STEP_TOKENS", n // 8 - 60)  # the average is above it
    assert_same(ingest(tmp_path / "k2.duckdb", [f], monkeypatch), got)
    assert "token summaries of 8 steps computed while streaming" in messages(caplog)


def test_versions_and_entropy_absent(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    steps = tokens()
    plain = pa.concat_tables([steps[k] for k in sorted(steps)]).drop_columns(
        ["sampler_entropy", "sampler_version", "trainer_version"])
    f = tmp_path / "a.parquet"
    pq.write_table(plain, f)
    got = ingest(tmp_path / "k.duckdb", [str(f)], monkeypatch)
    assert "computed while streaming" in messages(caplog)
    want = ingest(tmp_path / "s.duckdb", [str(f)], monkeypatch, streamed=False)
    assert_same(got, want)
    assert {r["dim"] for r in got["summary_bucket"]} == {"prob", "position"}


def test_versions_far_apart_fall_back_to_sql(tmp_path, monkeypatch, caplog):
    """Versions that are not small counters (timestamps, say) would need a lag bucket per version in between."""
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    steps = tokens()
    table = pa.concat_tables([steps[k] for k in sorted(steps)])
    n = table.num_rows
    far = np.where(np.arange(n) % 2 == 0, 0, 10_000_000).astype(np.int64)
    table = table.set_column(table.column_names.index("sampler_version"), "sampler_version", pa.array(far))
    f = tmp_path / "a.parquet"
    pq.write_table(table, f)
    got = ingest(tmp_path / "k.duckdb", [str(f)], monkeypatch)
    assert f"lags over more than {stream_summaries.MAX_LAGS} versions" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [str(f)], monkeypatch, streamed=False))


def all_large(monkeypatch) -> None:
    """Every file counts as large: read and checked in the load's read-ahead workers, its summary rows appended as
    they come."""
    monkeypatch.setattr(load, "ALONE_BYTES", 0)


def ingest_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ingest-") and t.is_alive()]


def test_a_large_files_summaries_equal_sql(tmp_path, monkeypatch, caplog):
    """A large file's summaries are computed in the worker that checks its batches: the same rows as the SQL, for
    an ordered file and for one the stream gives up on, and no thread of the load is left."""
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    all_large(monkeypatch)
    steps = tokens()
    f = write(tmp_path / "a.parquet", [steps[k] for k in sorted(steps)])
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "token summaries of 3 steps computed while streaming" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False))
    mixed = write(tmp_path / "m.parquet", [steps[1].slice(0, 20), steps[2], steps[1].slice(20), steps[3]])
    got = ingest(tmp_path / "k2.duckdb", [mixed], monkeypatch)
    assert "not ordered by step" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s2.duckdb", [mixed], monkeypatch, streamed=False))
    assert not ingest_threads()


def test_rows_appended_before_the_stream_gives_up_are_replaced_by_the_sql(tmp_path, monkeypatch, caplog):
    """A large file's finished steps are appended to the summary tables as they come (here every step at once,
    PENDING_ROWS 1); when a later step makes the stream give up, those rows are deleted and the SQL's take their
    place: no step is counted twice."""
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    all_large(monkeypatch)
    monkeypatch.setattr(stream_summaries, "PENDING_ROWS", 1)
    steps = tokens(steps=(1, 2, 3, 4))
    mixed = write(tmp_path / "m.parquet", [steps[1], steps[2], steps[3].slice(0, 20), steps[4], steps[3].slice(20)])
    got = ingest(tmp_path / "k.duckdb", [mixed], monkeypatch)
    assert "step 3 comes back after another step: not ordered by step" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [mixed], monkeypatch, streamed=False))
    assert sorted(r["step"] for r in got["summary_step"]) == [1, 2, 3, 4]


def test_a_refused_large_file_leaves_no_summary_row_and_no_thread(tmp_path, monkeypatch):
    all_large(monkeypatch)
    steps = tokens()
    bad = pa.concat_tables([steps[k] for k in sorted(steps)])
    s = bad.column("sampler_logprob").to_numpy().copy()
    s[-3] = 0.25  # a log-probability above 0, in the last batch: refused after most batches were summarised
    bad = bad.set_column(bad.column_names.index("sampler_logprob"), "sampler_logprob", pa.array(s))
    f = tmp_path / "bad.parquet"
    pq.write_table(bad, f)
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [str(f)], limits=SMALL)
    assert out[0].status == "refused" and "must be <= 0" in out[0].message
    assert not ingest_threads()
    assert store.scalar("SELECT count(*) FROM summary_step") == 0


def test_rows_of_many_steps_and_runs_made_arrow_together_equal_sql(tmp_path, monkeypatch, caplog):
    """Finished steps' rows wait as numpy columns and become Arrow tables several steps at once (PENDING_ROWS):
    flushed mid-file, at the end, and with two runs in one flush, they are still the SQL's rows."""
    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    monkeypatch.setattr(stream_summaries, "PENDING_ROWS", 60)  # a flush every few steps, and one at the end
    a, b = tokens(steps=(1, 2, 3, 4, 5), seed=7), tokens(steps=(1, 2, 3), seed=8)
    b = {k: v.set_column(0, "run", pa.array(["s"] * v.num_rows)) for k, v in b.items()}
    f = write(tmp_path / "a.parquet", [a[k] for k in sorted(a)] + [b[k] for k in sorted(b)])
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "token summaries of 8 steps computed while streaming" in messages(caplog)
    want = ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False)
    assert_same(got, want)
    assert {r["run"] for r in got["summary_seq"]} == {"r", "s"}


def test_a_json_lines_file_whose_later_lines_add_columns_streams_the_same_rows(tmp_path, monkeypatch, caplog):
    """JSON Lines is read in chunks of lines, each its own table: where the first lines carry no entropy or
    versions and later ones do, the batches' columns differ (they went to the narrow and the full token table,
    and joining them into one append once failed as an internal error). The stored tokens read back as written,
    and the streamed summaries equal the SQL's."""
    import json

    caplog.set_level(logging.INFO, logger="analysis.ingest.load")
    steps = tokens()
    records = [row for k in sorted(steps) for row in steps[k].to_pylist()]
    cut = 100  # the first 100 lines: only the required columns
    for row in records[:cut]:
        for c in ("sampler_entropy", "sampler_version", "trainer_version"):
            del row[c]
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    got = ingest(tmp_path / "k.duckdb", [f], monkeypatch)
    assert "token summaries of 3 steps computed while streaming" in messages(caplog)
    assert_same(got, ingest(tmp_path / "s.duckdb", [f], monkeypatch, streamed=False))
    store = Store(tmp_path / "k.duckdb", read_only=True)
    cols = ("step", "sample", "pos", "sampler_logprob", "trainer_logprob", "sampler_entropy", "sampler_version",
            "trainer_version")
    assert store.rows(f"SELECT {', '.join(cols)} FROM tokens ORDER BY ALL") \
        == sorted(tuple(r.get(c) for c in cols) for r in records)
    # the batches wholly within the first lines went to the narrow table; the third holds lines of both kinds,
    # which the JSON reader gives one table with nulls: it went to the full one, as did the rest
    assert store.scalar(f"SELECT count(*) FROM {NARROW}") == (cut // SMALL.batch_rows) * SMALL.batch_rows > 0
