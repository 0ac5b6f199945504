"""routing.* against brute-force Python set comparisons on the same files, plus the edge cases."""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from analysis.metrics import routing

from helpers.data import metrics_make_routing, metrics_make_tokens
from helpers.reference import (
    assert_close,
    assert_frame_matches,
    ratio,
    ref_routing_by_layer,
    ref_routing_rows,
    ref_token_flips,
)

LAYER_COLUMNS = ["run", "step", "layer", "n_tokens", "flip_rate", "top1_flip_rate", "overlap",
                 "load_max_vio_sampler", "load_max_vio_trainer", "weight_abs_diff_mean", "weight_abs_diff_max",
                 "margin_mean_sampler", "margin_mean_trainer"]


def test_by_layer_matches_reference(metrics_data):
    store, data = metrics_data
    df = routing.routing_metrics(store, ["a", "b"], by="layer")
    assert df.columns == LAYER_COLUMNS
    assert df["weight_abs_diff_mean"].null_count() == len(df)  # no weights logged (tests/test_fulldist.py has them)
    assert_frame_matches(df, ref_routing_by_layer(data.routing), ["run", "step", "layer"])


def _ref_coarse(data, keys):
    """by=step / by=run reference: pooled rates, mean of per-layer max_vio, per-token flip stats."""
    by_layer = ref_routing_by_layer(data.routing)
    rows = [r for r in ref_routing_rows(data.routing) if r[5]]
    flips = ref_token_flips(data.routing)
    idx = {"run": 0, "step": 1}
    out = defaultdict(dict)
    groups = defaultdict(list)
    for r in rows:
        groups[tuple(r[idx[k]] for k in keys)].append(r)
    for key, rs in groups.items():
        layer_vals = [v for (run, step, _), v in by_layer.items() if (run, step)[:len(keys)] == key]
        toks = [v for tk, v in flips.items() if tuple(tk[idx[k]] for k in keys) == key]
        out[key] = {
            "n_tokens": len(toks),
            "flip_rate": np.mean([r[6] for r in rs]), "top1_flip_rate": np.mean([r[7] for r in rs]),
            "overlap": np.mean([r[8] for r in rs]),
            "load_max_vio_sampler": np.mean([v["load_max_vio_sampler"] for v in layer_vals]),
            "load_max_vio_trainer": np.mean([v["load_max_vio_trainer"] for v in layer_vals]),
            "token_any_flip_rate": np.mean([v[0] for v in toks]),
            "flipped_layers_per_token": np.mean([v[1] for v in toks]),
        }
    return out


@pytest.mark.parametrize("by", ["step", "run"])
def test_by_step_and_run_match_reference(metrics_data, by):
    store, data = metrics_data
    keys = ["run", "step"] if by == "step" else ["run"]
    df = routing.routing_metrics(store, ["a", "b"], by=by)
    assert df.columns[:len(keys) + 8] == keys + ["n_tokens", "flip_rate", "top1_flip_rate", "overlap",
                                                  "load_max_vio_sampler", "load_max_vio_trainer",
                                                  "token_any_flip_rate", "flipped_layers_per_token"]
    assert_frame_matches(df, _ref_coarse(data, keys), keys)
    stats = routing.token_flip_stats(store, ["a", "b"], by=by)
    assert stats.columns == keys + ["n_tokens", "token_any_flip_rate", "flipped_layers_per_token"]
    assert_frame_matches(stats, _ref_coarse(data, keys), keys,
                         ["n_tokens", "token_any_flip_rate", "flipped_layers_per_token"])


def test_layer_profile_matches_reference(metrics_data):
    store, data = metrics_data
    df = routing.layer_profile(store, ["a"])
    assert df.columns == ["run", "layer", "n_tokens", "flip_rate", "top1_flip_rate", "overlap"]
    rows = [r for r in ref_routing_rows(data.routing) if r[5] and r[0] == "a"]
    assert df.height == len({r[4] for r in rows})
    for row in df.iter_rows(named=True):
        rs = [r for r in rows if r[4] == row["layer"]]
        assert row["n_tokens"] == len(rs)
        for col, i in (("flip_rate", 6), ("top1_flip_rate", 7), ("overlap", 8)):
            assert_close(row[col], float(np.mean([r[i] for r in rs])), col)


FIRST_SCHEMA = {"run": pl.String, "first_flip_layer": pl.Int32, "n_tokens": pl.Int64, "frac": pl.Float64}
MISMATCH_SCHEMA = {"run": pl.String, "flipped": pl.Boolean, "n_tokens": pl.Int64, "log_ratio_abs_mean": pl.Float64,
                   "kl_k3": pl.Float64}


def _token_d(data) -> dict[tuple, float]:
    return {(r["run"], r["step"], r["sample"], r["pos"]): r["trainer_logprob"] - r["sampler_logprob"]
            for r in data.tokens.iter_rows(named=True)}


def _check_first_and_mismatch(first: pl.DataFrame, mm: pl.DataFrame, data) -> None:
    flips = ref_token_flips(data.routing)
    assert dict(first.schema) == FIRST_SCHEMA
    for run in ("a", "b"):
        want = Counter(v[2] for k, v in flips.items() if k[0] == run and v[0])
        got = first.filter(pl.col("run") == run)
        assert dict(zip(got["first_flip_layer"], got["n_tokens"])) == dict(want)
        assert got["frac"].sum() == pytest.approx(1.0, rel=1e-12)
    keys = first.select("run", "first_flip_layer")
    assert keys.equals(keys.sort("run", "first_flip_layer"))

    assert dict(mm.schema) == MISMATCH_SCHEMA
    assert mm.select("run", "flipped").rows() == [("a", False), ("a", True), ("b", False), ("b", True)]
    tok = _token_d(data)
    for row in mm.iter_rows(named=True):
        d = np.array([tok[k] for k, v in flips.items() if k[0] == row["run"] and v[0] == row["flipped"]])
        assert row["n_tokens"] == len(d)
        assert_close(row["log_ratio_abs_mean"], float(np.mean(np.abs(d))), "log_ratio_abs_mean")
        assert_close(row["kl_k3"], float(np.mean(ratio(d) - 1 - d)), "kl_k3")


def test_first_flip_layer_and_flip_mismatch_match_reference(metrics_data):
    store, data = metrics_data
    _check_first_and_mismatch(routing.first_flip_layer(store, ["a", "b"]), routing.flip_mismatch(store, ["a", "b"]),
                              data)


def test_flip_views_match_reference_and_the_single_functions(metrics_data):
    """The page's path (one pass, several grouping sets) against the brute-force references and against the
    store-based functions (same columns, order and dtypes)."""
    store, data = metrics_data
    views = routing.flip_views(store, ["a", "b"], views=("step", "run", "first_flip", "mismatch"))
    for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
        stats = views[by]
        assert stats.columns == keys + ["n_tokens", "token_any_flip_rate", "flipped_layers_per_token"]
        assert_frame_matches(stats, _ref_coarse(data, keys), keys,
                             ["n_tokens", "token_any_flip_rate", "flipped_layers_per_token"])
        assert_frame_equal(stats, routing.token_flip_stats(store, ["a", "b"], by=by), rel_tol=1e-12)
    _check_first_and_mismatch(views["first_flip"], views["mismatch"], data)
    assert_frame_equal(views["first_flip"], routing.first_flip_layer(store, ["a", "b"]), rel_tol=1e-12)
    assert_frame_equal(views["mismatch"], routing.flip_mismatch(store, ["a", "b"]), rel_tol=1e-12)
    one = routing.flip_views(store, ["b"], steps=(1, 1))
    flips = ref_token_flips(data.routing)
    assert one["step"].rows()[0][:3] == ("b", 1, sum(1 for k in flips if k[:2] == ("b", 1)))
    with pytest.raises(ValueError, match="views must be"):
        routing.flip_views(store, ["a"], views=("layer",))
    with pytest.raises(ValueError, match="by must be one of"):
        routing.token_flip_stats(store, ["a"], by="layer")


def test_flip_views_of_nothing_keep_their_columns(metrics_data, metrics_store_from):
    store, _ = metrics_data
    tokens = metrics_make_tokens(seed=11, runs=("s",), steps=(0,), n_seq=2, max_len=6, optional=False)
    sampler_only = metrics_store_from(tokens, metrics_make_routing(tokens, seed=12, layers=3, trainer=False))
    for st, runs, steps in ((store, ["a", "b"], (50, 60)), (sampler_only, ["s"], None), (store, [], None)):
        views = routing.flip_views(st, runs, steps, views=("step", "run", "first_flip", "mismatch"))
        for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
            stats = views[by]
            assert stats.height == 0
            assert stats.columns == keys + ["n_tokens", "token_any_flip_rate", "flipped_layers_per_token"]
            assert stats.schema == routing.token_flip_stats(store, ["a"], by=by).schema
        assert views["first_flip"].height == 0 and dict(views["first_flip"].schema) == FIRST_SCHEMA
        assert views["mismatch"].height == 0 and dict(views["mismatch"].schema) == MISMATCH_SCHEMA


def test_expert_load_matches_reference(metrics_data):
    store, data = metrics_data
    df = routing.expert_load(store, "b", 1, 2)
    assert df.columns == ["expert", "n_sampler", "n_trainer", "frac_sampler", "frac_trainer"]
    sub = data.routing.filter((pl.col("run") == "b") & (pl.col("step") == 1) & (pl.col("layer") == 2))
    ns = Counter(e for x in sub["sampler_experts"] for e in x)
    nt = Counter(e for x in sub["trainer_experts"] for e in x)
    for row in df.iter_rows(named=True):
        e = row["expert"]
        assert (row["n_sampler"], row["n_trainer"]) == (ns[e], nt[e])
        assert_close(row["frac_sampler"], ns[e] / sum(ns.values()))
    assert set(df["expert"]) == set(ns) | set(nt)
    assert routing.expert_load(store, "b", 99, 2).height == 0


def _one_token_routing(experts_s, experts_t):
    tokens = pl.DataFrame({"run": ["e"], "step": [0], "sample": [0], "pos": [0],
                           "sampler_logprob": [-0.5], "trainer_logprob": [-0.5]})
    n = len(experts_s)
    rt = pl.DataFrame({"run": ["e"] * n, "step": [0] * n, "sample": [0] * n, "pos": [0] * n,
                       "layer": list(range(n)),
                       "sampler_experts": pl.Series(experts_s, dtype=pl.List(pl.Int32)),
                       "trainer_experts": pl.Series(experts_t, dtype=pl.List(pl.Int32))})
    return tokens, rt


def test_unsorted_equal_sets_are_not_flips(metrics_store_from):
    tokens, rt = _one_token_routing([[3, 7, 1], [0, 2, 4], [5, 6, 8]], [[7, 1, 3], [0, 2, 4], [6, 5, 9]])
    store = metrics_store_from(tokens, rt)
    df = routing.routing_metrics(store, ["e"], by="layer")
    assert df["flip_rate"].to_list() == [0.0, 0.0, 1.0]
    assert df["top1_flip_rate"].to_list() == [1.0, 0.0, 1.0]
    assert df["overlap"].to_list() == [1.0, 1.0, pytest.approx(2 / 3)]
    step = routing.routing_metrics(store, ["e"], by="step").row(0, named=True)
    assert step["token_any_flip_rate"] == 1.0 and step["flipped_layers_per_token"] == 1.0
    assert routing.first_flip_layer(store, ["e"])["first_flip_layer"].to_list() == [2]


def test_identical_routing_gives_zero_flip_rates(metrics_store_from):
    tokens, rt = _one_token_routing([[3, 7], [1, 2]], [[3, 7], [1, 2]])
    store = metrics_store_from(tokens, rt)
    df = routing.routing_metrics(store, ["e"], by="layer")
    assert df["flip_rate"].to_list() == [0.0, 0.0] and df["top1_flip_rate"].to_list() == [0.0, 0.0]
    assert df["overlap"].to_list() == [1.0, 1.0]
    assert df["load_max_vio_sampler"].to_list() == [0.0, 0.0]
    run = routing.routing_metrics(store, ["e"], by="run").row(0, named=True)
    assert run["token_any_flip_rate"] == 0.0 and run["flipped_layers_per_token"] == 0.0
    assert routing.first_flip_layer(store, ["e"]).height == 0
    assert routing.flip_mismatch(store, ["e"])["flipped"].to_list() == [False]


def test_sampler_only_routing_has_load_but_no_flips(metrics_store_from):
    tokens = metrics_make_tokens(seed=11, runs=("s",), steps=(0,), n_seq=2, max_len=6, optional=False)
    rt = metrics_make_routing(tokens, seed=12, layers=3, trainer=False)
    store = metrics_store_from(tokens, rt)
    df = routing.routing_metrics(store, ["s"], by="layer")
    assert df.height == 3 and df["n_tokens"].to_list() == [0, 0, 0]
    for col in ("flip_rate", "top1_flip_rate", "overlap", "load_max_vio_trainer"):
        assert df[col].null_count() == 3, col
    assert_frame_matches(df, ref_routing_by_layer(rt), ["run", "step", "layer"], ["load_max_vio_sampler"])
    step = routing.routing_metrics(store, ["s"], by="step").row(0, named=True)
    assert step["n_tokens"] == 0 and step["flip_rate"] is None and step["token_any_flip_rate"] is None
    assert step["load_max_vio_sampler"] is not None
    for fn in (routing.layer_profile, routing.token_flip_stats, routing.first_flip_layer, routing.flip_mismatch):
        assert fn(store, ["s"]).height == 0, fn.__name__


def test_mixed_sides_flip_columns_use_both_sided_rows_only(metrics_store_from):
    tokens = metrics_make_tokens(seed=13, runs=("m",), steps=(0,), n_seq=3, max_len=8, optional=False)
    rt = metrics_make_routing(tokens, seed=14, layers=2, flip_p=0.5)
    # drop the trainer side of every other row: those rows feed the load columns only
    t = rt["trainer_experts"].to_list()
    rt = rt.with_columns(trainer_experts=pl.Series([x if i % 2 else None for i, x in enumerate(t)],
                                                   dtype=pl.List(pl.Int32)))
    store = metrics_store_from(tokens, rt)
    df = routing.routing_metrics(store, ["m"], by="layer")
    assert_frame_matches(df, ref_routing_by_layer(rt), ["run", "step", "layer"])


def test_empty_step_range_gives_no_rows(metrics_data):
    store, _ = metrics_data
    for by in ("layer", "step", "run"):
        assert routing.routing_metrics(store, ["a"], by=by, steps=(50, 60)).height == 0
    with pytest.raises(ValueError, match="by must be one of"):
        routing.routing_metrics(store, ["a"], by="token")


@pytest.mark.parametrize("by", ["step", "run"])
def test_pooled_rates_without_the_token_pass_are_the_same(metrics_data, by):
    store, _ = metrics_data
    full = routing.routing_metrics(store, ["a", "b"], by=by, steps=(1, 2))
    light = routing.routing_metrics(store, ["a", "b"], by=by, steps=(1, 2), token_flips=False)
    keys = ["run", "step"] if by == "step" else ["run"]
    cols = keys + ["flip_rate", "top1_flip_rate", "overlap", "load_max_vio_sampler", "load_max_vio_trainer", "n_rows"]
    assert light.columns == cols
    assert_frame_equal(light, full.select(cols), rel_tol=1e-12)
