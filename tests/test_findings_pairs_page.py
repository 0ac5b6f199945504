"""Compare's Pairs tab and the Findings page under AppTest: a run with its trainer-vs-trainer rerun and a replay
group (none, ids) show the trainer's mismatch with itself beside the engine's and what replay removed."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from helpers.apptest import app_env, errors, open_app, open_tab, texts
from helpers.data import metrics_db

pytestmark = pytest.mark.slow
CFG = {"model": "moe", "dtype": "bf16"}


def _run(run: str, seed: int, sd: float) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    n = 400
    s = -rng.exponential(1.5, n) - 0.5
    return pl.DataFrame({"run": run, "step": np.arange(n) // 100, "sample": (np.arange(n) // 20) % 5,
                         "pos": (np.arange(n) % 20).astype(np.int32), "sampler_logprob": s,
                         "trainer_logprob": s + rng.normal(0.0, sd, n)})


@pytest.fixture
def db(tmp_path, monkeypatch):
    app_env(monkeypatch)
    frames = [_run("eng", 1, 0.05), _run("eng-self", 2, 0.04), _run("live", 3, 0.2), _run("ids", 4, 0.05)]
    return metrics_db(tmp_path, pl.concat(frames), {"eng-self": {"pair_of": "eng", "pair_kind": "trainer_self"},
                                                    "live": CFG | {"replay": "none", "preset": "a"},
                                                    "ids": CFG | {"replay": "ids", "preset": "b"}})


def test_pairs_on_compare_and_findings(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/compare.py")
    at = open_tab(at, "compare_tab", "Pairs")
    assert not errors(at), errors(at)
    own, replay = (d.value for d in at.dataframe[-2:])
    assert list(own["run"]) == ["eng"] and list(own["trainer_self_run"]) == ["eng-self"]
    assert 0.3 < own["self_share"][0] < 1.0
    assert set(replay["run"]) == {"live", "ids"} and set(replay["replay"]) == {"none", "ids"}
    assert replay[replay["run"] == "ids"]["removed_share"].iloc[0] > 0.5
    at.switch_page("pages/findings.py").run()
    assert not errors(at), errors(at)
    md = texts(at.markdown).replace("\\", "")
    assert "trainer_self" in md and "Against partner runs" in md
    assert "ids replay removed" in md
