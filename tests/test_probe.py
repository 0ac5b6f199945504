"""The drift-origin probe on tiny random Qwen3-MoE / Mixtral configs and on the lab model (CPU): fp32 against fp32
sits on its measured floor, a bf16 probe's first divergent op is found (and equals a numpy reference), a
perturbation planted in layer j is located at layer j, and the probe table loads, reloads and refuses as stated."""
from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from analysis import schema
from analysis.ingest import open_store
from analysis.metrics import probe as P
from analysis.probe.cli import main
from analysis.probe.load import load_probe, read_probe_file
from analysis.probe.models import load_target
from analysis.probe.run import compare, read_prompts, router_view, run_probe
from helpers.probe import llama_config, mixtral_config, qwen3_moe_config

pytestmark = pytest.mark.lab

PROMPT = [[5, 17, 3, 99, 42, 7]]
N = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"lab": "lab", "qwen3_moe": str(qwen3_moe_config(root / "qwen3_moe")),
            "mixtral": str(mixtral_config(root / "mixtral"))}


def rows_of(out: str) -> list[dict]:
    return json.loads((__import__("pathlib").Path(out) / "probe.json").read_text())


def sites(rows):
    """{(layer, op): [row, ...]} in compute order."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: (r["layer"], schema.PROBE_OPS.index(r["op"]), r["sample"], r["pos"])):
        out.setdefault((r["layer"], r["op"]), []).append(r)
    return out


def first_above(rows):
    """The rule of analysis/metrics/probe.py, recomputed in numpy from the file's rows."""
    for key, rs in sites(rows).items():
        rel = np.mean([r["rel_l2"] for r in rs])
        floor = np.mean([r["floor_rel_l2"] for r in rs])
        if rel > P.FLOOR_FACTOR * floor + P.FLOOR_ABS:
            return key
    return None


def test_compare_and_router_view_match_numpy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    b[2] = a[2]
    rel, mx = compare(torch.from_numpy(a).float(), torch.from_numpy(b).float())
    a32, b32 = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    ref = np.linalg.norm(a32 - b32, axis=1) / np.linalg.norm(b32, axis=1)
    np.testing.assert_allclose(rel, ref, rtol=1e-12)
    np.testing.assert_allclose(mx, np.abs(a32 - b32).max(axis=1), rtol=1e-12)
    assert rel[2] == 0 and mx[2] == 0
    logits = rng.normal(size=(6, 8)).astype(np.float32)
    ids, margin = router_view(torch.from_numpy(logits), 3)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    order = np.argsort(-p, axis=1, kind="stable")
    np.testing.assert_array_equal(ids, order[:, :3])
    ps = -np.sort(-p, axis=1)
    np.testing.assert_allclose(margin, ps[:, 2] - ps[:, 3], rtol=1e-5, atol=1e-7)  # torch's fp32 softmax


@pytest.mark.parametrize("name", ["lab", "qwen3_moe", "mixtral"])
def test_fp32_against_fp32_sits_on_its_floor(models, name, tmp_path):
    out = run_probe(models[name], tmp_path, "fp32", "fp32", prompts=PROMPT, tokens=N, run="f32")
    rows = rows_of(out["out"])
    n_layers = out["layers"]
    assert len(rows) == N * n_layers * 4  # every op of every (MoE) block
    assert all(r["rel_l2"] == r["floor_rel_l2"] and r["max_abs"] == r["floor_max_abs"] for r in rows)
    assert max(r["floor_rel_l2"] for r in rows) < 1e-5  # fp32 rounding of the KV cache path only
    assert first_above(rows) is None
    tokens = pq.read_table(tmp_path / "f32" / "tokens-step000000.parquet")
    d = tokens["trainer_logprob"].to_numpy() - tokens["sampler_logprob"].to_numpy()
    assert len(d) == N and np.abs(d).max() < 1e-5
    with open_store(tmp_path / "db.duckdb") as store:
        load_probe(store, out["out"])
        assert P.first_above_floor(P.by_layer_op(store, "f32")) is None


def test_bf16_probe_reports_its_first_divergent_op(models, tmp_path):
    """bf16 sampler: the block-0 input is the embedding rounded to bf16, so that is where drift starts; its
    relative L2 per token equals the one numpy computes from the embedding rows of the input tokens."""
    out = run_probe(models["qwen3_moe"], tmp_path, "bf16", "fp32", prompts=PROMPT, tokens=N, run="b16")
    rows = rows_of(out["out"])
    assert first_above(rows) == (0, "input")
    with open_store(tmp_path / "db.duckdb") as store:
        load_probe(store, out["out"])
        first = P.first_above_floor(P.by_layer_op(store, "b16"))
    assert (first["layer"], first["op"]) == (0, "input")
    emb = load_target(models["qwen3_moe"]).model.get_input_embeddings().weight.detach()
    response = pq.read_table(tmp_path / "b16" / "tokens-step000000.parquet")["token_id"].to_pylist()
    inputs = [PROMPT[0][-1]] + response[:-1]  # response token j is predicted at input position P + j - 1
    e32 = emb[inputs].double().numpy()
    e16 = emb[inputs].to(torch.bfloat16).double().numpy()
    ref = np.linalg.norm(e16 - e32, axis=1) / np.linalg.norm(e32, axis=1)
    got = [r["rel_l2"] for r in sites(rows)[(0, "input")]]
    np.testing.assert_allclose(got, ref, rtol=1e-12)
    assert all(r["floor_rel_l2"] == 0 for r in sites(rows)[(0, "input")])  # fp32 embeddings agree exactly


@pytest.mark.parametrize("name,layer,op", [("lab", 2, "attn"), ("qwen3_moe", 1, "mlp"), ("mixtral", 2, "input"),
                                           ("qwen3_moe", 0, "attn")])
def test_a_planted_perturbation_is_located_at_its_layer(models, name, layer, op, tmp_path):
    out = run_probe(models[name], tmp_path, "fp32", "fp32", prompts=PROMPT, tokens=N, run="planted",
                    perturb=(layer, op, 1e-3, 0))
    rows = rows_of(out["out"])
    assert first_above(rows) == (layer, op)
    for key, rs in sites(rows).items():  # before the planted op, the sampler's numbers are the floor's exactly
        if (key[0], schema.PROBE_OPS.index(key[1])) < (layer, schema.PROBE_OPS.index(op)):
            assert all(r["rel_l2"] == r["floor_rel_l2"] for r in rs), key
    with open_store(tmp_path / "db.duckdb") as store:
        load_probe(store, out["out"])
        first = P.first_above_floor(P.by_layer_op(store, "planted"))
    assert (first["layer"], first["op"]) == (layer, op)


def test_a_dense_model_has_no_router_rows_and_no_routing(tmp_path):
    model = llama_config(tmp_path / "llama")
    run_probe("lab", tmp_path, "bf16", "fp32", prompts=PROMPT, tokens=3, run="dense")  # an MoE first, same folder
    assert list((tmp_path / "dense").glob("routing-*.parquet"))
    out = run_probe(str(model), tmp_path, "bf16", "fp32", prompts=PROMPT, tokens=N, run="dense")
    rows = rows_of(out["out"])
    assert {r["op"] for r in rows} == {"input", "attn", "mlp"} and len(rows) == N * 2 * 3
    assert not list((tmp_path / "dense").glob("routing-*.parquet"))
    assert first_above(rows) == (0, "input")
    with open_store(tmp_path / "db.duckdb") as store:
        load_probe(store, out["out"])
        assert P.first_flips(store, "dense").height == 0
        assert P.by_layer_op(store, "dense")["flip_rate"].null_count() == 6


def test_probe_table_loads_reloads_and_reads_back(models, tmp_path):
    out = run_probe(models["mixtral"], tmp_path, "bf16", "fp32", prompts=PROMPT * 2, tokens=N, run="mx")
    rows = rows_of(out["out"])
    db = tmp_path / "db.duckdb"
    with open_store(db) as store:
        load_probe(store, out["out"])
        load_probe(store, out["out"])  # twice: one copy
        assert store.scalar("SELECT count(*) FROM probe WHERE run = 'mx'") == len(rows) == 2 * N * 3 * 4
        table = P.by_layer_op(store, "mx")
        for (layer, op), rs in sites(rows).items():
            got = table.filter((table["layer"] == layer) & (table["op"] == op)).row(0, named=True)
            assert got["n_tokens"] == len(rs) == 2 * N
            np.testing.assert_allclose(got["rel_l2_mean"], np.mean([r["rel_l2"] for r in rs]), rtol=1e-12)
            np.testing.assert_allclose(got["floor_rel_l2_mean"], np.mean([r["floor_rel_l2"] for r in rs]), rtol=1e-12)
        flips = P.first_flips(store, "mx")
        tokens = pq.read_table(tmp_path / "mx" / "tokens-step000000.parquet").to_pylist()
        delta = {(t["sample"], t["pos"]): t["trainer_logprob"] - t["sampler_logprob"] for t in tokens}
        router = [r for r in rows if r["op"] == "router"]
        for f in flips.iter_rows(named=True):
            mine = sorted((r for r in router if (r["sample"], r["pos"]) == (f["sample"], f["pos"])),
                          key=lambda r: r["layer"])
            flipped = [r["layer"] for r in mine if set(r["sampler_topk"]) != set(r["trainer_topk"])]
            assert f["first_flip_layer"] == (flipped[0] if flipped else None)
            assert f["n_flipped_layers"] == len(flipped)
            assert f["delta"] == pytest.approx(delta[(f["sample"], f["pos"])], rel=1e-12, abs=0)
        path = P.token_path(store, "mx", 1, 3)
        assert path["site"].to_list() == [f"L{i} {op}" for i in range(3) for op in schema.PROBE_OPS]
        # routing rows: the sampler's top-k of the probe's router rows
        routing = store.sql("SELECT layer, sampler_experts FROM routing WHERE run = 'mx' AND sample = 1 AND pos = 3 "
                            "ORDER BY layer")
        want = [sorted(r["sampler_topk"]) for r in sorted(router, key=lambda r: r["layer"])
                if (r["sample"], r["pos"]) == (1, 3)]
        assert [sorted(x) for x in routing["sampler_experts"].to_list()] == want
        store.delete_run("mx")
        assert store.scalar("SELECT count(*) FROM probe") == 0


def test_a_bad_probe_file_is_refused_whole(models, tmp_path):
    out = run_probe("lab", tmp_path, "bf16", "fp32", prompts=PROMPT, tokens=4, run="bad")
    path = tmp_path / "bad" / "probe.json"
    rows = json.loads(path.read_text())
    rows[5]["rel_l2"] = -1.0
    path.write_text(json.dumps(rows))
    db = tmp_path / "db.duckdb"
    with open_store(db) as store:
        with pytest.raises(ValueError, match=r"probe.json, row 5: 'rel_l2' must be a finite number >= 0"):
            load_probe(store, out["out"])
        assert store.run_names() == [] and store.scalar("SELECT count(*) FROM probe") == 0
    rows[5]["rel_l2"], rows[7]["op"] = 0.5, "mlp2"
    path.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match=r"row 7: 'op' must be one of"):
        read_probe_file(path)


def test_prompts_file_and_cli(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1 2 3\n\n4 5 6 7\n")
    assert read_prompts(prompts, None) == [[1, 2, 3], [4, 5, 6, 7]]
    prompts.write_text("1 2 3\nhello world\n")
    with pytest.raises(ValueError, match=r"prompts.txt, line 2: text needs the model folder's tokenizer"):
        read_prompts(prompts, None)
    prompts.write_text("1 2 3\n4 5 6\n")
    db = tmp_path / "db.duckdb"
    rc = main(["--model", "lab", "--tokens", "4", "--prompts", str(prompts), "--out", str(tmp_path / "out"),
               "--run", "cli", "--db", str(db)])
    text = capsys.readouterr().out
    assert rc == 0 and "cli: lab, 4 layers, 8 tokens, 128 probe rows" in text
    assert "first above the fp32 noise floor at layer 0 input" in text  # the bf16 default rounds the embeddings
    (tmp_path / "taken" / "cli").mkdir(parents=True)  # a folder of other logs is not overwritten
    (tmp_path / "taken" / "cli" / "run.json").write_text('{"run": "cli", "config": {"engine": "vllm"}}')
    assert main(["--model", "lab", "--tokens", "2", "--out", str(tmp_path / "taken"), "--run", "cli"]) == 2
    assert "holds no probe output" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file or folder with a config.json" in capsys.readouterr().err
    prompts.write_text("1 2 999999\n")
    assert main(["--model", "lab", "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert "prompt 0: token ids must lie in 0..511" in capsys.readouterr().err


def test_a_database_from_before_the_probe_gains_the_table(tmp_path):
    """A database made before the probe has no `probe` table: read-only, the reader says no probe runs; opened
    for writing, the store's DDL adds the table."""
    from analysis.store import Store
    db = tmp_path / "old.duckdb"
    store = Store(db)
    store.close()
    import duckdb
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE probe")
    con.close()
    with Store(db, read_only=True) as old:
        assert P.probe_runs(old) == []
    with Store(db) as store:
        assert store.scalar("SELECT count(*) FROM probe") == 0 and P.probe_runs(store) == []
