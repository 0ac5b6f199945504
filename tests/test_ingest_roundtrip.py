"""Round trips: seeded logs written in every accepted family, ingested, read back equal; idempotency;
file order; folders; concurrent writers; derived routing columns against a brute-force reference."""
from __future__ import annotations

import gzip
import json
import threading

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.ingest import ingest_paths
from analysis.store import Store

from helpers.ingest import check_derived, make_logs


def write_family(fmt, d, tokens, rows):
    """Write tokens+routing in one family; returns the paths."""
    tt, rt = pa.table(tokens), pa.Table.from_pylist(rows)
    if fmt == "parquet":
        pq.write_table(tt, d / "tokens.parquet")
        pq.write_table(rt, d / "routing.parquet")
        return [d / "routing.parquet", d / "tokens.parquet"]  # routing first on purpose
    if fmt == "csv":
        pacsv.write_csv(tt, d / "tokens.csv")
        (d / "routing.csv").write_text("run,step,sample,pos,layer,sampler_experts,trainer_experts\n" + "".join(
            f'{r["run"]},{r["step"]},{r["sample"]},{r["pos"]},{r["layer"]},"{r["sampler_experts"]}",'
            f'"{r["trainer_experts"]}"\n' for r in rows))
        return [d / "routing.csv", d / "tokens.csv"]
    if fmt in ("jsonl", "jsonl.gz"):
        op = gzip.open if fmt == "jsonl.gz" else open
        with op(d / f"tokens.{fmt}", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in tt.to_pylist())
        with op(d / f"routing.{fmt}", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        return [d / f"routing.{fmt}", d / f"tokens.{fmt}"]
    if fmt == "sequence-jsonl":
        by_seq = {}
        for i in range(len(tokens["run"])):
            by_seq.setdefault((tokens["step"][i], tokens["sample"][i]), []).append(i)
        L = max(r["layer"] for r in rows) + 1
        with open(d / "seqs.jsonl", "w") as f:
            for (st_, b), idx in by_seq.items():
                rr = [r for r in rows if r["step"] == st_ and r["sample"] == b]
                f.write(json.dumps({
                    "run": tokens["run"][0], "step": st_, "sample": b,
                    "token_ids": [tokens["token_id"][i] for i in idx], "tokens": [tokens["token"][i] for i in idx],
                    "sampler_logprobs": [tokens["sampler_logprob"][i] for i in idx],
                    "trainer_logprobs": [tokens["trainer_logprob"][i] for i in idx],
                    "sampler_version": tokens["sampler_version"][idx[0]],
                    "trainer_version": tokens["trainer_version"][idx[0]],
                    "sampler_experts": [[rr[p * L + l]["sampler_experts"] for l in range(L)] for p in range(len(idx))],
                    "trainer_experts": [[rr[p * L + l]["trainer_experts"] for l in range(L)] for p in range(len(idx))],
                    "reward": float(b)}) + "\n")
        return [d / "seqs.jsonl"]
    raise ValueError(fmt)


TOKEN_COLS = "run, step, sample, pos, token_id, token, sampler_logprob, trainer_logprob, sampler_version, trainer_version"


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "jsonl.gz", "sequence-jsonl"])
def test_roundtrip_family(fmt, tmp_path):
    tokens, rows = make_logs(seed=3)
    paths = write_family(fmt, tmp_path, tokens, rows)
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, paths)
    assert all(o.status == "loaded" for o in out), [o.message for o in out]
    got = store.rows(f"SELECT {TOKEN_COLS} FROM tokens ORDER BY step, sample, pos")
    want = sorted(zip(*(tokens[c] for c in TOKEN_COLS.split(", "))), key=lambda r: (r[1], r[2], r[3]))
    assert got == [tuple(r) for r in want]  # doubles bit-exact through every family
    got_r = store.rows("SELECT run, step, sample, pos, layer, sampler_experts, trainer_experts FROM routing "
                       "ORDER BY step, sample, pos, layer")
    want_r = sorted((r["run"], r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                    for r in rows)
    assert got_r == want_r
    check_derived(store, rows)


def test_idempotent_and_order_free(tmp_path):
    tokens, rows = make_logs(seed=5)
    paths = write_family("parquet", tmp_path, tokens, rows)
    store = Store(tmp_path / "t.duckdb")
    first = ingest_paths(store, paths)
    assert [o.status for o in first] == ["loaded", "loaded"]
    assert first[0].name == "tokens.parquet"  # tokens load first whatever the order given
    counts = store.rows("SELECT (SELECT count(*) FROM tokens), (SELECT count(*) FROM routing), "
                        "(SELECT count(*) FROM files), (SELECT count(*) FROM expert_load)")
    again = ingest_paths(store, list(reversed(paths)))
    assert [o.status for o in again] == ["skipped", "skipped"]
    assert again[0].line() == "skipped tokens.parquet: same content already loaded"
    assert store.rows("SELECT (SELECT count(*) FROM tokens), (SELECT count(*) FROM routing), "
                      "(SELECT count(*) FROM files), (SELECT count(*) FROM expert_load)") == counts


def test_folder_and_run_json_config(tmp_path):
    tokens, rows = make_logs(seed=1, run="lab")
    d = tmp_path / "run_dir"
    (d / "nested").mkdir(parents=True)
    write_family("parquet", d / "nested", tokens, rows)
    (d / "nested" / "run.json").write_text(json.dumps({"run": "lab", "config": {"sampler_dtype": "bf16"}}))
    (d / "notes.txt").write_text("not a log\n")
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [d])
    assert sorted(o.status for o in out) == ["loaded", "loaded"]
    assert store.run_config("lab") == {"sampler_dtype": "bf16"}
    runs = store.runs()
    assert runs["n_tokens"].to_list() == [len(tokens["run"])] and runs["has_routing"].to_list() == [True]


def test_a_folder_holding_the_database_itself_loads_its_logs_only(tmp_path, monkeypatch):
    # the database (and its write-ahead log, which changes during the load) inside the scanned folder are
    # passed over; a file that vanishes between the listing and the read is refused with a message
    tokens, rows = make_logs(seed=3, run="here")
    write_family("parquet", tmp_path, tokens, rows)
    store = Store(tmp_path / "drift.duckdb")
    store.rows("SELECT 1")
    (tmp_path / "drift.duckdb.wal").write_bytes(b"\x00" * 64)
    (tmp_path / "gone.parquet").write_bytes(b"PAR1")
    from analysis.ingest import load
    real = load.file_unit

    def vanishing(path, name=None):
        if path.name == "gone.parquet":
            raise FileNotFoundError(2, "No such file or directory")
        return real(path, name)
    monkeypatch.setattr(load, "file_unit", vanishing)
    out = ingest_paths(store, [tmp_path])
    assert sorted((o.name.split("/")[-1], o.status) for o in out) == [
        ("gone.parquet", "refused"), ("routing.parquet", "loaded"), ("tokens.parquet", "loaded")], \
        [o.line() for o in out]
    assert "cannot be read (No such file or directory)" in [o for o in out if o.status == "refused"][0].message


def test_run_override_and_sampler_only_routing(tmp_path):
    tokens, rows = make_logs(seed=2)
    for r in rows:
        del r["trainer_experts"]
    paths = write_family("parquet", tmp_path, tokens, rows)
    store = Store(tmp_path / "t.duckdb")
    assert all(o.status == "loaded" for o in ingest_paths(store, paths, run="renamed"))
    assert store.run_names() == ["renamed"]
    assert store.rows("SELECT count(*), count(trainer_experts), count(flip), count(n_common) FROM routing") == \
        [(len(rows), 0, 0, 0)]
    assert store.scalar("SELECT sum(n_trainer) FROM expert_load") == 0
    assert store.scalar("SELECT sum(n_sampler) FROM expert_load") == 2 * len(rows)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("pad", [0.0, -9999.0, float("nan")])
def test_tensor_dump_drops_padding_whatever_its_value(fmt, pad, tmp_path):
    import torch
    g = torch.Generator().manual_seed(0)
    B, T, L, K = 3, 5, 2, 2
    s = -torch.rand(B, T, generator=g)
    t = -torch.rand(B, T, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    s[mask == 0] = pad
    t[mask == 0] = pad
    experts = torch.stack([torch.randperm(6, generator=g)[:K] for _ in range(B * T * L)]).reshape(B, T, L, K)
    d = {"rollout_log_probs": s, "old_log_probs": t, "response_mask": mask, "responses": torch.arange(B * T).reshape(B, T),
         "sampler_experts": experts.to(torch.int16), "global_steps": torch.tensor(7)}
    path = tmp_path / f"step7.{fmt}"
    if fmt == "pt":
        torch.save(d, path)
    else:
        from safetensors.torch import save_file
        save_file(d, str(path))
    store = Store(tmp_path / "t.duckdb")
    out = ingest_paths(store, [path], run="verl")
    assert out[0].status == "loaded", out[0].message
    got = store.rows("SELECT step, sample, pos, token_id, sampler_logprob, trainer_logprob FROM tokens ORDER BY ALL")
    want = [(7, b, p, b * T + p, float(s[b, p].double()), float(t[b, p].double()))
            for b in range(B) for p in range(T) if mask[b, p]]
    assert got == want
    got_r = store.rows("SELECT sample, pos, layer, sampler_experts FROM routing ORDER BY ALL")
    assert got_r == [(b, p, l, experts[b, p, l].tolist()) for b in range(B) for p in range(T) if mask[b, p]
                     for l in range(L)]


def test_two_threads_ingest_at_once(tmp_path):
    store = Store(tmp_path / "t.duckdb")
    paths = []
    for i in range(2):
        d = tmp_path / f"d{i}"
        d.mkdir()
        tokens, rows = make_logs(seed=10 + i, run=f"run{i}", steps=3, samples=20, length=30)
        paths.append(write_family("parquet", d, tokens, rows))
    results = {}
    barrier = threading.Barrier(2)

    def work(i):
        barrier.wait()
        results[i] = ingest_paths(store, paths[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(o.status == "loaded" for i in range(2) for o in results[i])
    assert store.rows("SELECT run, count(*) FROM tokens GROUP BY run ORDER BY run") == [("run0", 1800), ("run1", 1800)]


seq_strategy = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 50),
              st.lists(st.tuples(st.floats(-30, 0, allow_nan=False), st.floats(-30, 0, allow_nan=False),
                                 st.text(max_size=4)), min_size=1, max_size=6)),
    min_size=1, max_size=8, unique_by=lambda x: (x[0], x[1]))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=seq_strategy)
def test_hypothesis_sequence_jsonl_roundtrip(seqs, tmp_path_factory):
    d = tmp_path_factory.mktemp("hyp")
    with open(d / "s.jsonl", "w") as f:
        for step, sample, toks in seqs:
            f.write(json.dumps({"run": "h", "step": step, "sample": sample, "tokens": [x[2] for x in toks],
                                "sampler_logprobs": [x[0] for x in toks],
                                "trainer_logprobs": [x[1] for x in toks]}) + "\n")
    store = Store(d / "t.duckdb")
    out = ingest_paths(store, [d / "s.jsonl"])
    assert out[0].status == "loaded", out[0].message
    got = store.rows("SELECT step, sample, pos, token, sampler_logprob, trainer_logprob FROM tokens ORDER BY ALL")
    want = sorted((step, sample, p, x[2], x[0], x[1]) for step, sample, toks in seqs for p, x in enumerate(toks))
    assert got == want
    store.close()
