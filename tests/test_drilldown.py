"""drilldown.*: one step's sequences and one sequence's tokens against the files' own numbers."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from analysis.metrics import drilldown

from helpers.reference import assert_close, ratio, ref_routing_rows


def test_worst_sequences_match_numpy(metrics_data):
    store, data = metrics_data
    df = drilldown.worst_sequences(store, "a", 1, n=3)
    assert df.columns == ["sample", "n_tokens", "seq_log_ratio", "seq_log_ratio_abs", "max_log_ratio_abs", "kl_k3",
                          "n_flips", "reward", "advantage", "response_length"]
    step = data.tokens.filter((pl.col("run") == "a") & (pl.col("step") == 1))
    flips = {}
    for r in ref_routing_rows(data.routing):
        if r[0] == "a" and r[1] == 1:
            flips[r[2]] = flips.get(r[2], 0) + int(r[6])
    ref = {}
    for (sample,), g in step.group_by(["sample"]):
        d = g["trainer_logprob"].to_numpy() - g["sampler_logprob"].to_numpy()
        ref[sample] = (len(d), d.sum(), abs(d.sum()), np.abs(d).max(), np.mean(ratio(d) - 1 - d))
    assert df["sample"].to_list() == sorted(ref, key=lambda k: -ref[k][2])[:3]
    for row in df.iter_rows(named=True):
        n, sd, sa, mx, k3 = ref[row["sample"]]
        assert row["n_tokens"] == n and row["n_flips"] == flips[row["sample"]]
        for col, want in (("seq_log_ratio", sd), ("seq_log_ratio_abs", sa), ("max_log_ratio_abs", mx),
                          ("kl_k3", k3)):
            assert_close(row[col], want, col)
    by_max = drilldown.worst_sequences(store, "a", 1, order="max_log_ratio_abs")
    assert by_max["max_log_ratio_abs"].is_sorted(descending=True) and by_max.height == len(ref)
    with pytest.raises(ValueError, match="order must be one of"):
        drilldown.worst_sequences(store, "a", 1, order="random")


def test_sequence_tokens_and_flip_grid(metrics_data):
    store, data = metrics_data
    df = drilldown.sequence_tokens(store, "b", 2, 3)
    assert df.columns == ["pos", "token_id", "token", "sampler_logprob", "trainer_logprob", "delta", "ratio",
                          "n_flipped_layers"]
    want = data.tokens.filter((pl.col("run") == "b") & (pl.col("step") == 2) & (pl.col("sample") == 3)).sort("pos")
    assert df["pos"].to_list() == want["pos"].to_list()
    d = want["trainer_logprob"].to_numpy() - want["sampler_logprob"].to_numpy()
    assert np.array_equal(df["delta"].to_numpy(), d)
    assert np.allclose(df["ratio"].to_numpy(), ratio(d), rtol=1e-15)
    grid = drilldown.sequence_flip_grid(store, "b", 2, 3)
    assert grid.columns == ["pos", "layer", "flip"]
    rows = [r for r in ref_routing_rows(data.routing) if r[:3] == ("b", 2, 3)]
    assert grid.height == len(rows)
    assert {(r[3], r[4]): r[6] for r in rows} == {(p, layer): f for p, layer, f in grid.iter_rows()}
    per_pos = grid.group_by("pos").agg(pl.col("flip").sum()).sort("pos")["flip"].to_list()
    assert df["n_flipped_layers"].to_list() == per_pos


def test_without_routing_flips_are_null(metrics_store_from):
    tokens = pl.DataFrame({"run": ["e"] * 2, "step": [3] * 2, "sample": [0] * 2, "pos": [0, 1],
                           "sampler_logprob": [-0.1, -0.2], "trainer_logprob": [-0.1, -0.3]})
    store = metrics_store_from(tokens)
    assert drilldown.worst_sequences(store, "e", 3)["n_flips"].to_list() == [None]
    assert drilldown.sequence_tokens(store, "e", 3, 0)["n_flipped_layers"].to_list() == [None, None]
    assert drilldown.sequence_flip_grid(store, "e", 3, 0).height == 0
    assert drilldown.run_steps(store, "e") == [3]
    assert drilldown.worst_sequences(store, "e", 4).height == 0


def test_run_steps(metrics_data):
    store, _ = metrics_data
    assert drilldown.run_steps(store, "a") == [0, 1, 2]
    assert drilldown.run_steps(store, "nope") == []
