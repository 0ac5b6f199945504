"""compare.config_diff / metric_deltas, and report.metrics_table's routing columns."""
from __future__ import annotations

import polars as pl
import pytest

from analysis.metrics import compare, report
from analysis.metrics.routing import routing_metrics
from analysis.metrics.token import token_metrics

from helpers.data import metrics_make_routing, metrics_make_tokens


@pytest.fixture
def two_runs(metrics_store_from):
    tokens = metrics_make_tokens(seed=21, runs=("x", "y", "z"), steps=(0, 1), n_seq=3, max_len=10)
    # run z has no routing at all
    rt = metrics_make_routing(tokens.filter(pl.col("run") != "z"), seed=22, layers=2)
    store = metrics_store_from(tokens, rt)
    store.set_run_config("x", {"model": {"dtype": "bf16", "layers": 2}, "lr": 1e-5, "seed": 1})
    store.set_run_config("y", {"model": {"dtype": "fp32", "layers": 2}, "lr": 1e-5})
    return store


def test_config_diff(two_runs):
    df = compare.config_diff(two_runs, ["x", "y"])
    assert df.columns == ["key", "x", "y"]
    assert df.rows() == [("model.dtype", "bf16", "fp32"), ("seed", "1", None)]
    full = compare.config_diff(two_runs, ["x", "y"], all_keys=True)
    assert full["key"].to_list() == ["lr", "model.dtype", "model.layers", "seed"]


def test_metric_deltas(two_runs):
    df = compare.metric_deltas(two_runs, ["x", "y", "z"], baseline="x")
    assert df.columns == ["metric", "baseline", "y", "z", "y_delta", "z_delta"]
    tm = token_metrics(two_runs, ["x", "y", "z"], by="run")
    rm = routing_metrics(two_runs, ["x", "y"], by="run")
    rows = {r["metric"]: r for r in df.iter_rows(named=True)}
    for m in ("kl_k3", "ess", "n_tokens", "chi2_seq"):
        # the table reads summaries, token_metrics the token rows: equal up to summation order
        x, y = tm.filter(pl.col("run") == "x")[m][0], tm.filter(pl.col("run") == "y")[m][0]
        assert rows[m]["baseline"] == pytest.approx(x, rel=1e-12) and rows[m]["y"] == pytest.approx(y, rel=1e-12)
        assert rows[m]["y_delta"] == rows[m]["y"] - rows[m]["baseline"]
    for m in ("flip_rate", "overlap", "token_any_flip_rate"):
        assert rows[m]["y"] == rm.filter(pl.col("run") == "y")[m][0]
        assert rows[m]["z"] is None and rows[m]["z_delta"] is None


def test_metrics_table_by_run_adds_flip_columns_only_with_routing(two_runs):
    df = report.metrics_table(two_runs, ["x", "z"], by="run")
    assert df.columns[-2:] == ["token_any_flip_rate", "flipped_layers_per_token"]
    assert df.filter(pl.col("run") == "z")["token_any_flip_rate"].to_list() == [None]
    assert df.filter(pl.col("run") == "x")["token_any_flip_rate"][0] is not None
    only_z = report.metrics_table(two_runs, ["z"], by="run")
    assert "token_any_flip_rate" not in only_z.columns
    assert report.metrics_table(two_runs, ["x"], by="layer").columns[:3] == ["run", "step", "layer"]
    with pytest.raises(ValueError):
        report.metrics_table(two_runs, ["x"], by="token")


def test_run_names_that_collide_with_columns_are_refused(two_runs):
    with pytest.raises(ValueError, match="collide"):
        compare.metric_deltas(two_runs, ["x", "metric"], baseline="x")
    with pytest.raises(ValueError, match="collides"):
        compare.config_diff(two_runs, ["x", "key"])


def test_metric_deltas_respect_the_step_range(two_runs):
    df = compare.metric_deltas(two_runs, ["x", "y"], baseline="x", steps=(1, 1))
    tm = token_metrics(two_runs, ["x", "y"], by="run", steps=(1, 1))
    rm = routing_metrics(two_runs, ["x", "y"], by="run", steps=(1, 1))
    rows = {r["metric"]: r for r in df.iter_rows(named=True)}
    for m in ("kl_k3", "n_tokens", "ratio_max"):  # summaries against token rows: up to summation order
        assert rows[m]["y"] == pytest.approx(tm.filter(pl.col("run") == "y")[m][0], rel=1e-12)
    assert rows["flip_rate"]["y"] == rm.filter(pl.col("run") == "y")["flip_rate"][0]
    full = {r["metric"]: r for r in compare.metric_deltas(two_runs, ["x", "y"], baseline="x").iter_rows(named=True)}
    assert rows["n_tokens"]["y"] < full["n_tokens"]["y"]


@pytest.mark.parametrize("runs, steps", [(["x", "y", "z"], None), (["z", "x"], (1, 1)), (["z"], None)])
def test_page_deltas_from_the_run_summary_equal_metric_deltas(two_runs, runs, steps):
    # the Compare page pivots the Overview's run summary instead of recomputing the token metrics
    from analysis.metrics import dashboard
    summary = dashboard.run_summary(two_runs, runs, cap=1.5, clip=0.1, steps=steps)
    rates = compare.routing_rates(two_runs, runs, steps=steps)
    page = compare.deltas_table(summary, rates, runs, runs[0])
    assert page.equals(compare.metric_deltas(two_runs, runs, runs[0], cap=1.5, clip=0.1, steps=steps))
    assert ("flip_rate" in page["metric"].to_list()) == (runs != ["z"])


@pytest.mark.parametrize("runs, steps", [(["x", "y", "z"], None), (["z"], None), (["y", "z"], (1, 1))])
def test_run_and_step_tables_equal_run_summary_and_step_metrics(two_runs, runs, steps):
    from analysis.metrics import dashboard
    tables = dashboard.run_and_step_tables(two_runs, runs, cap=1.5, clip=0.1, steps=steps)
    for key, one in (("run", dashboard.run_summary(two_runs, runs, cap=1.5, clip=0.1, steps=steps)),
                     ("step", dashboard.step_metrics(two_runs, runs, cap=1.5, clip=0.1, steps=steps))):
        got = tables[key]
        assert got.schema == one.schema and got.height == one.height
        for col in one.columns:
            for a, b in zip(got[col].to_list(), one[col].to_list()):
                assert a == b if not isinstance(a, float) else a == pytest.approx(b, rel=1e-12, abs=1e-15), col
    assert tables["run"]["token_any_flip_rate"].is_null().all() == (runs == ["z"])
