"""Acceptance of the logging checks on runs made with a small transformers model (tests/helpers/lm_runs.py): processed
sampler log-probs (top-k, top-p, temperature, a combination) fire `sampling_params`, a one-position shift fires
`position_shift`, the raw control (bf16 sampler, fp32 trainer) fires neither, and neither fires on the bundled demo
presets; the same from token rows and from a summaries-only copy (DriftLogger, token_sample 0) of each."""
from __future__ import annotations

import warnings

import polars as pl
import pyarrow.parquet as pq
import pytest

from analysis.findings import ranking
from analysis.ingest import ingest_paths
from analysis.metrics import read
from analysis.store import Store

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import lm_runs  # noqa: E402 (needs torch and transformers)

CHECK_KINDS = {"position_shift", "sampling_params"}
FIRES = {"control": None, "top-k": {"truncation"}, "top-p": {"truncation"}, "temperature": {"temperature"},
         "combination": {"truncation", "temperature"}, "shifted": "position_shift"}


def load(store_path, paths) -> Store:
    store = Store(store_path)
    outcomes = ingest_paths(store, paths)
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store


def summaries_only(folder, run: str, s, t, per: int, versions=None) -> None:
    """The run logged again by DriftLogger with token_sample 0: summary files only, `per` sequences a step."""
    from analysis.record import DriftLogger

    log = DriftLogger(folder, run, token_sample=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the logger's own early warning is tested below
        for step, lo in enumerate(range(0, s.shape[0], per)):
            extra = {} if versions is None else {k: v[lo:lo + per] for k, v in versions.items()}
            log.log_step(step, s[lo:lo + per], t[lo:lo + per], torch.ones_like(s[lo:lo + per]), **extra)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """{"tokens": Store of the token rows, "summaries": Store of the summaries-only copies}, and the runs."""
    runs = lm_runs.make_runs()
    tmp = tmp_path_factory.mktemp("lm")
    pl.concat([r.frame(name) for name, r in runs.items()]).write_parquet(tmp / "tokens.parquet")
    for name, r in runs.items():
        summaries_only(tmp / "logs", name, r.s, r.t, lm_runs.BATCH // lm_runs.STEPS)
    stores = {"tokens": load(tmp / "tokens.duckdb", [tmp / "tokens.parquet"]),
              "summaries": load(tmp / "summaries.duckdb", [tmp / "logs"])}
    assert stores["summaries"].scalar("SELECT count(*) FROM tokens") == 0
    yield stores, runs
    for store in stores.values():
        store.close()


@pytest.mark.parametrize("source", ["tokens", "summaries"])
def test_processed_and_shifted_runs_fire_and_the_control_does_not(lm, source):
    stores, runs = lm
    found = ranking.findings_many(stores[source], list(runs))
    for run, want in FIRES.items():
        kinds = [f.kind for f in found[run]]
        if want is None:
            assert not CHECK_KINDS & set(kinds), (run, kinds)
            continue
        first = found[run][0]
        assert first.severity == "alert", (run, kinds)
        if want == "position_shift":
            assert first.kind == "position_shift" and "sampling_params" not in kinds, (run, kinds)
        else:
            assert first.kind == "sampling_params" and set(first.numbers["cases"]) == want, (run, first.numbers)
            assert "position_shift" not in kinds


def test_summaries_only_copy_gives_the_token_rows_numbers(lm):
    stores, runs = lm
    cols = ["run", "n_tokens", "log_ratio_abs_mean", "ratio_mean_se", "missing_mass", "logprob_slope",
            "logprob_slope_se", "lag_abs_delta_prev", "lag_abs_delta_next"]
    a = read.token_table(stores["tokens"], list(runs), by="run").select(cols)
    b = read.token_table(stores["summaries"], list(runs), by="run").select(cols)
    assert a["run"].to_list() == b["run"].to_list() and a["n_tokens"].to_list() == b["n_tokens"].to_list()
    for col in cols[2:]:
        for x, y in zip(a[col].to_list(), b[col].to_list()):
            assert x == pytest.approx(y, rel=1e-12), col


def test_driftlogger_warns_on_processed_logprobs_only(lm, tmp_path):
    from analysis.record import DriftLogger
    from analysis.record.checks import LoggingCheckWarning

    _, runs = lm
    for name in ("control", "top-p", "temperature", "shifted"):
        r = runs[name]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DriftLogger(tmp_path, name, token_sample=0.0).log_step(0, r.s, r.t, torch.ones_like(r.s))
        got = [str(w.message) for w in caught if issubclass(w.category, LoggingCheckWarning)]
        assert len(got) == (0 if name == "control" else 1), (name, got)
        if name == "shifted":
            assert "shifted by one position" in got[0]
        elif name != "control":
            assert ("top-p / top-k" if name == "top-p" else "temperature") in got[0]


def test_demo_presets_fire_neither(tmp_path):
    """The bundled demo runs (the drift lab's presets: dtypes, fp32 head, routing replay, staleness, corrections):
    as shipped (DriftLogger's summary files, whose check sums the trainer side computed), and their token rows
    alone, summarised by ingest."""
    from analysis.ingest.demo import DEMO_DIR

    plain = tmp_path / "plain"
    presets = sorted(p for p in DEMO_DIR.iterdir() if p.is_dir())
    for folder in presets:
        (plain / folder.name).mkdir(parents=True)
        for f in sorted(folder.glob("tokens-*.parquet")):
            pq.write_table(pq.read_table(f).replace_schema_metadata({}), plain / folder.name / f.name)
    runs = [p.name for p in presets]
    assert len(runs) >= 7
    for store in (load(tmp_path / "tokens.duckdb", [plain / r for r in runs]),
                  load(tmp_path / "shipped.duckdb", presets)):
        for run, found in ranking.findings_many(store, runs).items():
            assert not CHECK_KINDS & {f.kind for f in found}, (run, [f.title for f in found])
        assert read.token_table(store, runs, by="run")["logprob_slope"].null_count() == 0
        store.close()
