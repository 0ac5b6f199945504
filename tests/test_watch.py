"""FolderWatcher in one process with a hand-driven clock: when a file is complete, what is never read, what is
reported once, and that the command stops cleanly on SIGTERM. The real writer and watcher processes are in
tests/test_watch_live.py."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from analysis.ingest.watch import FolderWatcher, followable, scan
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers.logger import step_arrays

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def token_rows(df_path: Path) -> pl.DataFrame:
    return pl.read_parquet(df_path).select("run", "step", "sample", "pos", "sampler_logprob", "trainer_logprob")


@pytest.fixture()
def watched(tmp_path):
    store = Store(tmp_path / "db.duckdb")
    clock = Clock()
    logs = tmp_path / "logs"
    logs.mkdir()
    w = FolderWatcher(store, [logs], settle=1.0, clock=clock)
    yield w, clock, logs, store
    store.close()


def stored_tokens(store: Store) -> pl.DataFrame:
    return store.sql("SELECT run, step, sample, pos, sampler_logprob, trainer_logprob FROM tokens "
                     "ORDER BY run, step, sample, pos")


def test_a_file_is_taken_only_after_it_kept_its_size_and_time_for_the_settle_time(watched):
    w, clock, logs, store = watched
    log = DriftLogger(logs, run="r")
    shard = log.log_step(0, *step_arrays(0))["tokens"]
    assert w.poll() == []  # first sight
    clock.t += 0.5
    assert w.poll() == []  # unchanged, but not for a full second yet
    clock.t += 0.5
    summary, outcome = sorted(w.poll(), key=lambda o: o.name)  # DriftLogger writes a step's summaries too
    assert summary.status == "loaded" and summary.name == "summary-step000000.parquet"
    assert outcome.status == "loaded" and outcome.runs == ["r"] and outcome.rows["tokens"] == 6
    assert outcome.line().startswith("loaded tokens-step000000.parquet [parquet]: 6 tokens rows")
    clock.t += 5
    assert w.poll() == []  # handled: not read again
    assert stored_tokens(store).equals(token_rows(shard))
    assert w.runs == {"r"}


def test_a_file_still_growing_is_never_read_half_written(watched):
    w, clock, logs, store = watched
    df = pl.DataFrame({"run": ["g"] * 6, "step": [0] * 6, "sample": [0] * 6, "pos": list(range(6)),
                       "sampler_logprob": [-0.5] * 6, "trainer_logprob": [-0.25] * 6})
    lines = df.write_ndjson().splitlines(keepends=True)
    path = logs / "grow.jsonl"
    with open(path, "w") as fp:
        for line in lines:  # each line lands before the previous state settled: the watcher never takes it
            fp.write(line)
            fp.flush()  # the size changes with each line
            assert w.poll() == []
            clock.t += 0.9
    assert w.poll() == []  # the last state is 0.9 s old
    clock.t += 0.1
    [outcome] = w.poll()
    assert outcome.status == "loaded" and outcome.rows["tokens"] == 6  # every row: the complete file


def test_hidden_temporary_and_database_names_are_never_read(watched, tmp_path):
    w, clock, logs, store = watched
    for name in (".tokens-step000001.parquet.tmp", "x.parquet.tmp", "drift.duckdb", "drift.duckdb.wal", "run.json",
                 "upload.part", "notes.jsonl~"):
        (logs / name).write_bytes(b"PAR1 garbage that would be refused as corrupt")
    hidden = logs / ".cache"
    hidden.mkdir()
    (hidden / "a.csv").write_text("run,step\n")
    assert scan([logs]) == {}
    for _ in range(3):
        assert w.poll() == []
        clock.t += 2
    assert followable("tokens-step000001.parquet") and not followable(".tokens-step000001.parquet.tmp")


def test_a_corrupt_file_is_reported_once_skipped_and_retried_only_when_it_changes(watched):
    w, clock, logs, store = watched
    bad = logs / "bad.parquet"
    bad.write_bytes(b"PAR1" + b"\0" * 40)  # a Parquet magic and no footer
    (logs / "notes.txt").write_text("a note that is no log: passed over silently, as a folder ingest does\n")
    DriftLogger(logs, run="r").log_step(0, *step_arrays(0))
    w.poll()
    clock.t += 1
    outcomes = w.poll()
    assert sorted(o.status for o in outcomes) == ["loaded", "loaded", "refused"]  # summary and tokens files
    refused = next(o for o in outcomes if o.status == "refused")
    assert refused.line().startswith("refused bad.parquet: ") and "corrupt" in refused.line()
    for _ in range(3):  # not re-reported on every poll
        clock.t += 1
        assert w.poll() == []
    assert store.scalar("SELECT count(*) FROM tokens") == 6
    bad.write_bytes(b"PAR1" + b"\1" * 41)  # changed: considered again (and refused again, once)
    w.poll()
    clock.t += 1
    assert [o.status for o in w.poll()] == ["refused"]


def test_routing_that_lands_before_its_tokens_is_loaded_once_they_come(watched, tmp_path):
    w, clock, logs, store = watched
    staging = tmp_path / "staging"  # a step written elsewhere, moved into the folder file by file
    rng = np.random.default_rng(7)
    order = rng.random((2, 3, 2, 8)).argsort(-1)  # distinct experts per top-k
    paths = DriftLogger(staging, run="r").log_step(0, *step_arrays(0), sampler_experts=order[..., :2],
                                                   trainer_experts=order[..., 1:3])
    assert {"tokens", "routing"} <= set(paths)
    paths["routing"].rename(logs / paths["routing"].name)  # routing first: its tokens are not loaded yet
    w.poll()
    clock.t += 1
    [early] = w.poll()
    assert early.status == "refused" and "no token with this" in early.message and "tried again" in early.message
    clock.t += 1
    assert w.poll() == []  # nothing new loaded: not retried, not re-reported
    for name in ("tokens", "summary"):
        if name in paths:
            paths[name].rename(logs / paths[name].name)
    w.poll()
    clock.t += 1
    outcomes = w.poll()
    assert all(o.status == "loaded" for o in outcomes), [o.line() for o in outcomes]
    assert outcomes[-1].name == paths["routing"].name and outcomes[-1].rows["routing"] == 2 * 3 * 2
    assert store.scalar("SELECT count(*) FROM routing") == 2 * 3 * 2
    clock.t += 1
    assert w.poll() == []  # loaded: never again


def test_a_restart_skips_what_was_loaded_and_loads_what_came_meanwhile(tmp_path):
    logs = tmp_path / "logs"
    db = tmp_path / "db.duckdb"
    log = DriftLogger(logs, run="r")
    log.log_step(0, *step_arrays(0))
    clock = Clock()
    with Store(db) as store:
        w = FolderWatcher(store, [logs], settle=0.0, clock=clock)
        assert w.poll() == []  # even with settle 0, two looks: the first only records the file
        assert [o.status for o in w.poll()] == ["loaded", "loaded"]  # the step's summary and tokens files
    log.log_step(1, *step_arrays(1))
    with Store(db) as store:
        w = FolderWatcher(store, [logs], settle=0.0, clock=clock)
        w.poll()
        outcomes = {o.name: o.status for o in w.poll()}
        assert outcomes == {"tokens-step000000.parquet": "skipped", "tokens-step000001.parquet": "loaded",
                            "summary-step000000.parquet": "skipped", "summary-step000001.parquet": "loaded"}
        got = stored_tokens(store)
    want = pl.concat([token_rows(logs / "r" / f"tokens-step00000{i}.parquet") for i in (0, 1)])
    assert got.equals(want)


def test_a_folder_that_does_not_exist_yet_is_followed_once_it_appears(tmp_path):
    with Store(tmp_path / "db.duckdb") as store:
        clock = Clock()
        w = FolderWatcher(store, [tmp_path / "later"], settle=0.0, clock=clock)
        assert w.missing_folders() == [tmp_path / "later"] and w.poll() == []
        DriftLogger(tmp_path / "later", run="r").log_step(0, *step_arrays(0))
        w.poll()
        assert [o.status for o in w.poll()] == ["loaded", "loaded"]  # the step's summary and tokens files


def test_the_command_stops_cleanly_on_sigterm_and_closes_the_database(tmp_path):
    logs = tmp_path / "logs"
    DriftLogger(logs, run="r").log_step(0, *step_arrays(0))
    db = tmp_path / "db.duckdb"
    proc = subprocess.Popen([sys.executable, "-m", "analysis", "watch", str(logs), "--db", str(db),
                             "--interval", "0.2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]  # blocks until the step's two files are loaded
        line = next(x for x in lines if x.startswith("loaded tokens"))  # (the other: its summary file)
        assert line.startswith("loaded tokens-step000000.parquet [parquet]: 6 tokens rows -> run r"), lines
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.strip().endswith("stopped")
    with Store(db, read_only=True) as store:  # the lock is released: another process can open it
        assert store.scalar("SELECT count(*) FROM tokens") == 6


def test_the_command_takes_folders_only(tmp_path, capsys):
    from analysis.__main__ import main
    f = tmp_path / "one.parquet"
    f.write_bytes(b"PAR1")
    assert main(["watch", str(f), "--db", str(tmp_path / "db.duckdb")]) == 2
    assert "watch follows folders; load single files with `ingest`" in capsys.readouterr().err


def test_the_live_status_counts_a_step_once_any_of_its_files_landed(tmp_path):
    """watch.last_files (the sidebar's "step N · last file ... ago"): a logger at token_sample=0 writes no token
    rows, and a step's summary file may land before its token file; both show the step, as the charts do."""
    import time

    from analysis.ingest import ingest_paths
    from analysis.ingest.watch import last_files

    full, sums = DriftLogger(tmp_path / "a", run="full"), DriftLogger(tmp_path / "b", run="sums", token_sample=0.0)
    paths = [p for step in range(3) for p in full.log_step(step, *step_arrays(step)).values()]
    paths += [p for step in range(5) for p in sums.log_step(step, *step_arrays(10 + step)).values()]
    paths.append(full.log_step(3, *step_arrays(3))["summary"])  # step 3's token file has not landed yet
    store = Store(tmp_path / "db.duckdb")
    assert all(o.status == "loaded" for o in ingest_paths(store, paths))
    before = time.time()
    got = last_files(store, ["full", "sums", "absent"])
    assert got["run"].to_list() == ["full", "sums"] and got["last_step"].to_list() == [3, 4]
    assert all(before - 60 < t <= before + 1 for t in got["last_file_at"].to_list())
    store.close()
