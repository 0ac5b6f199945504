"""DriftLogger: round trip against a brute-force reference, schema types, determinism, run-name safety."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.record.logger import DriftLogger, _all_logprobs, safe_run_name


def make_step(B=5, T=7, L=3, K=2, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    s = -torch.rand(B, T, generator=g) * 5
    t = s + torch.randn(B, T, generator=g) * 0.01
    t = t.clamp(max=0.0)
    s[mask == 0] = float("nan")  # padding may hold anything: it must never be read
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
    trainer_experts = experts.flip(-1).clone()
    trainer_experts[..., 0] = torch.where(torch.rand(B, T, L, generator=g) < 0.2, (experts[..., -1] + 1) % E,
                                          trainer_experts[..., 0])
    return dict(sampler_logprobs=s, trainer_logprobs=t, mask=mask,
                token_ids=torch.randint(0, 100, (B, T), generator=g),
                sampler_experts=experts, trainer_experts=trainer_experts,
                sampler_version=torch.arange(B), trainer_version=7, sample_ids=torch.arange(B) * 10 + 3)


def reference_rows(d):
    """Brute force: one loop per token (and per layer), as the schema describes the rows."""
    B, T = d["mask"].shape
    tokens, routing = [], []
    for b in range(B):
        for t in range(T):
            if d["mask"][b, t]:
                sample = int(d["sample_ids"][b])
                tokens.append((sample, t, int(d["token_ids"][b, t]), float(d["sampler_logprobs"][b, t]),
                               float(d["trainer_logprobs"][b, t]), int(d["sampler_version"][b]), 7))
                for layer in range(d["sampler_experts"].shape[2]):
                    routing.append((sample, t, layer, d["sampler_experts"][b, t, layer].tolist(),
                                    d["trainer_experts"][b, t, layer].tolist()))
    return tokens, routing


def test_round_trip_matches_brute_force(tmp_path):
    d = make_step()
    paths = DriftLogger(tmp_path, "r1").log_step(3, **d)
    assert paths["tokens"].name == "tokens-step000003.parquet"
    assert paths["routing"].name == "routing-step000003.parquet"
    tokens, routing = reference_rows(d)

    tok = pq.read_table(paths["tokens"]).to_pylist()
    assert len(tok) == int(d["mask"].sum()) == len(tokens)
    assert {r["run"] for r in tok} == {"r1"} and {r["step"] for r in tok} == {3}
    got = [(r["sample"], r["pos"], r["token_id"], r["sampler_logprob"], r["trainer_logprob"],
            r["sampler_version"], r["trainer_version"]) for r in tok]
    assert got == tokens  # exact: float32 -> float64 widening is exact

    rout = pq.read_table(paths["routing"]).to_pylist()
    got = [(r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"]) for r in rout]
    assert got == routing


def type_names(schema):
    # Parquet names the list item "element"; only the item type matters
    return {f.name: f"list<{f.type.value_type}>" if pa.types.is_list(f.type) else str(f.type) for f in schema}


def test_column_types_follow_schema(tmp_path):
    paths = DriftLogger(tmp_path, "types").log_step(0, **make_step())
    assert type_names(pq.read_schema(paths["tokens"])) == {
        "run": "string", "step": "int64", "sample": "int64", "pos": "int32", "token_id": "int32",
        "sampler_logprob": "double", "trainer_logprob": "double",
        "sampler_version": "int64", "trainer_version": "int64"}
    assert type_names(pq.read_schema(paths["routing"])) == {
        "run": "string", "step": "int64", "sample": "int64", "pos": "int32", "layer": "int32",
        "sampler_experts": "list<int32>", "trainer_experts": "list<int32>"}


def test_optional_columns_left_out_and_trainer_experts_null(tmp_path):
    d = make_step()
    paths = DriftLogger(tmp_path, "minimal").log_step(
        1, d["sampler_logprobs"], d["trainer_logprobs"], d["mask"].bool(), sampler_experts=d["sampler_experts"])
    assert pq.read_schema(paths["tokens"]).names == [
        "run", "step", "sample", "pos", "sampler_logprob", "trainer_logprob"]
    rout = pq.read_table(paths["routing"])
    assert rout["trainer_experts"].type == pa.list_(pa.int32())
    assert rout["trainer_experts"].null_count == len(rout) > 0
    # default sample ids are the row index b
    assert set(pq.read_table(paths["tokens"])["sample"].to_pylist()) <= set(range(5))
    assert "routing" not in DriftLogger(tmp_path, "no-routing").log_step(
        0, d["sampler_logprobs"], d["trainer_logprobs"], d["mask"])


def test_bf16_and_numpy_inputs(tmp_path):
    s = torch.tensor([[-0.5, -1.25]], dtype=torch.bfloat16)
    t = np.array([[-0.5, -1.0]], dtype=np.float32)
    paths = DriftLogger(tmp_path, "bf16").log_step(0, s, t, [[1, 1]])
    table = pq.read_table(paths["tokens"])
    assert table["sampler_logprob"].to_pylist() == [-0.5, -1.25]
    assert table["trainer_logprob"].to_pylist() == [-0.5, -1.0]


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_identical_inputs_give_identical_bytes(tmp_path):
    a = DriftLogger(tmp_path / "a", "same", {"x": 1}).log_step(2, **make_step())
    b = DriftLogger(tmp_path / "b", "same", {"x": 1}).log_step(2, **make_step())
    for kind in ("tokens", "routing"):
        assert sha(a[kind]) == sha(b[kind])
    assert (tmp_path / "a/same/run.json").read_bytes() == (tmp_path / "b/same/run.json").read_bytes()
    assert json.loads((tmp_path / "a/same/run.json").read_text()) == {"run": "same", "config": {"x": 1}}
    assert not list((tmp_path / "a/same").glob(".*"))  # no temporary file left behind


@pytest.mark.parametrize("name", ["bf16-baseline", "Qwen3-30B_A3B.r3", "run+1", "a=b", "7"])
def test_good_run_names_kept(name):
    assert safe_run_name(name) == name


@pytest.mark.parametrize("name, slug", [
    ("../etc", "etc"), ("a/b", "a-b"), ("a\\b", "a-b"), ("..", "run"), ("", "run"), (".hidden", "hidden"),
    ("my run", "my-run"), ("a..b", "a-b"), ("x" * 129, "x" * 128),
])
def test_unsafe_run_names_refused_with_a_suggestion(tmp_path, name, slug):
    with pytest.raises(ValueError) as err:
        DriftLogger(tmp_path, name)
    assert str(err.value) == (f"run name {name!r} cannot be used as a directory name: use letters, digits "
                              f"and '._+=-' (no path separators, no '..'), for example {slug!r}")
    assert list(tmp_path.iterdir()) == []


def test_bad_input_messages(tmp_path):
    log = DriftLogger(tmp_path, "bad")
    d = make_step()
    with pytest.raises(ValueError, match=r"trainer_logprobs: expected shape \[5, 7\], got \[5, 6\]"):
        log.log_step(0, d["sampler_logprobs"], d["trainer_logprobs"][:, :6], d["mask"])
    with pytest.raises(ValueError, match=r"sampler_experts: expected shape \[5, 7, L, K\], got \[5, 7, 3\]"):
        log.log_step(0, d["sampler_logprobs"], d["trainer_logprobs"], d["mask"],
                     sampler_experts=d["sampler_experts"][..., 0])
    positive = d["trainer_logprobs"].clone()
    positive[0, 0], mask = 0.5, torch.ones(5, 7)
    with pytest.raises(ValueError, match=r"trainer_logprobs\[0, 0\] = 0.5: a log-probability must be finite"):
        log.log_step(0, d["trainer_logprobs"], positive, mask)
    with pytest.raises(ValueError, match="step: expected an int >= 0, got -1"):
        log.log_step(-1, d["sampler_logprobs"], d["trainer_logprobs"], d["mask"])
    with pytest.raises(ValueError, match="sample_ids: expected distinct ids"):
        log.log_step(0, d["sampler_logprobs"], d["trainer_logprobs"], d["mask"], sample_ids=[1, 1, 2, 3, 4])
    assert not list((tmp_path / "bad").glob("*.parquet"))


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf"),
                                          (0.5, "0.5")])
@pytest.mark.parametrize("side", ["sampler_logprobs", "trainer_logprobs"])
def test_every_bad_log_prob_is_refused_and_a_masked_one_is_not(tmp_path, value, shown, side):
    log = DriftLogger(tmp_path, "bad")
    d = make_step()
    mask = torch.ones(5, 7)
    bad = {k: torch.where(d["mask"] != 0, d[k], -1.0) for k in ("sampler_logprobs", "trainer_logprobs")}
    bad[side][3, 4] = value
    with pytest.raises(ValueError, match=rf"{side}\[3, 4\] = {shown}: a log-probability must be finite and <= 0"):
        log.log_step(0, bad["sampler_logprobs"], bad["trainer_logprobs"], mask)
    assert not list((tmp_path / "bad").glob("*.parquet"))
    mask[3, 4] = 0  # padding may hold anything
    log.log_step(0, bad["sampler_logprobs"], bad["trainer_logprobs"], mask)
    assert list((tmp_path / "bad").glob("summary-step000000.parquet"))


def test_log_prob_check_equals_the_elementwise_rule():
    """_all_logprobs (a min/max over every value, then over the trained ones) against the rule itself, token by
    token: every trained value finite and <= 0, whatever the padding holds."""
    g = torch.Generator().manual_seed(5)
    choices = torch.tensor([-3.0, -0.0, 0.0, -1e-300, float("nan"), float("inf"), -float("inf"), 1e-300, 2.0],
                           dtype=torch.float64)
    for _ in range(400):
        shape = (int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g)))
        values = -torch.rand(shape, generator=g, dtype=torch.float64) * 5
        odd = torch.rand(shape, generator=g) < 0.15  # a few values from the edge cases
        values[odd] = choices[torch.randint(len(choices), shape, generator=g)][odd]
        mask = torch.rand(shape, generator=g) < 0.7
        want = all(math.isfinite(v) and v <= 0 for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m)
        assert _all_logprobs(values, mask) == want, (values, mask)
        assert _all_logprobs(values, mask, torch.empty_like(values)) == want


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 4), T=st.integers(1, 5), L=st.integers(1, 3), K=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_round_trip_any_shape(tmp_path_factory, B, T, L, K, seed):
    d = make_step(B, T, L, K, E=4, seed=seed)
    paths = DriftLogger(tmp_path_factory.mktemp("h"), "h").log_step(0, **d)
    tokens, routing = reference_rows(d)
    tok = pq.read_table(paths["tokens"])
    assert list(zip(tok["sample"].to_pylist(), tok["pos"].to_pylist(), tok["sampler_logprob"].to_pylist())) == \
        [(r[0], r[1], r[3]) for r in tokens]
    rout = pq.read_table(paths["routing"])
    assert rout["sampler_experts"].to_pylist() == [r[3] for r in routing]
    assert rout["layer"].to_pylist() == [r[2] for r in routing]
