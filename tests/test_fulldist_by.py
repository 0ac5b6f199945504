"""METRICS.md v3 full-distribution columns per tag and per response-length bucket (metrics.buckets.
full_distribution_by), with kl_k3 and mean |Δ| beside them: from DriftLogger's summaries at token_sample 1.0,
0.1 and 0.0 and from sequence JSON Lines, against brute-force references (tests/helpers/fulldist.py, reference.py)
at rel 1e-12."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from analysis.ingest import ingest_paths
from analysis.metrics.buckets import full_distribution_by
from analysis.record.fulldist import topk_sums, topk_sums_torch
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import fulldist

from helpers.fulldist import add_fulldist, sequence_lines, topk_terms
from helpers.logger import make_step
from helpers.reference import assert_close, ref_token_metrics

TOPK = ("topk_overlap", "top1_agree", "topk_mass_sampler", "topk_mass_trainer", "topk_kl_shared", "topk_tv_lower",
        "topk_tv_upper")
STEPS = (2, 5)
TAGS = ["code", "math", "chat", "code", "math", "code", "math", "chat", "code", "math"]


def steps() -> dict[int, dict]:
    return {n: add_fulldist(make_step(B=10, T=14, L=3, K=2, E=5, seed=n), seed=n) for n in STEPS}


def groups(data: dict[int, dict], key) -> dict:
    """{group: [(step, row)]} of the rows (sequences) with trained tokens, `key(step, row, length)` their group."""
    out: dict = {}
    for n, d in data.items():
        mask = d["mask"].numpy().astype(bool)
        for b in range(mask.shape[0]):
            length = int(np.flatnonzero(mask[b]).max()) + 1 if mask[b].any() else 0
            if length:
                out.setdefault(key(n, b, length), []).append((n, b))
    return out


def reference(data: dict[int, dict], members: list[tuple[int, int]]) -> dict:
    terms = {c: [] for c in TOPK}
    s, t, seq = [], [], []
    for n, b in members:
        d = data[n]
        for c, v in topk_terms(d, rows={b}).items():
            terms[c] += v
        m = d["mask"][b].bool()
        s += d["sampler_logprobs"][b][m].double().tolist()
        t += d["trainer_logprobs"][b][m].double().tolist()
        seq += [f"{n}|{b}"] * int(m.sum())
    ref = ref_token_metrics(np.array(s), np.array(t), np.array(seq))
    return {"n_sequences": len(members), "n_tokens": len(s), "n_topk": len(terms[TOPK[0]]),
            "kl_k3": ref["kl_k3"], "log_ratio_abs_mean": ref["log_ratio_abs_mean"]} | {
        c: math.fsum(v) / len(v) for c, v in terms.items()}


def check(store: Store, data: dict[int, dict]) -> None:
    by_tag = groups(data, lambda n, b, length: TAGS[b])
    by_len = groups(data, lambda n, b, length: length.bit_length())  # buckets 0, 1, 2–3, 4–7, ...
    for dim, ref in (("tag", by_tag), ("length", by_len)):
        df = full_distribution_by(store, ["r"], dim)
        got = {(row["label"] if dim == "tag" else row["bucket"]): row for row in df.to_dicts()}
        assert set(got) == set(ref), (dim, sorted(got), sorted(ref))
        for key, members in ref.items():
            want = reference(data, members)
            for c, v in want.items():
                if c.startswith("n_"):
                    assert got[key][c] == v, (dim, key, c)
                else:
                    assert_close(got[key][c], v, f"{dim} {key} {c}")
    df = full_distribution_by(store, ["r"], "length")
    assert df["label"].to_list() == [{2: "2–3", 3: "4–7", 4: "8–15"}.get(b, str(b)) for b in df["bucket"].to_list()]


@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
def test_logger_columns_by_tag_and_length_equal_reference(tmp_path, token_sample):
    data = steps()
    log = DriftLogger(tmp_path / "logs", "r", token_sample=token_sample, worst_sequences=1, top_tokens=3)
    for n, d in data.items():
        log.log_step(n, tags=TAGS, **d)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    check(store, data)


def test_sequence_jsonl_columns_by_tag_and_length_equal_reference(tmp_path):
    data = steps()
    lines = []
    for n, d in data.items():
        for b, line in enumerate(sequence_lines(d, n)):
            lines.append(json.dumps(json.loads(line) | {"tag": TAGS[b]}))
    path = tmp_path / "seqs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    store = Store(tmp_path / "db.duckdb")
    outcomes = ingest_paths(store, [path])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    check(store, data)


def test_runs_without_topk_or_tags(tmp_path):
    """Without top-k lists the buckets still come, with kl_k3 beside null topk_* columns; without tags, no tag rows."""
    data = {2: make_step(B=6, T=9, seed=2)}
    DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(2, **data[2])
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    assert full_distribution_by(store, ["r"], "tag").is_empty()
    df = full_distribution_by(store, ["r"], "length")
    assert not df.is_empty() and (df["n_topk"] == 0).all() and df["topk_overlap"].is_null().all()
    assert df["kl_k3"].is_not_null().all()
    with pytest.raises(ValueError, match="dimension"):
        full_distribution_by(store, ["r"], "prob")


def test_per_row_sums_of_cpu_pass_and_torch_ops_agree():
    """Each row's sums, by the CPU pass and by the torch ops, equal each other and add up to the step's sums."""
    d = steps()[5]
    args = (d["sampler_topk_ids"], d["sampler_topk_logprobs"].double(), d["trainer_topk_ids"],
            d["trainer_topk_logprobs"].double(), d["mask"].bool())
    B = d["mask"].shape[0]
    cpu, tch = np.zeros((B, fulldist.N_SUMS)), np.zeros((B, fulldist.N_SUMS))
    step_cpu = topk_sums(*args, per_row=cpu)
    step_torch = topk_sums_torch(*args, per_row=tch)
    np.testing.assert_allclose(cpu, tch, rtol=1e-12, atol=1e-15)
    for j, (name, v) in enumerate(step_cpu.items()):
        assert math.isclose(v, math.fsum(cpu[:, j]), rel_tol=1e-12), name
        assert math.isclose(step_torch[name], v, rel_tol=1e-12), name
    for b in range(B):  # a row's count is its trained positions
        assert cpu[b, 0] == int(d["mask"][b].sum())
    assert topk_sums(*args) == pytest.approx(step_cpu, rel=1e-12)
