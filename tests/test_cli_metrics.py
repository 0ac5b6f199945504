"""`python -m analysis metrics`: METRICS.md column names and the library's values, without importing torch."""
from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.metrics import report

from helpers.data import metrics_load, metrics_make_routing, metrics_make_tokens

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # each test starts `python -m analysis` in a subprocess


@pytest.fixture(scope="module")
def cli_db(tmp_path_factory):
    """A closed database file (the CLI opens it read-only) and the library's tables for it."""
    tmp = tmp_path_factory.mktemp("cli")
    tokens = metrics_make_tokens(seed=31, runs=("r1", "r2"), steps=(0, 1), n_seq=3, max_len=12)
    routing = metrics_make_routing(tokens, seed=32, layers=3)
    store = metrics_load(tmp, tokens, routing)
    want = {by: report.metrics_table(store, ["r1"], by=by) for by in ("step", "layer", "run")}
    store.close()
    return tmp / "t.duckdb", want, routing


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "analysis", "metrics", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(float(a), float(b), rel_tol=1e-15, abs_tol=0.0)


def _check_json(text: str, expected) -> None:
    rows = json.loads(text)
    assert list(rows[0]) == expected.columns
    assert len(rows) == expected.height
    for got, exp in zip(rows, expected.iter_rows(named=True)):
        for col, value in exp.items():
            assert got[col] == value if isinstance(value, str) else _same(got[col], value), (col, got[col], value)


@pytest.mark.parametrize("by", ["step", "layer"])
def test_json_equals_library(cli_db, by):
    db, want, _ = cli_db
    _check_json(_cli("--db", str(db), "--run", "r1", "--by", by, "--format", "json"), want[by])


def test_csv_has_metrics_md_columns(cli_db):
    db, want, _ = cli_db
    text = _cli("--db", str(db), "--run", "r1", "--by", "step")
    reader = csv.DictReader(io.StringIO(text))
    assert reader.fieldnames == ["run", "step", "n_tokens", "n_sequences", "kl_k1", "kl_k2", "kl_k3",
                                 "log_ratio_abs_mean", "log_ratio_abs_max", "prob_abs_diff_mean", "prob_abs_diff_max",
                                 "prob_pearson", "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "chi2_token",
                                 "ratio_frac_high", "ratio_frac_low", "clip_frac", "ess", "ppl_ratio", "chi2_seq",
                                 "seq_log_ratio_abs_max", "mult_prob_error", "kl_k3_reverse", "seq_geo_ratio_mean",
                                 "seq_geo_ratio_min", "seq_geo_ratio_max", "ratio_mean_se", "missing_mass",
                                 "logprob_slope", "logprob_slope_se", "lag_abs_delta_prev", "lag_abs_delta_next",
                                 "first_token_kl_share", "lattice_share_q", "boundary_low_share",
                                 "elsewhere_low_share", "topk_overlap", "top1_agree", "topk_mass_sampler", "topk_mass_trainer",
                                 "topk_kl_shared", "topk_tv_lower", "topk_tv_upper",
                                 "token_any_flip_rate", "flipped_layers_per_token"]
    rows = list(reader)
    assert [float(r["kl_k3"]) for r in rows] == pytest.approx(want["step"]["kl_k3"].to_list(), rel=1e-12)


def test_by_run_json_without_importing_torch(cli_db):
    """The by=run table through the real entry point, checking afterwards that torch was never imported."""
    db, want, _ = cli_db
    code = ("import runpy, sys\n"
            f"sys.argv = ['analysis', 'metrics', '--db', {str(db)!r}, '--run', 'r1', '--by', 'run', "
            "'--format', 'json']\n"
            "try:\n    runpy.run_module('analysis', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'metrics imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "token_any_flip_rate" in want["run"].columns
    _check_json(out.stdout, want["run"])


def test_unknown_run_is_an_error(cli_db, capsys):
    from analysis.__main__ import main
    db, _, _ = cli_db
    assert main(["metrics", "--db", str(db), "--run", "nope"]) == 1
    assert "no run named 'nope'" in capsys.readouterr().err


def test_by_step_has_the_token_flip_columns_of_a_numpy_reference(cli_db):
    """METRICS.md: token_any_flip_rate and flipped_layers_per_token per step, from the routing rows written."""
    db, _, routing = cli_db
    rows = json.loads(_cli("--db", str(db), "--run", "r1", "--by", "step", "--format", "json"))
    r1 = routing.filter(routing["run"] == "r1")
    steps, samples, pos = (r1[c].to_numpy() for c in ("step", "sample", "pos"))
    s = np.sort(np.array(r1["sampler_experts"].to_list()), axis=1)
    t = np.sort(np.array(r1["trainer_experts"].to_list()), axis=1)
    flip = (s != t).any(axis=1)
    assert 0 < flip.mean() < 1
    for row in rows:
        at = steps == row["step"]
        _, token = np.unique(np.stack([samples[at], pos[at]], axis=1), axis=0, return_inverse=True)
        per_token = np.bincount(token.ravel(), weights=flip[at])  # flipped layers of each token
        assert row["token_any_flip_rate"] == pytest.approx(float((per_token > 0).mean()), rel=1e-12)
        assert row["flipped_layers_per_token"] == pytest.approx(float(per_token.mean()), rel=1e-12)
    assert sorted(r["step"] for r in rows) == sorted(set(steps.tolist()))


def test_by_step_without_trainer_routing_has_no_flip_columns(tmp_path):
    tokens = metrics_make_tokens(seed=33, runs=("r1",), steps=(0, 1), n_seq=2, max_len=6)
    metrics_load(tmp_path, tokens, metrics_make_routing(tokens, seed=34, layers=2, trainer=False)).close()
    rows = json.loads(_cli("--db", str(tmp_path / "t.duckdb"), "--by", "step", "--format", "json"))
    assert len(rows) == 2 and "token_any_flip_rate" not in rows[0] and "kl_k3" in rows[0]


@pytest.mark.parametrize("command", [["metrics", "--by", "step"], ["runs"], ["findings"]])
def test_a_database_that_does_not_exist_is_named_and_not_created(tmp_path, command):
    missing = tmp_path / "nowhere.duckdb"
    out = subprocess.run([sys.executable, "-m", "analysis", *command, "--db", str(missing)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.startswith(f"error: no database at {missing}: one is made by loading logs into it"), out.stderr
    assert "Traceback" not in out.stderr and not missing.exists()
