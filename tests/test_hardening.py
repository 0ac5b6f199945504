"""Hosted-app hardening: crash safety (SIGKILL mid-ingest), readers never see half a file, fuzzed inputs never
traceback or leave partial data, uploads cannot choose server paths."""
from __future__ import annotations

import builtins
import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.ingest import ingest_paths
from analysis.ingest.errors import IngestError
from analysis.ingest.uploads import display_name, ingest_uploads
from analysis.store import Store

ROOT = Path(__file__).resolve().parent.parent


def big_parquet(path: Path, n: int, run: str = "big") -> None:
    import duckdb
    duckdb.connect().execute(f"""COPY (SELECT '{run}' AS run, i // 100000 AS step, (i // 1000) % 100 AS sample,
        (i % 1000)::INTEGER AS pos, -(random() * 3) AS sampler_logprob, -(random() * 3) AS trainer_logprob
        FROM range({n}) t(i)) TO '{path}' (FORMAT parquet, ROW_GROUP_SIZE 100000)""")


def snapshot(store: Store) -> dict:
    return {t: store.rows(f"SELECT * FROM {t} ORDER BY ALL") for t in
            ("runs", "files", "tokens", "routing", "sequences", "expert_load")}


@pytest.mark.slow
def test_sigkill_mid_ingest_leaves_clean_database(tmp_path):
    db = tmp_path / "t.duckdb"
    small = tmp_path / "small.parquet"
    big_parquet(small, 1000, run="kept")
    assert ingest_paths(Store(db), [small])[0].status == "loaded"
    big = tmp_path / "big.parquet"
    big_parquet(big, 3_000_000)
    # The child reports each batch the database has taken (inside the still-open transaction, through the
    # rows callback of the streamed INSERT); the kill lands after the third, i.e. in the middle of the file's load.
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from analysis.store import Store; "
              "from analysis.ingest import ingest_paths, Limits\n"
              "def spy(done, total):\n    print('inserted', flush=True)\n"
              "s = Store(sys.argv[2]); "
              "ingest_paths(s, [sys.argv[3]], limits=Limits(batch_rows=100_000), on_rows=spy); print('done', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(ROOT), str(db), str(big)],
                            stdout=subprocess.PIPE, text=True)
    for _ in range(3):
        assert proc.stdout.readline().strip() == "inserted"
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store(db)  # opens cleanly (WAL replay of committed work only)
    assert store.run_names() == ["kept"]
    assert store.rows("SELECT name FROM files") == [("small.parquet",)]
    assert store.scalar("SELECT count(*) FROM tokens") == 1000
    out = ingest_paths(store, [big])
    assert out[0].status == "loaded" and out[0].rows["tokens"] == 3_000_000


@pytest.mark.slow
def test_reader_sees_before_or_after_never_half(tmp_path):
    store = Store(tmp_path / "t.duckdb")
    big = tmp_path / "big.parquet"
    big_parquet(big, 1_000_000)
    seen: set[int] = set()
    stop = threading.Event()

    def read():
        while not stop.is_set():
            seen.add(store.scalar("SELECT count(*) FROM tokens"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        from analysis.ingest import Limits
        out = ingest_paths(store, [big], limits=Limits(batch_rows=50_000))
    finally:
        stop.set()
        reader.join()
    assert out[0].status == "loaded"
    assert seen <= {0, 1_000_000} and 0 in seen


# -- fuzzing -------------------------------------------------------------------------------------

def valid_samples() -> dict[str, bytes]:
    rows = [{"run": "f", "step": s, "sample": b, "pos": p, "sampler_logprob": -0.1 * (p + 1),
             "trainer_logprob": -0.11 * (p + 1)} for s in range(2) for b in range(2) for p in range(3)]
    out = {}
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    out["t.parquet"] = buf.getvalue()
    out["t.csv"] = ("run,step,sample,pos,sampler_logprob,trainer_logprob\n" +
                    "".join(f"{r['run']},{r['step']},{r['sample']},{r['pos']},{r['sampler_logprob']},"
                            f"{r['trainer_logprob']}\n" for r in rows)).encode()
    out["t.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
    seq = "".join(json.dumps({"run": "f", "step": s, "sample": b, "sampler_logprobs": [-0.1, -0.2],
                              "trainer_logprobs": [-0.1, -0.3], "sampler_experts": [[[0, 1]], [[1, 2]]],
                              "trainer_experts": [[[1, 0]], [[1, 3]]]}) + "\n" for s in range(2) for b in range(2))
    out["s.jsonl"] = seq.encode()
    out["s.jsonl.gz"] = gzip.compress(seq.encode())
    import torch
    d = {"rollout_log_probs": -torch.rand(2, 3), "old_log_probs": -torch.rand(2, 3),
         "response_mask": torch.ones(2, 3, dtype=torch.long), "step": 1, "run": "f"}
    buf = io.BytesIO()
    torch.save(d, buf)
    out["d.pt"] = buf.getvalue()
    from safetensors.torch import save
    out["d.safetensors"] = save({k: v for k, v in d.items() if isinstance(v, torch.Tensor)} |
                                {"step": torch.tensor(1)})
    return out


SAMPLES = valid_samples()


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(SAMPLES)))
    data = bytearray(SAMPLES[name])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[i:i + draw(st.integers(1, 16))]
    return name, bytes(data)


def all_subclasses(cls: type) -> list[type]:
    return [cls] + [c for sub in cls.__subclasses__() for c in all_subclasses(sub)]


RULES = {c.rule for c in all_subclasses(IngestError)} | {"refused by the database"}
# a reader's crash passed off as a refusal would quote Python's own exception types
PYTHON_ERRORS = re.compile(r"\b(%s|Traceback)\b" % "|".join(
    n for n in dir(builtins) if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)))


def assert_deliberate(o) -> None:
    """A refusal must be an IngestError the readers raised on purpose (its rule recorded), never an
    "error" outcome (a reader crash) nor a Python exception's text passed off as a message."""
    assert o.status in ("loaded", "refused", "skipped"), o.line()
    if o.status == "refused":
        assert o.rule in RULES, o.line()
        assert not PYTHON_ERRORS.search(o.message), o.message


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    store = Store(d / "t.duckdb")
    keep = d / "keep.jsonl"
    keep.write_text(json.dumps({"run": "keep", "step": 0, "sample": 0, "sampler_logprobs": [-0.5],
                                "trainer_logprobs": [-0.4]}) + "\n")
    ingest_paths(store, [keep])
    return store, d


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=mutated())
def test_fuzzed_files_never_traceback_or_half_load(case, fuzz_store):
    store, d = fuzz_store
    name, data = case
    path = d / name
    path.write_bytes(data)
    before = snapshot(store)
    out = ingest_paths(store, [path])  # must not raise
    for o in out:
        assert_deliberate(o)
        if o.status == "refused":
            assert o.message.startswith(name), o.message
            assert snapshot(store) == before
    if any(o.status == "loaded" for o in out):  # a benign mutation: undo it for the next example
        for run in store.run_names():
            if run != "keep":
                store.delete_run(run)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.floats(), st.integers(-2**70, 2**70),
                       st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers())),
       key=st.sampled_from(["step", "sample", "sampler_logprobs", "trainer_logprobs", "sampler_experts", "run",
                            "tokens", "token_ids", "sampler_version", "reward", "prompt",
                            "response_length"]))
def test_fuzzed_json_values_never_traceback(value, key, fuzz_store):
    store, d = fuzz_store
    rec = {"run": "j", "step": 0, "sample": 0, "sampler_logprobs": [-0.1, -0.2], "trainer_logprobs": [-0.1, -0.2]}
    rec[key] = value
    path = d / "j.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    before = snapshot(store)
    out = ingest_paths(store, [path])
    assert len(out) == 1
    assert_deliberate(out[0])
    if out[0].status == "refused":
        assert out[0].message.startswith("j.jsonl"), out[0].message
        assert snapshot(store) == before
    else:
        for run in store.run_names():
            if run != "keep":
                store.delete_run(run)


# -- uploads -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,label", [("../../etc/passwd", "passwd"), ("..\\..\\x.csv", "x.csv"),
                                        ("<script>.jsonl", "script_.jsonl"), ("", "upload"),
                                        ("a b;rm -rf.csv", "a_b_rm_-rf.csv")])
def test_upload_names_are_labels_only(name, label):
    assert display_name(name) == label


def test_upload_zip_with_traversal_is_refused(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("../escape.jsonl", SAMPLES["s.jsonl"])
    buf.seek(0)
    store = Store(tmp_path / "t.duckdb")
    out = ingest_uploads(store, [("evil.zip", buf)])
    assert [o.status for o in out] == ["refused"]
    assert out[0].message == ("evil.zip: member '../escape.jsonl': archive member points outside the archive "
                              "(zip the folder with relative paths)")
    assert not (tmp_path.parent / "escape.jsonl").exists()
    assert store.run_names() == []


def test_upload_zip_folder_and_size_cap(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("logs/s.jsonl", SAMPLES["s.jsonl"])
        zf.writestr("logs/t.parquet", SAMPLES["t.parquet"])
    store = Store(tmp_path / "t.duckdb")
    buf.seek(0)
    out = ingest_uploads(store, [("logs.zip", buf)], run="zipped")
    assert sorted(o.status for o in out) == ["loaded", "refused"]  # the two files share (step, sample, pos=0..1)
    buf.seek(0)
    out = ingest_uploads(Store(tmp_path / "u.duckdb"), [("logs.zip", buf)], max_bytes=100)
    assert out[0].status == "refused" and out[0].message == "logs.zip: upload exceeds the cap of 100 bytes (split the upload)"


def test_hostile_strings_stored_literally(tmp_path):
    evil = "x'); DROP TABLE tokens; --<img src=x onerror=alert(1)>"
    f = tmp_path / "e.jsonl"
    f.write_text(json.dumps({"run": evil, "step": 0, "sample": 0, "tokens": [evil],
                             "sampler_logprobs": [-0.1], "trainer_logprobs": [-0.2]}) + "\n")
    store = Store(tmp_path / "t.duckdb")
    assert ingest_paths(store, [f])[0].status == "loaded"
    assert store.run_names() == [evil]
    assert store.rows("SELECT token FROM tokens WHERE run = ?", [evil]) == [(evil,)]
    store.delete_run(evil)
    assert store.run_names() == [] and store.scalar("SELECT count(*) FROM tokens") == 0


@pytest.mark.slow
def test_cli_ingest_flushes_its_output_and_commits(tmp_path):
    """`python -m analysis ingest` with block-buffered output: its outcome lines are all printed, its exit code
    kept (1: a file refused), and the database holds the loaded file."""
    good, bad = tmp_path / "good.csv", tmp_path / "bad.csv"
    good.write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n"
                    + "".join(f"r,{i // 4},0,{i % 4},-0.{i + 1},-0.{i + 2}\n" for i in range(8)))
    bad.write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\nr,9,0,0,0.5,-0.1\n")
    db = tmp_path / "t.duckdb"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # output block-buffered, as usual
    p = subprocess.run([sys.executable, "-m", "analysis", "ingest", str(good), str(bad), "--db", str(db)],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert p.returncode == 1
    assert p.stdout.startswith("loaded good.csv") and p.stderr.startswith("refused bad.csv")
    store = Store(db, read_only=True)
    assert store.scalar("SELECT count(*) FROM tokens") == 8 and store.run_names() == ["r"]
    assert store.scalar("SELECT count(*) FROM summary_step WHERE n_tokens > 0") == 2


@pytest.mark.slow
def test_cli_refusal_exit_code_and_message(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\nr,0,0,0,0.5,-0.1\n")
    p = subprocess.run([sys.executable, "-m", "analysis", "ingest", str(bad), "--db", str(tmp_path / "t.duckdb")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 1
    assert p.stderr.strip() == ("refused bad.csv: row 1, column 'sampler_logprob': log-probability must be <= 0, got "
                                "0.5 (log-probs are natural-log probabilities of the sampled token; drop "
                                "untrained/padded tokens rather than writing placeholders)")
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "analysis", "runs", "--db", str(tmp_path / "t.duckdb")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0
    assert p.stdout == "run,n_tokens,n_steps,n_sequences,has_routing,first_step,last_step\n"
