"""Engine expert-load dumps (analysis/ingest/engine_load.py) built here in the layouts the engines write
(FORMATS.md, "Expert load dumps"): SGLang's recorder in `stat` and `per_pass` modes (torch.save of its dicts),
TensorRT-LLM's rank<r>.safetensors statistic with meta_info.json and its EPLB placement YAML. Each loads as the
run's sampler-side counts (and placement), recognised by content; broken ones are refused naming file and rule,
with nothing left in the database."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from analysis.ingest import ingest_paths
from analysis.metrics import load as L
from analysis.store import Store

LAYERS, E, EP = 3, 8, 4


def _counts(store: Store, run: str) -> dict:
    return {(s, la, e): (ns, nt) for s, la, e, ns, nt in store.rows(
        "SELECT step, layer, expert, sum(n_sampler), sum(n_trainer) FROM expert_load WHERE run = ? GROUP BY ALL",
        [run])}


def _one(outcomes):
    assert len(outcomes) == 1, [o.line() for o in outcomes]
    return outcomes[0]


def test_sglang_stat(tmp_path):
    rng = np.random.default_rng(0)
    logical = torch.tensor(rng.integers(0, 50, size=(6, LAYERS, E)), dtype=torch.int32)
    logical[4:] = 0  # an unfilled circular buffer's rows
    path = tmp_path / "expert_distribution_recorder_1733400000.123.pt"
    torch.save(dict(rank=0, logical_count=logical, average_utilization_rate_over_window=None), path)
    store = Store(tmp_path / "a.duckdb")
    o = _one(ingest_paths(store, [path], run="sg"))
    assert o.status == "loaded" and o.format == "sglang-load", o.line()
    want = {(s, la, e): (int(logical[s, la, e]), 0) for s in range(4) for la in range(LAYERS) for e in range(E)
            if logical[s, la, e] > 0}
    assert _counts(store, "sg") == want
    assert _one(ingest_paths(store, [path], run="sg")).status == "skipped"  # same content: a no-op


def _per_pass_dump(rng, rank: int, phys2log: torch.Tensor, passes=(0, 1, 2)) -> dict:
    records = [dict(forward_pass_id=fp, rank=rank, gatherer_key="primary",
                    global_physical_count=torch.tensor(rng.integers(0, 30, size=phys2log.shape), dtype=torch.int32))
               for fp in passes]
    return dict(records=records, last_physical_to_logical_map=phys2log)


def test_sglang_per_pass_two_ranks_with_placement(tmp_path):
    rng = np.random.default_rng(1)
    # 12 physical slots over 4 GPUs (3 each): every expert once, experts 0, 5, 7 replicated; differs per layer
    phys2log = torch.tensor(np.stack([rng.permutation(np.r_[np.arange(E), [0, 5, 7, 0]]) for _ in range(LAYERS)]))
    dumps = [_per_pass_dump(rng, r, phys2log) for r in range(2)]
    paths = []
    for r, d in enumerate(dumps):
        paths.append(tmp_path / f"expert_distribution_recorder_1733400000.5_{r}.pt")
        torch.save(d, paths[-1])
    (tmp_path / "run.json").write_text(json.dumps({"config": {"ep_size": EP, "n_experts": E}}))
    store = Store(tmp_path / "a.duckdb")
    outcomes = ingest_paths(store, [tmp_path], run="pp")
    assert [o.status for o in outcomes] == ["loaded", "loaded"], [o.line() for o in outcomes]
    want: dict = {}
    m = phys2log.numpy()
    for d in dumps:
        for rec in d["records"]:
            c = rec["global_physical_count"].numpy()
            for la in range(LAYERS):
                for slot in range(m.shape[1]):
                    key = (rec["forward_pass_id"], la, int(m[la, slot]))
                    want[key] = want.get(key, 0) + int(c[la, slot])
    assert _counts(store, "pp") == {k: (v, 0) for k, v in want.items() if v}
    # the map is the placement: rank columns split replicas evenly over slots, ranks from the config's ep_size
    df = L.load_table(store, "pp")
    for row in df.iter_rows(named=True):
        c = np.zeros(E)
        for (s, la, e), v in want.items():
            if s == row["step"] and la == row["layer"]:
                c[e] = v
        rep = np.bincount(m[row["layer"]], minlength=E)
        per_gpu = (c[m[row["layer"]]] / rep[m[row["layer"]]]).reshape(EP, -1).sum(1)
        assert np.isclose(row["rank_imbalance_sampler"], per_gpu.max() / per_gpu.mean() - 1, rtol=1e-12)


def test_sglang_per_token_records_load_as_per_pass(tmp_path):
    """per_token mode: each record also carries the pass's token ids, positions, forward mode, top-k ids per layer
    and DeepEP counters (_DetailSinglePassGatherer.collect); only global_physical_count is read."""
    rng = np.random.default_rng(4)
    m = torch.arange(E).repeat(LAYERS, 1)
    c = torch.tensor(rng.integers(0, 9, size=(LAYERS, E)), dtype=torch.int32)
    rec = dict(forward_pass_id=7, rank=0, gatherer_key="primary", input_ids=[5, 6, 7], positions=[0, 1, 2],
               extend_seq_lens=[3], forward_mode=1, topk_ids_of_layer=torch.zeros(LAYERS, 3, 8, dtype=torch.int32),
               misc_objects=[dict(layer_id=0, num_tokens_per_rank=[3], num_tokens_per_rdma_rank=[3],
                                  num_tokens_per_expert=[1] * E)], global_physical_count=c)
    path = tmp_path / "expert_distribution_recorder_1.0_0.pt"
    torch.save(dict(records=[rec], last_physical_to_logical_map=m), path)
    store = Store(tmp_path / "a.duckdb")
    o = _one(ingest_paths(store, [path], run="tok"))
    assert o.status == "loaded" and o.format == "sglang-load", o.line()
    assert _counts(store, "tok") == {(7, la, e): (int(c[la, e]), 0) for la in range(LAYERS) for e in range(E)
                                     if c[la, e] > 0}


def test_trt_statistic_folder_and_placement(tmp_path):
    rng = np.random.default_rng(2)
    folder = tmp_path / "expert_statistic"
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": E, "num_experts_per_token": 2}))
    want: dict = {}
    for rank in range(2):
        rec = {}
        for it in range(50, 53):
            for la in range(LAYERS):
                c = torch.tensor(rng.integers(0, 40, size=E), dtype=torch.int32)
                rec[f"{it}_{la}"] = c
                for e in range(E):
                    want[(it, la, e)] = want.get((it, la, e), 0) + int(c[e])
        save_file(rec, str(folder / f"rank{rank}.safetensors"))
        # what the recorder writes beside the counts (2-D): passed over in a folder
        save_file({f"{it}_{la}": torch.zeros(E, E, dtype=torch.int32) for it in range(50, 53) for la in range(LAYERS)},
                  str(folder / f"cooccurrence_rank{rank}.safetensors"))
    slots = {la: [int(x) for x in rng.permutation(np.r_[np.arange(E), [1, 2, 3, 4]])] for la in range(LAYERS)}
    with open(folder / "eplb_config.yaml", "w") as f:  # as generate_eplb_config.py writes it (flow-style lists)
        yaml.add_representer(list, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                          flow_style=True))
        yaml.dump({"num_slots": 12, "initial_global_assignments": slots, "layer_updates_per_iter": 0, "ep_size": 4},
                  f, width=float("inf"))
    store = Store(tmp_path / "a.duckdb")
    outcomes = ingest_paths(store, [folder], run="trt")
    assert sorted(o.format for o in outcomes) == ["trtllm-load", "trtllm-load", "trtllm-placement"], \
        [o.line() for o in outcomes]
    assert all(o.status == "loaded" for o in outcomes)
    assert _counts(store, "trt") == {k: (v, 0) for k, v in want.items() if v}
    placed = store.rows("SELECT layer, list(expert ORDER BY slot), min(n_ranks) FROM expert_placement "
                        "WHERE run = 'trt' GROUP BY layer ORDER BY layer")
    assert [(la, s, n) for la, s, n in placed] == [(la, slots[la], 4) for la in range(LAYERS)]
    df = L.load_table(store, "trt", n_experts=E)
    row = df.filter((df["step"] == 51) & (df["layer"] == 2)).row(0, named=True)
    c = np.array([want[(51, 2, e)] for e in range(E)], float)
    m = np.array(slots[2])
    rep = np.bincount(m, minlength=E)
    per = (c[m] / rep[m]).reshape(4, -1).sum(1)
    assert np.isclose(row["rank_balancedness_sampler"], per.mean() / per.max(), rtol=1e-12)


@pytest.mark.parametrize("case", ["negative", "bad_key", "float", "no_run", "shape", "yaml_slots"])
def test_refusals_name_file_and_rule(tmp_path, case):
    run = None if case == "no_run" else "x"
    if case in ("negative", "float", "no_run"):
        t = torch.ones(2, LAYERS, E, dtype=torch.float32 if case == "float" else torch.int32)
        if case == "negative":
            t[1, 2, 3] = -4
        path = tmp_path / "dump.pt"
        torch.save(dict(rank=0, logical_count=t, average_utilization_rate_over_window=None), path)
        rule = {"negative": "value out of range", "float": "wrong type", "no_run": "missing required column"}[case]
    elif case == "bad_key":
        path = tmp_path / "rank0.safetensors"
        save_file({"50_1": torch.ones(E, dtype=torch.int32), "50_x": torch.ones(E, dtype=torch.int32)}, str(path))
        rule = None  # not '<iter>_<layer>' everywhere: not recognised as the statistic at all
    elif case == "shape":
        m = torch.arange(E).repeat(LAYERS, 1)
        d = dict(records=[dict(forward_pass_id=0, rank=0, global_physical_count=torch.ones(LAYERS, E + 1,
                                                                                           dtype=torch.int32))],
                 last_physical_to_logical_map=m)
        path = tmp_path / "dump.pt"
        torch.save(d, path)
        rule = "value out of range"
    else:
        path = tmp_path / "eplb.yaml"
        path.write_text("initial_global_assignments:\n  0: [0, 1, 2]\nnum_slots: 4\n")
        rule = "value out of range"
    store = Store(tmp_path / "a.duckdb")
    o = _one(ingest_paths(store, [path], run=run))
    if rule is None:
        assert o.format != "trtllm-load"
        return
    assert o.status == "refused" and o.rule == rule, o.line()
    assert path.name in o.message and "Traceback" not in o.message
    assert store.rows("SELECT count(*) FROM expert_load")[0][0] == 0
    assert store.rows("SELECT count(*) FROM expert_placement")[0][0] == 0
