"""The precision floor (analysis/ingest/precision.py): found by content at ingest, recorded per file, and shown on
the Overview where a run's metric is below it."""
from __future__ import annotations

import numpy as np
import pytest

from analysis.ingest import ingest_paths
from analysis.ingest.precision import decimals, rounding_floor

from helpers.apptest import app_env, errors, open_app, overview_cards
from helpers.frameworks import write_primerl_traces


def test_decimals_of_rounded_and_whole_values():
    rng = np.random.default_rng(0)
    x = -rng.exponential(1.0, 500)
    for d in range(7):
        assert decimals(np.round(x, d) - 10.0 ** -d) == d  # never a multiple of 10^-(d-1) by chance here
    assert decimals(x) is None  # full double precision
    assert decimals(x.astype(np.float32)) is None  # float32 values are not decimals
    assert decimals(np.round(x[:10], 3)) is None  # too few values to tell
    assert decimals(np.r_[np.zeros(100), np.round(x[:20], 2)]) == 2  # zeros say nothing either way
    assert rounding_floor(4) == pytest.approx(5e-5, rel=1e-15)


def _table(path, decimals_written: int | None, n=64, seed=1):
    rng = np.random.default_rng(seed)
    s = -rng.exponential(1.0, n)
    t = s + rng.normal(0, 0.01, n)
    fmt = (lambda v: f"{v:.{decimals_written}f}") if decimals_written is not None else (lambda v: repr(float(v)))
    rows = [f"r,1,{i // 8},{i % 8},{fmt(min(a, 0.0))},{fmt(min(b, 0.0))}" for i, (a, b) in enumerate(zip(s, t))]
    path.write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n" + "\n".join(rows) + "\n")


@pytest.mark.parametrize("d, floor", [(3, 5e-4), (5, 5e-6), (None, None)])
def test_a_table_written_with_few_decimals_has_a_floor(tmp_path, store, d, floor):
    _table(tmp_path / "t.csv", d)
    (o,) = ingest_paths(store, [tmp_path / "t.csv"])
    assert o.status == "loaded", o.line()
    got = store.scalar("SELECT precision_floor FROM files")
    assert got == (pytest.approx(floor, rel=1e-12) if floor is not None else None)
    assert store.precision_floors() == ({"r": pytest.approx(floor, rel=1e-12)} if floor is not None else {})


@pytest.mark.slow  # a whole page in AppTest
def test_overview_labels_a_metric_below_the_floor(monkeypatch, tmp_path):
    from analysis.store import Store
    app_env(monkeypatch)
    db = tmp_path / "db" / "drift.duckdb"
    store = Store(db)
    tiny, _ = write_primerl_traces(tmp_path / "logs", run="tiny", steps=(1, 2), noise=1e-4, extra_files=False)
    large, _ = write_primerl_traces(tmp_path / "logs", run="large", steps=(1, 2), noise=0.05, extra_files=False,
                                    seed=1)
    assert all(o.status == "loaded" for o in ingest_paths(store, [tiny, large]))
    assert store.precision_floors() == {"tiny": 1e-6, "large": 1e-6}
    # kl_k3 from the stored rows by numpy: only the tiny run is below the floor
    kl = {run: float(np.mean(np.expm1(np.array(d)) - np.array(d))) for run, d in store.rows(
        "SELECT run, list(trainer_logprob - sampler_logprob) FROM tokens GROUP BY run")}
    assert kl["tiny"] < 1e-6 < kl["large"], kl
    store.close()
    at = open_app(monkeypatch, db, "pages/overview.py")
    at.multiselect(key="sidebar_runs").set_value(["tiny", "large"]).run()
    assert not at.exception and not errors(at), (at.exception, errors(at))
    below = [(card["run"], m["label"]) for card in overview_cards(at) for m in card["metrics"]
             if "below the log's precision (1e-6)" in m["captions"]]
    # one label: the tiny run's kl_k3 card (its max |Δ| and the large run's metrics are above 1e-6)
    assert below == [("tiny", "KL k3")], below
