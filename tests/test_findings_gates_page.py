"""The Findings page's Gates tab under AppTest with corridors and the band of a configuration: two baseline runs,
a run whose one outlier token trips the max |Δ| gate, peers of one configuration; the cards tab then shows the
corridor finding."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from helpers.apptest import app_env, errors, open_app, open_tab, texts
from helpers.data import metrics_db

pytestmark = pytest.mark.slow
CFG = {"model": "m", "dtype": "bf16", "engine": "vllm"}


def _run(run: str, seed: int, sd: float, outlier: bool = False) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n = 400
    s = -rng.exponential(1.5, n) - 0.5
    d = rng.normal(0.0, sd, n)
    if outlier:
        s[17], d[17] = -6.0, 5.0
    return pl.DataFrame({"run": run, "step": np.arange(n) // 100, "sample": (np.arange(n) // 20) % 5,
                         "pos": (np.arange(n) % 20).astype(np.int32), "sampler_logprob": s, "trainer_logprob": s + d})


@pytest.fixture
def db(tmp_path, monkeypatch):
    app_env(monkeypatch)
    frames = [_run("base1", 1, 0.05), _run("base2", 2, 0.05), _run("base3", 3, 0.05), _run("spiky", 4, 0.05, True)]
    return metrics_db(tmp_path, pl.concat(frames), {run: CFG for run in ("base1", "base2", "base3", "spiky")})


def test_gates_tab_shows_corridors_and_the_configuration_band(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/findings.py")
    at = open_tab(at, "findings_tab", "Gates")
    assert not errors(at), errors(at)
    assert len(at.dataframe) == 2  # the band, then the published gates (AppTest lists dataframes without keys)
    band = at.dataframe[0].value
    assert set(band["run"]) == {"base1", "base2", "base3", "spiky"} and set(band["n_peers"]) == {3}
    row = band[(band["run"] == "spiky") & (band["metric"] == "log_ratio_abs_max")]
    assert list(row["position"]) == ["above"]  # max |Δ| = 5 against peers near 0.15
    at.multiselect(key="findings_baselines").set_value(["base1", "base2"]).run()
    assert not errors(at), errors(at)
    assert len(at.dataframe) == 3
    corridor = at.dataframe[0].value
    spiky = corridor[(corridor["run"] == "spiky") & (corridor["metric"] == "log_ratio_abs_max")]
    assert list(spiky["status"]) == ["fail"] and list(spiky["n_beyond_max"]) == [1]
    base3 = corridor[(corridor["run"] == "base3") & (corridor["metric"] == "log_ratio_abs_mean")]
    assert list(base3["status"]) == ["pass"]
    assert set(at.dataframe[-1].value["gate"]) >= {"prime-rl mismatch KL"}  # the published gates stay last
    at = open_tab(at, "findings_tab", "Findings")  # the cards read the same baselines
    assert not errors(at)
    assert "outlier tokens, not the distribution" in texts(at.markdown).replace("\\", "")
