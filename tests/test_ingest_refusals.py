"""Every refusal rule: the exact message a user sees, and nothing of the refused file in the database."""
from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import Limits, ingest_paths
from analysis.store import Store

BAD = Path(__file__).parent / "data" / "bad"
SAMPLES = sorted(p for p in BAD.iterdir() if p.suffix not in (".expected", ".py"))


def snapshot(store: Store) -> dict:
    return {t: store.rows(f"SELECT * FROM {t} ORDER BY ALL") for t in
            ("runs", "files", "tokens", "routing", "sequences", "expert_load")}


@pytest.fixture
def loaded_store(tmp_path):
    """A database that already holds one good run, so a refusal must leave it exactly as it was."""
    store = Store(tmp_path / "t.duckdb")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"run": "keep", "step": 0, "sample": 0, "sampler_logprobs": [-0.1, -0.2],
                                "trainer_logprobs": [-0.1, -0.3], "sampler_experts": [[[0, 1]], [[2, 3]]],
                                "trainer_experts": [[[1, 0]], [[2, 4]]]}) + "\n")
    assert [o.status for o in ingest_paths(store, [good])] == ["loaded"]
    return store


def test_every_rule_has_a_sample():
    assert len(SAMPLES) >= 15
    for p in SAMPLES:
        assert Path(f"{p}.expected").exists(), p


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_refused_with_exact_message_and_nothing_stored(sample, loaded_store):
    before = snapshot(loaded_store)
    outcomes = ingest_paths(loaded_store, [sample])
    assert [o.status for o in outcomes] == ["refused"]
    expected = Path(f"{sample}.expected").read_text().strip()
    assert outcomes[0].message == expected
    assert outcomes[0].message.startswith(sample.name + ":")
    assert "Traceback" not in outcomes[0].message
    assert snapshot(loaded_store) == before


def test_failure_midway_rolls_back_earlier_batches(tmp_path, loaded_store):
    """Batches of 10 rows are inserted one by one; a bad row in the 5th batch must undo the first four."""
    n = 50
    lp = [-0.5] * n
    lp[45] = float("nan")
    pq.write_table(pa.table({"run": ["big"] * n, "step": [0] * n, "sample": [0] * n, "pos": list(range(n)),
                             "sampler_logprob": lp, "trainer_logprob": [-0.4] * n}), tmp_path / "big.parquet")
    before = snapshot(loaded_store)
    out = ingest_paths(loaded_store, [tmp_path / "big.parquet"], limits=Limits(batch_rows=10))
    assert out[0].status == "refused"
    assert out[0].message.startswith("big.parquet: row 46, column 'sampler_logprob': log-probability must be finite")
    assert snapshot(loaded_store) == before


def test_duplicate_across_files_names_the_earlier_file(tmp_path, loaded_store):
    f = tmp_path / "again.jsonl"
    f.write_text(json.dumps({"run": "keep", "step": 0, "sample": 0, "sampler_logprobs": [-0.5],
                             "trainer_logprobs": [-0.5]}) + "\n")
    out = ingest_paths(loaded_store, [f])
    assert out[0].message == ("again.jsonl: tokens key (run='keep', step=0, sample=0, pos=0): duplicate key: "
                              "this key is already loaded from good.jsonl (each key may be loaded once; remove the "
                              "repeated rows or use another run name)")


def test_missing_run_name_says_how_to_fix(tmp_path):
    f = tmp_path / "norun.csv"
    f.write_text("step,sample,pos,sampler_logprob,trainer_logprob\n0,0,0,-0.1,-0.1\n")
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [f])
    assert out[0].message == ("norun.csv: required column 'run' is missing from the tokens data (columns found: pos, "
                              "sample, sampler_logprob, step, trainer_logprob) (pass --run NAME, or fill in the run "
                              "name when uploading)")
    assert ingest_paths(Store(tmp_path / "t.duckdb"), [f], run="named")[0].status == "loaded"


def test_line_over_cap_is_refused_without_reading_it_whole(tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text(json.dumps({"run": "r", "step": 0, "sample": 0, "sampler_logprobs": [-0.1] * 5000,
                             "trainer_logprobs": [-0.1] * 5000}) + "\n")
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [f], limits=Limits(max_line_bytes=4096))
    assert out[0].message == ("long.jsonl: line 1: a line is longer than the cap of 4,096 bytes (write one sequence "
                              "per line, or raise DRIFT_MAX_LINE_MB)")


def test_decompressed_size_cap(tmp_path):
    line = json.dumps({"run": "r", "step": 0, "sample": 0, "sampler_logprobs": [-0.1] * 100,
                       "trainer_logprobs": [-0.1] * 100})
    f = tmp_path / "bomb.jsonl.gz"
    f.write_bytes(gzip.compress("".join(line.replace('"sample": 0', f'"sample": {i}') + "\n"
                                        for i in range(2000)).encode()))
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [f], limits=Limits(max_decompressed_bytes=100_000))
    assert out[0].status == "refused"
    assert "decompressed content exceeds the cap" in out[0].message
    assert store.scalar("SELECT count(*) FROM tokens") == 0


def test_pt_needing_pickle_is_refused_not_executed(tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    f = tmp_path / "evil.pt"
    f.write_bytes(pickle.dumps({"x": Boom()}, protocol=2))
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [f])
    assert out[0].status == "refused"
    assert "pickle" in out[0].message
    assert not (tmp_path / "pwned").exists()


def test_csv_list_cell_not_json(tmp_path):
    (tmp_path / "t.csv").write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\nr,0,0,0,-1,-1\n")
    (tmp_path / "r.csv").write_text("run,step,sample,pos,layer,sampler_experts\nr,0,0,0,0,3 7\n")
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [tmp_path / "r.csv", tmp_path / "t.csv"])
    assert [o.status for o in out] == ["loaded", "refused"]
    assert out[1].message == ("r.csv: row 1, column 'sampler_experts': expected a JSON list like [3, 7], got '3 7' "
                              "(write lists as JSON arrays)")


def _csv(rows) -> str:
    return "run,step,sample,pos,sampler_logprob,trainer_logprob\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)


def test_csv_float_columns_are_floats_whatever_the_first_block_holds(tmp_path, monkeypatch):
    """Arrow's CSV reader types a column from the file's first block: log-probs written "0" and "-1" there (a
    greedy token, an integer-valued writer) made the column integers, and the first "-0.5" after it refused the
    file. The schema's float columns are read as floats, so the file loads with every value as written."""
    from analysis.ingest import long
    monkeypatch.setattr(long, "CSV_BLOCK_BYTES", 4096)  # several blocks in a small file
    rows = [("r", 0, i // 50, i % 50, 0 if i % 2 else -1, -1) for i in range(400)]  # > 4 KiB of integers first
    rows += [("r", 1, i // 50, i % 50, -0.5 - i / 1000, -0.25) for i in range(200)]
    (tmp_path / "t.csv").write_text(_csv(rows))
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [tmp_path / "t.csv"])
    assert out[0].status == "loaded", out[0].message
    got = store.rows("SELECT step, sample, pos, sampler_logprob, trainer_logprob FROM tokens ORDER BY step, sample, pos")
    assert got == [(st, sa, po, float(s), float(t)) for _, st, sa, po, s, t in rows]


def test_csv_value_unlike_the_first_blocks_type_names_its_column(tmp_path, monkeypatch):
    """An integer column (pos) whose later block holds 7.5 is refused with the column, the value and the fix,
    not as a CSV that "cannot be parsed"; nothing of it is stored."""
    from analysis.ingest import long
    monkeypatch.setattr(long, "CSV_BLOCK_BYTES", 4096)
    rows = [("r", 0, i // 50, i % 50, -1.5, -1.25) for i in range(600)]
    rows[550] = ("r", 0, 11, 7.5, -1.5, -1.25)
    (tmp_path / "t.csv").write_text(_csv(rows))
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [tmp_path / "t.csv"])
    assert out[0].status == "refused" and out[0].rule == "wrong type"
    assert "column 'pos': the value '7.5' is not of the type the column's first rows have (int64)" in out[0].message
    assert "whole numbers as 3, not 3.0" in out[0].message
    assert store.scalar("SELECT count(*) FROM tokens") == 0 and store.files().height == 0


def test_corrupt_bytes_never_traceback(tmp_path):
    good = io.BytesIO()
    pq.write_table(pa.table({"run": ["r"] * 1000, "step": [0] * 1000, "sample": [0] * 1000,
                             "pos": list(range(1000)), "sampler_logprob": [-0.1] * 1000,
                             "trainer_logprob": [-0.1] * 1000}), good)
    data = bytearray(good.getvalue())
    for i in range(200, 400):
        data[i] ^= 0xFF
    (tmp_path / "flipped.parquet").write_bytes(bytes(data))
    out = ingest_paths(Store(tmp_path / "t.duckdb"), [tmp_path / "flipped.parquet"])
    assert out[0].status in ("refused", "loaded")
    if out[0].status == "refused":
        assert out[0].message.startswith("flipped.parquet:")


def test_files_of_headers_only_load_with_no_rows_and_no_run(tmp_path):
    """A Parquet file with its columns but no rows, and a CSV of its header alone, break no rule: they load as
    empty, say so without naming a run, and create none."""
    cols = {"run": pa.string(), "step": pa.int64(), "sample": pa.int64(), "pos": pa.int32(),
            "sampler_logprob": pa.float64(), "trainer_logprob": pa.float64()}
    pq.write_table(pa.table({c: pa.array([], t) for c, t in cols.items()}), tmp_path / "empty.parquet")
    (tmp_path / "header.csv").write_text(",".join(cols) + "\n")
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [tmp_path / "empty.parquet", tmp_path / "header.csv"])
    assert [o.line() for o in out] == ["loaded empty.parquet [parquet]: no rows", "loaded header.csv [csv]: no rows"]
    assert store.run_names() == [] and store.scalar("SELECT count(*) FROM tokens") == 0
