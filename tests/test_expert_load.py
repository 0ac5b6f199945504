"""Every expert-load column (analysis/metrics/load.py) against a plain-Python reference of its definition at rel
1e-12, on seeded counts with zero-load experts, counts split over files, and contiguous, non-contiguous and
replicated placements; the CLI `load` verb prints the same table."""
from __future__ import annotations

import math

import numpy as np
import pytest

from analysis.metrics import load as L

from helpers.expert_load import close, ref_expert, ref_rank, ref_ranks, skewed_counts, write_counts

STEPS, LAYERS, EXPERTS = 5, 3, 8
ZERO = (2, 5)  # never routed: they count in the mean over all experts, not in the mean over those seen


@pytest.fixture()
def counts():
    sampler = skewed_counts(1, STEPS, LAYERS, EXPERTS, zero=ZERO)
    trainer = skewed_counts(2, STEPS, LAYERS, EXPERTS, zero=ZERO)
    trainer[1, 2] = 0  # a (step, layer) without trainer tokens: its trainer columns are null
    return sampler, trainer


def _check(df, sampler, trainer, slots_of_layer, n_ranks, n=EXPERTS, top_k=None):
    assert df.height == STEPS * LAYERS
    assert ("load_max_vio_primerl_sampler" in df.columns) == bool(top_k)
    for row in df.iter_rows(named=True):
        s, li = row["step"], row["layer"]
        for side, cube in (("sampler", sampler), ("trainer", trainer)):
            c = [float(x) for x in cube[s, li]] + [0.0] * (n - EXPERTS)
            for k, v in ref_expert(c, top_k).items():
                assert close(row[f"{k}_{side}"], v), (s, li, side, k, row[f"{k}_{side}"], v)
            if slots_of_layer is None:
                continue
            r = ref_ranks(c, slots_of_layer(li), n_ranks)
            for k, v in ref_rank(r).items():
                assert close(row[f"{k}_{side}"], v), (s, li, side, k)


def test_expert_columns_and_contiguous_ranks_from_config(tmp_path, counts):
    sampler, trainer = counts
    store = write_counts(tmp_path / "a.duckdb", "r", sampler, trainer, config={"n_experts": 10, "ep_size": 5,
                                                                                "top_k": 2}, split=True)
    df = L.load_table(store, "r")
    assert set(df["n_experts"].to_list()) == {10}  # two experts beyond the highest id seen, never routed
    _check(df, sampler, trainer, lambda li: list(range(10)), 5, n=10, top_k=2)
    assert df.filter((df["step"] == 1) & (df["layer"] == 2))["load_cv_trainer"].to_list() == [None]


def test_n_experts_seen_without_config_and_no_ranks(tmp_path, counts):
    sampler, trainer = counts
    store = write_counts(tmp_path / "a.duckdb", "r", sampler, trainer)
    df = L.load_table(store, "r")
    # ids 2 and 5 are never seen but lie below the highest id: "seen" counts up to the highest id
    assert set(df["n_experts"].to_list()) == {EXPERTS}
    assert "rank_imbalance_sampler" not in df.columns
    _check(df, sampler, trainer, None, 1)


def test_non_contiguous_replicated_placement(tmp_path, counts):
    sampler, trainer = counts
    store = write_counts(tmp_path / "a.duckdb", "r", sampler, trainer)
    rng = np.random.default_rng(7)
    # 12 slots over 4 ranks: every expert once, experts 0 and 3 twice more / once more, shuffled per layer
    slots = np.stack([rng.permutation(np.r_[np.arange(EXPERTS), [0, 0, 3, 7]]) for _ in range(LAYERS)])
    place = L.Placement(slots, 4, "given")
    df = L.load_table(store, "r", placement=place)
    _check(df, sampler, trainer, lambda li: [int(x) for x in slots[li]], 4)
    # the step-level straggler: Σ_layers max_r / Σ_layers mean_r
    for s in range(STEPS):
        mx = mean = 0.0
        for li in range(LAYERS):
            r = ref_ranks([float(x) for x in sampler[s, li]], [int(x) for x in slots[li]], 4)
            mx, mean = mx + max(r), mean + sum(r) / 4
        got = df.filter(df["step"] == s)["straggler_step_sampler"].unique().to_list()
        assert len(got) == 1 and math.isclose(got[0], mx / mean, rel_tol=1e-12)


def test_stored_placement_is_used(tmp_path, counts):
    sampler, trainer = counts
    store = write_counts(tmp_path / "a.duckdb", "r", sampler, trainer)
    slots = [[7, 6, 5, 4, 3, 2, 1, 0], [1, 0, 3, 2, 5, 4, 7, 6], [0, 2, 4, 6, 1, 3, 5, 7]]
    with store.transaction() as w:
        w.cur.executemany("INSERT INTO expert_placement VALUES ('r', ?, ?, ?, 2, 9)",
                          [(li, s, e) for li, row in enumerate(slots) for s, e in enumerate(row)])
    df = L.load_table(store, "r")
    _check(df, sampler, trainer, lambda li: slots[li], 2)


def test_hand_computed_case():
    c = np.array([[6.0, 2.0, 0.0, 0.0]])  # mean over 4 = 2, over the seen = 4
    got = {k: float(v[0]) for k, v in L.expert_columns(c, drop_k=1).items()}
    assert math.isclose(got["load_max_vio_primerl"], 2.0)  # 6 dropped: {2, 0, 0}, mean 2/3, (2 − 2/3) / (2/3)
    assert got["load_max_vio"] == 0.5 and got["load_max_vio_all"] == 2.0 and got["load_hot_experts"] == 1
    assert math.isclose(got["load_cv"], math.sqrt((16 + 0 + 4 + 4) / 4) / 2, rel_tol=1e-15)
    assert math.isclose(got["load_entropy_norm"], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4))
    r = L.rank_counts(c, np.array([0, 2, 1, 3]), 2)  # ranks hold {0, 2} and {1, 3}
    assert r.tolist() == [[6.0, 2.0]]
    assert L.rank_columns(r)["rank_imbalance"].tolist() == [0.5]  # 6 / 4 − 1


def test_bad_n_experts_is_refused(tmp_path, counts):
    sampler, trainer = counts
    store = write_counts(tmp_path / "a.duckdb", "r", sampler, trainer, config={"n_experts": 4})
    with pytest.raises(ValueError, match="expert id 7"):
        L.load_table(store, "r")
    with pytest.raises(ValueError, match="does not divide"):
        L.load_table(store, "r", n_experts=8, ep_size=3)
    with store.transaction() as w:
        w.execute("INSERT INTO runs (run, config) VALUES ('dense', '{}')")
    with pytest.raises(ValueError, match="has no expert load"):
        L.load_table(store, "dense")
    assert L.load_table(store, "r", steps=(100, 200), n_experts=8).is_empty()  # steps without load: no rows


def test_cli_load_prints_the_table(tmp_path, counts):
    import subprocess
    import sys

    import polars as pl
    sampler, trainer = counts
    write_counts(tmp_path / "a.duckdb", "r", sampler, trainer, config={"ep_size": 4}).close()
    out = subprocess.run([sys.executable, "-m", "analysis", "load", "--db", str(tmp_path / "a.duckdb"), "--run", "r",
                          "--steps", "1:3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import io
    df = pl.read_csv(io.StringIO(out.stdout))
    assert sorted(set(df["step"].to_list())) == [1, 2, 3]
    assert {"load_cv_sampler", "rank_balancedness_trainer", "straggler_step_sampler"} <= set(df.columns)
    bad = subprocess.run([sys.executable, "-m", "analysis", "load", "--db", str(tmp_path / "a.duckdb"), "--run", "r",
                          "--ep-size", "3"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not divide" in bad.stderr and "Traceback" not in bad.stderr
