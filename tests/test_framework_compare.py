"""Your framework's numbers (analysis/metrics/frameworks/compare.py): each side's value is the one its own table
gives, and "same definition" stands exactly where the two agree."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import read
from analysis.metrics.frameworks import FRAMEWORKS, framework_table, ours
from analysis.metrics.frameworks.compare import CAP, COLUMNS, PAIRS, PER_SAMPLE, SAME, comparison


def _equal_length(seed: int) -> pl.DataFrame:
    """Every sequence 16 tokens, |Δ| < 20: slime's per-sample mean is the token mean."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(2):
        for sample in range(4):
            s = -rng.exponential(1.5, 16) - 1.0
            t = s + rng.normal(0.0, 0.3, 16).clip(-0.9, 0.9)
            rows.append(pl.DataFrame({"run": "eq", "step": step, "sample": sample, "pos": np.arange(16),
                                      "sampler_logprob": s, "trainer_logprob": t}))
    return pl.concat(rows)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from helpers.data import metrics_load, metrics_make_tokens
    tokens = metrics_make_tokens(7, runs=("uneq",), optional=False)  # lengths 1..40
    store = metrics_load(tmp_path_factory.mktemp("fw_compare"), pl.concat([tokens, _equal_length(8)], how="vertical_relaxed"))
    yield store, comparison(store, ["uneq", "eq"])
    store.close()


def _close(a, b) -> bool:
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return (a is None or math.isnan(a)) and (b is None or math.isnan(b))
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)


def test_every_side_is_its_own_tables_value(data):
    store, table = data
    assert tuple(table.columns) == COLUMNS
    assert table.height == 2 * len([p for p in PAIRS if not p.routing])  # no routing in these runs
    assert set(table["framework"].str.split(" ").list.first()) == set(FRAMEWORKS)
    mine = {r["run"]: r for r in read.token_table(store, ["uneq", "eq"], by="run", cap=CAP).iter_rows(named=True)}
    for r in ours.more_token_columns(store, ["uneq", "eq"], by="run", cap=CAP).iter_rows(named=True):
        mine[r["run"]] |= r
    by_label = {p.label: p for p in PAIRS}
    for row in table.iter_rows(named=True):
        p = by_label[row["framework"]]
        theirs = framework_table(store, [row["run"]], p.framework, by="run", params=p.params).row(0, named=True)
        assert _close(row["theirs_value"], theirs[row["their_column"]]), row
        assert _close(row["ours_value"], mine[row["run"]][row["ours"]]), row


def test_same_definition_exactly_where_the_values_agree(data):
    _, table = data
    reasons = {(p.quantity, p.ours, p.label, p.theirs): p.reason for p in PAIRS}
    for row in table.iter_rows(named=True):
        a, b = row["ours_value"], row["theirs_value"]
        equal = abs(a - b) <= 1e-9 * max(abs(a), abs(b))
        want = SAME if equal else reasons[(row["quantity"], row["ours"], row["framework"], row["their_column"])]
        assert row["reason"] == want, row
    assert (table["reason"] == SAME).any() and (table["reason"] != SAME).any()


def test_unequal_lengths_move_slimes_abs_diff_with_the_per_sample_reason(data):
    _, table = data
    rows = table.filter(pl.col("their_column") == "train_rollout_logprob_abs_diff")
    got = dict(zip(rows["run"], rows["reason"]))
    assert got == {"uneq": PER_SAMPLE, "eq": SAME}
    # verl's clamp to [1/C, C] moves the std wherever some r leaves the band
    std = table.filter((pl.col("ours") == "ratio_std") & (pl.col("run") == "uneq")).row(0, named=True)
    assert std["reason"].startswith("verl clamps r") and std["theirs_value"] < std["ours_value"]


def test_a_step_range_without_tokens_gives_no_rows(data):
    store, _ = data
    empty = comparison(store, ["eq"], steps=(50, 60))
    assert empty.is_empty() and tuple(empty.columns) == COLUMNS


def test_prime_rls_max_vio_beside_ours_where_a_run_has_routing(tmp_path):
    """prime-rl drops the top_k most-loaded experts and counts every expert of the model: on routing where some
    expert gets no token and the load is uneven, its max_vio differs from ours, with that reason."""
    from helpers.data import metrics_load, metrics_make_routing, metrics_make_tokens
    from analysis.metrics import routing
    tokens = metrics_make_tokens(9, runs=("moe",), optional=False)
    store = metrics_load(tmp_path / "moe", tokens, metrics_make_routing(tokens, 3, layers=2, k=2, n_experts=6))
    table = comparison(store, ["moe"])
    row = table.filter(pl.col("their_column") == "max_vio/mean").row(0, named=True)
    ours_value = routing.routing_metrics(store, ["moe"], by="run", token_flips=False)["load_max_vio_trainer"][0]
    theirs = framework_table(store, ["moe"], "prime-rl", by="run")["max_vio/mean"][0]
    assert _close(row["ours_value"], ours_value) and _close(row["theirs_value"], theirs)
    assert row["reason"].startswith("prime-rl drops the top_k") and not _close(ours_value, theirs)
    store.close()
