"""Hot experts (analysis/metrics/hot_experts.py): timeline, persistence, sampler-vs-trainer load difference, the
split by sequence tag (and "no tags logged" without the column), and the drift of tokens routed to hot experts,
each against a reference computed in Python from the rows the test wrote."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import hot_experts as H

from helpers.data import metrics_load, metrics_make_routing, metrics_make_tokens
from helpers.expert_load import skewed_counts, write_counts

E = 10


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    tokens = metrics_make_tokens(3, runs=("r",), steps=(0, 1, 2, 3), n_seq=6, max_len=30)
    routing = metrics_make_routing(tokens, 4, layers=3, k=2, n_experts=E)
    # make expert 0 hot everywhere: the first slot of a third of the rows goes to expert 0 (unless already in)
    rng = np.random.default_rng(0)
    s = routing["sampler_experts"].to_list()
    t = routing["trainer_experts"].to_list()
    for i in range(len(s)):
        if rng.random() < 0.4 and 0 not in s[i]:
            if t[i] == s[i] or sorted(t[i]) == sorted(s[i]):
                t[i] = [0 if x == s[i][0] else x for x in t[i]]
            s[i] = [0] + s[i][1:]
    routing = routing.with_columns(sampler_experts=pl.Series(s, dtype=pl.List(pl.Int32)),
                                   trainer_experts=pl.Series(t, dtype=pl.List(pl.Int32)))
    store = metrics_load(tmp_path_factory.mktemp("hot"), tokens, routing)
    return store, tokens, routing


def _ref_hot(routing: pl.DataFrame) -> dict:
    """{(step, layer): set of hot experts} of the sampler side, n = E experts."""
    counts: dict = {}
    for row in routing.iter_rows(named=True):
        for e in row["sampler_experts"]:
            counts.setdefault((row["step"], row["layer"]), [0] * E)[e] += 1
    return {k: {e for e, c in enumerate(v) if c > 2 * sum(v) / E} for k, v in counts.items()}


def test_timeline_and_persistence(routed):
    store, _, routing = routed
    store.set_run_config("r", {"n_experts": E})
    ref = _ref_hot(routing)
    tl = H.hot_timeline(store, "r")
    got = {}
    for row in tl.filter(pl.col("hot")).iter_rows(named=True):
        got.setdefault((row["step"], row["layer"]), set()).add(row["expert"])
    assert got == {k: v for k, v in ref.items() if v}
    per = H.persistence(tl)
    top = per.row(0, named=True)
    n_steps = len({k[0] for k in ref})
    want = sum(top["expert"] in ref[(s, top["layer"])] for s in range(n_steps)) / n_steps
    assert top["expert"] == 0 and math.isclose(top["hot_share"], want)


def test_side_difference(tmp_path):
    s = skewed_counts(1, 3, 2, 6)
    t = skewed_counts(2, 3, 2, 6)
    store = write_counts(tmp_path / "d.duckdb", "r", s, t)
    df = H.side_difference(store, "r")
    for row in df.iter_rows(named=True):
        a, b = s[row["step"], row["layer"]], t[row["step"], row["layer"]]
        want = 0.5 * sum(abs(x / a.sum() - y / b.sum()) for x, y in zip(a, b))
        assert math.isclose(row["load_tv"], want, rel_tol=1e-12)


def test_no_tags_logged(routed):
    store, _, _ = routed
    df, note = H.domain_load(store, "r")
    assert df.is_empty() and "no tags logged" in note


def test_domain_split_by_tag(routed, tmp_path):
    store, tokens, routing = routed
    tags = {(st, sa): ("code" if sa % 2 else "prose") for st, sa in
            tokens.select("step", "sample").unique().iter_rows()}
    with store.transaction() as w:  # the tag column a sequence log adds (issue 40)
        w.execute("ALTER TABLE sequences ADD COLUMN IF NOT EXISTS tag VARCHAR")
        w.cur.executemany("INSERT INTO sequences (run, step, sample, tag) VALUES ('r', ?, ?, ?)",
                          [(st, sa, tg) for (st, sa), tg in tags.items()])
    try:
        df, note = H.domain_load(store, "r", max_steps=2)
        chosen = sorted(set(tokens["step"].to_list()))
        chosen = [chosen[0], chosen[-1]]
        assert "2 of 4 steps" in note
        ref: dict = {}
        for row in routing.filter(pl.col("step").is_in(chosen)).iter_rows(named=True):
            for e in row["sampler_experts"]:
                key = (tags[(row["step"], row["sample"])], row["layer"], e)
                ref[key] = ref.get(key, 0) + 1
        assert {(r["tag"], r["layer"], r["expert"]): r["n"] for r in df.iter_rows(named=True)} == ref
        for (tag, layer), part in df.group_by("tag", "layer"):
            assert math.isclose(part["share"].sum(), 1.0)
    finally:
        with store.transaction() as w:
            w.execute("DELETE FROM sequences WHERE run = 'r'")
            w.execute("ALTER TABLE sequences DROP COLUMN tag")


def test_hot_drift(routed):
    store, tokens, routing = routed
    ref_hot = _ref_hot(routing)
    d = {(r["step"], r["sample"], r["pos"]): abs(r["trainer_logprob"] - r["sampler_logprob"])
         for r in tokens.iter_rows(named=True)}
    groups: dict = {True: [], False: []}
    for row in routing.iter_rows(named=True):
        hot = bool(set(row["sampler_experts"]) & ref_hot[(row["step"], row["layer"])])
        flip = set(row["sampler_experts"]) != set(row["trainer_experts"])
        groups[hot].append((flip, d[(row["step"], row["sample"], row["pos"])]))
    df, note = H.hot_drift(store, "r", n_experts=E)
    assert "all 4 steps" in note
    for row in df.iter_rows(named=True):
        g = groups[row["routed_to_hot"]]
        assert row["n_rows"] == len(g)
        assert math.isclose(row["flip_rate"], sum(f for f, _ in g) / len(g), rel_tol=1e-12)
        assert math.isclose(row["log_ratio_abs_mean"], sum(x for _, x in g) / len(g), rel_tol=1e-9)


def test_persistence_from_counts_equals_the_timeline_path(tmp_path):
    from analysis.metrics import load as L
    s = skewed_counts(3, 6, 3, 8, zero=(1,))
    s[2, 1] = 0  # a (step, layer) without tokens does not count as a step of that layer
    store = write_counts(tmp_path / "p.duckdb", "r", s)
    cube = L.counts_cube(store, "r")
    a = H.persistence(H.hot_timeline(store, "r"))
    b = H.persistence_of(cube.n["sampler"], cube.layers)
    assert a.columns == b.columns and a.height == b.height == 3 * 8
    for x, y in zip(a.iter_rows(), b.iter_rows()):
        assert x[:2] == y[:2] and x[4] == y[4]
        assert math.isclose(x[2], y[2], rel_tol=1e-12) and math.isclose(x[3], y[3], rel_tol=1e-12)
