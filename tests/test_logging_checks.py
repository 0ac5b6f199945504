"""The logging checks (METRICS.md "Logging checks", analysis/summaries/checks.py): each column equals an
extended-precision numpy reference at rel 1e-12 from summaries (streamed, SQL, split across files, DriftLogger,
lake) and from token rows; databases and summary files made before the check sums read as null; the rules fire on
runs sampled from processed distributions (truncation, temperature) and on shifted log-probs, not on honest ones;
the findings rank them first; DriftLogger warns once."""
from __future__ import annotations

import math
import warnings

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from analysis.findings import ranking
from analysis.ingest import ingest_paths
from analysis.ingest.limits import Limits
from analysis.metrics import read
from analysis.metrics import token as metrics
from analysis.store import Store
from analysis.summaries import checks, kernel
from analysis.summaries import schema as S
from analysis.summaries.checks import CheckSums

from helpers.data import metrics_make_tokens
from helpers.sampling import synthetic_run
from helpers.ingest import summaries_by_sql

L = np.longdouble
RTOL = 1e-12
CHECKS = list(metrics.CHECK_METRICS)


# -- the reference ----------------------------------------------------------------------------------------------

def ref_checks(g: pl.DataFrame) -> dict:
    """The check columns of one group of token rows, from METRICS.md's definitions, in extended precision."""
    s64, t64 = g["sampler_logprob"].to_numpy(), g["trainer_logprob"].to_numpy()
    d = (t64 - s64).astype(L)  # Δ as stored: one float64 subtraction
    s, t = s64.astype(L), t64.astype(L)
    r = np.exp(np.clip(d, -20, 20))
    n = len(s)
    var_s = np.mean((s - s.mean()) ** 2)
    cov = np.mean((s - s.mean()) * (t - t.mean()))
    slope = cov / var_s
    resid = (t - t.mean()) - slope * (s - s.mean())
    prev, nxt = [], []
    for _, q in g.group_by(["run", "step", "sample"]):
        q = q.sort("pos")
        p = q["pos"].to_numpy()
        qs, qt = q["sampler_logprob"].to_numpy().astype(L), q["trainer_logprob"].to_numpy().astype(L)
        adj = p[1:] == p[:-1] + 1
        prev += list(np.abs(qt[1:] - qs[:-1])[adj])
        nxt += list(np.abs(qt[:-1] - qs[1:])[adj])
    out = {"ratio_mean_se": np.sqrt(np.sum((r - r.mean()) ** 2) / (n - 1) / n),
           "missing_mass": -np.mean(r - 1), "logprob_slope": slope,
           "logprob_slope_se": np.sqrt(np.sum(resid ** 2) / (n - 2) / (n * var_s)),
           "lag_abs_delta_prev": np.mean(prev) if prev else None, "lag_abs_delta_next": np.mean(nxt) if nxt else None}
    return {k: None if v is None else float(v) for k, v in out.items()}


def assert_checks(df: pl.DataFrame, tokens: pl.DataFrame, keys: list[str], what: str) -> None:
    groups = dict(((tuple(k), g) for k, g in tokens.group_by(keys, maintain_order=True)))
    assert df.height == len(groups), (what, df.height, len(groups))
    for row in df.iter_rows(named=True):
        want = ref_checks(groups[tuple(row[k] for k in keys)])
        for col, w in want.items():
            got = row[col]
            assert (got is None) == (w is None), (what, col, got, w)
            if w is not None:
                assert math.isclose(got, w, rel_tol=RTOL), (what, tuple(row[k] for k in keys), col, got, w)


def gappy_tokens(seed: int = 3) -> pl.DataFrame:
    """Seeded tokens (variable lengths, heavy tails) with a tenth of the positions missing: not every token has
    both neighbours."""
    tok = metrics_make_tokens(seed=seed, runs=("a", "b"), steps=(0, 1, 2), n_seq=7, optional=False)
    keep = np.random.default_rng(seed).random(tok.height) > 0.1
    return tok.filter(pl.Series(keep))


def load_files(tmp_path, name: str, parts: list[pl.DataFrame], limits: Limits | None = None) -> Store:
    folder = tmp_path / name
    folder.mkdir()
    paths = []
    for i, df in enumerate(parts):
        paths.append(folder / f"tokens{i}.parquet")
        df.write_parquet(paths[-1])
    store = Store(tmp_path / f"{name}.duckdb")
    outcomes = ingest_paths(store, paths, limits=limits)
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store


def shuffled_within_steps(tok: pl.DataFrame, seed: int) -> pl.DataFrame:
    """Every step's tokens in random order (steps still in order)."""
    rng = np.random.default_rng(seed)
    return tok.with_columns(_o=pl.Series(rng.random(tok.height))).sort("run", "step", "_o").drop("_o")


# -- from summaries and from tokens: numpy at rel 1e-12 ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["streamed", "sql", "split by position", "interleaved", "shuffled batches"])
def test_check_columns_equal_numpy_from_summaries_and_from_tokens(tmp_path, monkeypatch, layout):
    """Every writer of the check sums: the streamed kernel (whole file, or shuffled tokens in batches of 37 rows),
    the SQL, and a sequence's tokens spread over two files (by position range, or odd and even positions: every
    pair then spans the files)."""
    tok = gappy_tokens()
    summaries_by_sql(monkeypatch, layout == "sql")
    if layout == "split by position":
        parts = [tok.filter(pl.col("pos") < 7), tok.filter(pl.col("pos") >= 7)]
    elif layout == "interleaved":
        parts = [tok.filter(pl.col("pos") % 2 == 0), tok.filter(pl.col("pos") % 2 == 1)]
    elif layout == "shuffled batches":
        parts = [shuffled_within_steps(tok, 1)]
    else:
        parts = [tok]
    store = load_files(tmp_path, "db", parts, Limits(batch_rows=37) if layout == "shuffled batches" else None)
    for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
        assert_checks(read.token_table(store, ["a", "b"], by=by), tok, keys, f"{layout}, summaries by {by}")
        assert_checks(metrics.token_metrics(store, ["a", "b"], by=by), tok, keys, f"{layout}, tokens by {by}")
    store.close()


def test_check_sums_of_batches_in_any_order_equal_one_sorted_pass():
    """CheckSums (the stream's): batches cut anywhere, tokens in any order, equal the sums of one sorted pass."""
    tok = gappy_tokens(seed=8).filter(pl.col("run") == "a")
    one = CheckSums()
    assert one.add(*(tok[c].to_numpy() for c in ("sampler_logprob", "trainer_logprob", "pos")),
                   tok["step"].to_numpy() * 100 + tok["sample"].to_numpy())
    mixed = shuffled_within_steps(tok, 4)
    many = CheckSums()
    for lo in range(0, mixed.height, 29):
        part = mixed.slice(lo, 29)
        assert many.add(*(part[c].to_numpy() for c in ("sampler_logprob", "trainer_logprob", "pos")),
                        part["step"].to_numpy() * 100 + part["sample"].to_numpy())
    a, b = one.row(), many.row()
    assert a["n_adj"] == b["n_adj"] > 0 and a["n_check_tokens"] == b["n_check_tokens"] == tok.height
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=1e-13), k


def test_driftlogger_and_summaries_only_copy_give_the_checks(tmp_path):
    """DriftLogger's summaries ([B, T] with padding anywhere, token_sample 0: no token row at all) give the
    columns of the masked tokens, as numpy does; so does `summarize` of a lake written by DriftLogger."""
    torch = pytest.importorskip("torch")
    from analysis.__main__ import main
    from analysis.record import DriftLogger

    g = torch.Generator().manual_seed(5)
    B, T = 9, 31
    mask = torch.rand(B, T, generator=g) < 0.85
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    t = (s + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2).clamp(max=0.0)
    s[~mask] = float("nan")  # padding holds anything
    rows = [{"run": "r", "step": step, "sample": b, "pos": p, "sampler_logprob": float(s[b, p]) - step * 0.01,
             "trainer_logprob": float(t[b, p])} for step in (0, 1) for b in range(B) for p in range(T) if mask[b, p]]
    tok = pl.DataFrame(rows)
    log = DriftLogger(tmp_path / "logs", "r", token_sample=0.0)
    lake = DriftLogger(tmp_path / "lake", "r", layout="lake")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random log-probs: the checks fire, which is not under test here
        for step in (0, 1):
            for logger in (log, lake):
                logger.log_step(step, s - step * 0.01, t, mask)
    assert main(["summarize", str(tmp_path / "lake"), "--out", str(tmp_path / "lake-out")]) == 0
    for name, path in (("logger", tmp_path / "logs"), ("lake", tmp_path / "lake-out")):
        store = Store(tmp_path / f"{name}.duckdb")
        assert {o.status for o in ingest_paths(store, [path])} == {"loaded"}
        assert store.scalar("SELECT count(*) FROM tokens") == 0
        for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
            assert_checks(read.token_table(store, ["r"], by=by), tok, keys, f"{name} by {by}")
        store.close()


def test_torch_reductions_equal_the_one_pass_loop():
    """DriftLogger's check sums on an accelerator (torch reductions, run here on CPU tensors) equal the CPU's
    one-pass loop, with padding anywhere holding NaN."""
    torch = pytest.importorskip("torch")
    from analysis.record.checks import torch_check_sums

    g = torch.Generator().manual_seed(2)
    for B, T in ((7, 19), (1, 1), (3, 2)):
        mask = torch.rand(B, T, generator=g) < 0.8
        s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
        t = (s + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3).clamp(max=0.0)
        for m in (mask, torch.ones_like(mask)):
            ss, tt = s.masked_fill(~m, float("nan")), t.masked_fill(~m, float("nan"))
            want = kernel.grid_sums(ss.numpy(), tt.numpy(), m.numpy())
            got = torch_check_sums(ss, tt, m)
            assert got.keys() == want.keys() and want["n_check_tokens"] == int(m.sum())
            for k in want:
                assert math.isclose(got[k], want[k], rel_tol=1e-13, abs_tol=1e-300), (B, T, k)


# -- databases and files made before the check sums -------------------------------------------------------------

def test_database_made_before_the_check_sums_reads_them_as_null(tmp_path):
    """A database whose summary_step lacks the check sums opens read-only (slope and lags null, ratio_mean_se and
    missing_mass exact: they need only Σ(r − 1) and Σ(r − 1)²) and gains them, null, when opened for writing;
    no logging-check finding comes from nulls. A file loaded afterwards has its sums, but the run's stay null
    until every token is covered."""
    tok = gappy_tokens()
    store = load_files(tmp_path, "old", [tok.filter(pl.col("step") < 2)])
    for c in S.CHECK_SUM_NAMES:
        store.sql(f"ALTER TABLE summary_step DROP COLUMN {c}")
    store.close()
    ro = Store(tmp_path / "old.duckdb", read_only=True)
    assert not ro.has_check_sums
    old = read.token_table(ro, ["a", "b"], by="run")
    ref = {k[0]: ref_checks(g) for k, g in tok.filter(pl.col("step") < 2).group_by(["run"])}
    for row in old.iter_rows(named=True):
        assert all(row[c] is None for c in CHECKS[2:])
        for c in ("ratio_mean_se", "missing_mass"):
            assert math.isclose(row[c], ref[row["run"]][c], rel_tol=RTOL)
    ro.close()
    rw = Store(tmp_path / "old.duckdb")
    assert rw.has_check_sums
    assert read.token_table(rw, ["a", "b"], by="run").equals(old)
    f = tmp_path / "new.parquet"
    tok.filter(pl.col("step") == 2).write_parquet(f)
    assert {o.status for o in ingest_paths(rw, [f])} == {"loaded"}
    by_step = read.token_table(rw, ["a", "b"], by="step")
    assert by_step.filter(pl.col("step") < 2)["logprob_slope"].null_count() == 4
    assert_checks(by_step.filter(pl.col("step") == 2), tok.filter(pl.col("step") == 2), ["run", "step"], "new file")
    assert read.token_table(rw, ["a", "b"], by="run")["lag_abs_delta_prev"].null_count() == 2
    row = read.token_table(rw, ["a"], by="run").row(0, named=True)
    assert checks.verdict(row).position_shift is None and checks.verdict(row).temperature is None
    rw.close()


def test_summary_file_without_the_check_sums_loads_them_as_null(tmp_path):
    """A DriftLogger summary file written before the check sums (the columns absent) loads, and the slope and lag
    columns of its steps are null."""
    torch = pytest.importorskip("torch")
    from analysis.record import DriftLogger

    g = torch.Generator().manual_seed(1)
    s = -torch.rand(4, 12, generator=g, dtype=torch.float64) * 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        paths = DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(0, s, s * 0.99, torch.ones(4, 12))
    table = pq.read_table(paths["summary"])
    old = table.drop_columns(list(S.CHECK_SUM_NAMES))
    pq.write_table(old.replace_schema_metadata(table.schema.metadata), paths["summary"])
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    row = read.token_table(store, ["r"], by="run").row(0, named=True)
    assert row["missing_mass"] is not None and all(row[c] is None for c in CHECKS[2:])


# -- the rules ----------------------------------------------------------------------------------------------------

def base_values(**kw) -> dict:
    v = {"n_tokens": 10_000, "log_ratio_abs_mean": 0.02, "ratio_mean_se": 0.0005, "missing_mass": 0.0,
         "logprob_slope": 1.0, "logprob_slope_se": 0.001, "lag_abs_delta_prev": 1.2, "lag_abs_delta_next": 1.2}
    return v | kw


@pytest.mark.parametrize("values, holds", [
    (base_values(), set()),
    (base_values(missing_mass=0.0021), {"truncation"}),            # ≥ 0.2 % and 4.2 standard errors
    (base_values(missing_mass=0.0019), set()),                     # below the practical floor
    (base_values(missing_mass=0.003, ratio_mean_se=0.001), set()),  # 3 standard errors
    (base_values(missing_mass=-0.05), set()),                      # mean r above 1: not truncation
    (base_values(logprob_slope=0.78, logprob_slope_se=0.004), {"temperature"}),
    (base_values(logprob_slope=1.3, logprob_slope_se=0.01), {"temperature"}),
    (base_values(logprob_slope=0.96, logprob_slope_se=0.0001), set()),  # inside [0.95, 1.05]
    (base_values(logprob_slope=0.9, logprob_slope_se=0.03), set()),     # 3.3 standard errors
    (base_values(logprob_slope=0.78, logprob_slope_se=0.004, missing_mass=0.05), {"truncation", "temperature"}),
    (base_values(log_ratio_abs_mean=1.3, lag_abs_delta_next=0.03, missing_mass=0.5), {"position_shift"}),
    (base_values(log_ratio_abs_mean=1.3, lag_abs_delta_prev=0.3), {"position_shift"}),  # 0.23 < 0.25
    (base_values(log_ratio_abs_mean=1.3, lag_abs_delta_prev=0.34), set()),              # 0.26
    (base_values(log_ratio_abs_mean=0.04, lag_abs_delta_prev=0.001), set()),            # lag 0 below 0.05 nats
    (base_values(n_tokens=99, missing_mass=0.5), set()),                                # too few tokens
    (base_values(logprob_slope=None, logprob_slope_se=None, lag_abs_delta_prev=None), set()),  # old database
])
def test_rules(values, holds):
    v = checks.verdict(values)
    got = {k for k in ("position_shift", "truncation", "temperature") if getattr(v, k) is not None}
    assert got == holds
    assert v.holds == bool(holds) and v.sampling_params == bool(holds - {"position_shift"})
    if holds:
        assert v.line()


def test_stale_tokens_leave_the_slope_unjudged():
    """A policy update between the two sides' weights moves the slope as a temperature would."""
    v = base_values(logprob_slope=0.8, logprob_slope_se=0.004, missing_mass=0.01)
    assert checks.verdict(v).temperature is not None
    stale = checks.verdict(v, stale=True)
    assert stale.temperature is None and stale.truncation is not None


def test_values_in_python_equal_the_sql(tmp_path):
    """checks.values (DriftLogger's warning) and finalise.check_sql give the same numbers for the same sums."""
    tok = gappy_tokens()
    store = load_files(tmp_path, "db", [tok])
    merged = store.sql(f"""SELECT run, {S.merge_list('summary_step')} FROM summary_step GROUP BY run
                           ORDER BY run""").to_dicts()
    table = read.token_table(store, ["a", "b"], by="run").to_dicts()
    for sums, row in zip(merged, table):
        py = checks.values(sums)
        for c in CHECKS + ["log_ratio_abs_mean"]:
            assert math.isclose(py[c], row[c], rel_tol=1e-14), c


# -- runs sampled from processed distributions (numpy: fast; the transformers runs are in test_logging_checks_lm) --

RUNS = {"control": {}, "top-k 20": {"top_k": 20}, "top-p 0.9": {"top_p": 0.9}, "temperature 0.7": {"temperature": 0.7},
        "combination": {"temperature": 0.7, "top_k": 20, "top_p": 0.8}, "shifted": {"shift": True}}
FIRES = {"control": None, "top-k 20": "sampling_params", "top-p 0.9": "sampling_params",
         "temperature 0.7": "sampling_params", "combination": "sampling_params", "shifted": "position_shift"}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    tok = pl.concat([synthetic_run(name, seed=i, **kw) for i, (name, kw) in enumerate(RUNS.items())])
    folder = tmp_path_factory.mktemp("synthetic")
    tok.write_parquet(folder / "tokens.parquet")
    store = Store(folder / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [folder / "tokens.parquet"])} == {"loaded"}
    yield store, tok
    store.close()


def test_processed_and_shifted_runs_fire_and_lead_the_findings(synthetic):
    store, tok = synthetic
    found = ranking.findings_many(store, list(RUNS))
    table = read.token_table(store, list(RUNS), by="run")
    assert_checks(table, tok, ["run"], "synthetic runs")
    for run, kind in FIRES.items():
        kinds = [f.kind for f in found[run]]
        assert {"position_shift", "sampling_params"} & set(kinds) == ({kind} if kind else set()), (run, kinds)
        if kind:
            first = found[run][0]
            assert first.kind == kind and first.severity == "alert" and first.action and first.source
            assert first.rule == checks.RULES[kind]
    cases = {run: found[run][0].numbers["cases"] for run in RUNS if FIRES[run] == "sampling_params"}
    assert "truncation" in cases["top-p 0.9"] and "truncation" in cases["top-k 20"]
    assert "temperature" in cases["temperature 0.7"] and "truncation" not in cases["temperature 0.7"]
    assert set(cases["combination"]) == {"truncation", "temperature"}


def test_shift_is_tested_first(synthetic):
    """A shifted run also has mean r below 1 and a slope far from 1 (it compares different tokens), yet only
    position_shift is reported."""
    store, _ = synthetic
    row = read.token_table(store, ["shifted"], by="run").row(0, named=True)
    assert row["missing_mass"] > checks.MISSING_MASS_MIN or not checks.SLOPE_BAND[0] <= row["logprob_slope"] <= 1.05
    v = checks.verdict(row)
    assert v.position_shift is not None and not v.sampling_params


def test_driftlogger_warns_once_at_the_first_step_where_a_check_holds(tmp_path):
    torch = pytest.importorskip("torch")
    from analysis.record import DriftLogger
    from analysis.record.checks import LoggingCheckWarning

    honest = synthetic_run("x", seed=1, n_seq=16)
    truncated = synthetic_run("x", seed=2, n_seq=16, top_p=0.9)

    def grid(df, col):
        return torch.tensor(df[col].to_numpy().reshape(16, -1))
    log = DriftLogger(tmp_path / "logs", "x", token_sample=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.log_step(0, grid(honest, "sampler_logprob"), grid(honest, "trainer_logprob"), torch.ones(16, 32))
        assert not [w for w in caught if issubclass(w.category, LoggingCheckWarning)]
        for step in (1, 2):
            log.log_step(step, grid(truncated, "sampler_logprob"), grid(truncated, "trainer_logprob"),
                         torch.ones(16, 32))
    got = [str(w.message) for w in caught if issubclass(w.category, LoggingCheckWarning)]
    assert len(got) == 1 and "\n" not in got[0]
    assert got[0].startswith("DriftLogger run 'x', step 1:") and "top-p / top-k" in got[0]
    # the lake layout writes no summaries, and checks the step's own sums
    lake = DriftLogger(tmp_path / "lake", "x", layout="lake")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, run in enumerate((honest, truncated, truncated)):
            lake.log_step(step, grid(run, "sampler_logprob"), grid(run, "trainer_logprob"), torch.ones(16, 32))
    lines = [str(w.message) for w in caught if issubclass(w.category, LoggingCheckWarning)]
    assert [line.split(":")[0] for line in lines] == ["DriftLogger run 'x', step 1"], lines
    assert lines[0].split(": ", 1)[1] == got[0].split(": ", 1)[1]  # the same numbers as from the summaries


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 127, 128, 129, 130, 255, 256, 257, 1000, 4099, 65536,
                               100_003])
def test_pairwise_sums_are_numpys_to_the_bit(n):
    """kernel._pairwise3 (the checks' Σ s, Σ s², Σ s·d in the stream's one pass) gives np.sum's result bit for bit:
    numpy's pairwise summation at every length around its block sizes, values of mixed sign and magnitude
    (where another order of additions rounds differently), on a slice at an odd offset too."""
    rng = np.random.default_rng(n)
    s = rng.standard_normal(n + 3) * 10.0 ** rng.uniform(-6, 6, n + 3)
    d = rng.standard_normal(n + 3) * 10.0 ** rng.uniform(-6, 6, n + 3)
    for lo in (0, 3):
        a, b = s[lo:lo + n], d[lo:lo + n]
        got = kernel._pairwise3(kernel.read_only(a), kernel.read_only(b))
        want = (np.sum(a), np.sum(a * a), np.sum(a * b))
        assert [np.float64(x).tobytes() for x in got] == [np.float64(x).tobytes() for x in want]


def test_check_sums_of_the_stream_equal_numpys_sums_to_the_bit():
    """CheckSums.add's sums come from one numba pass (kernel.neighbours); they equal numpy's sums of the same
    batch bit for bit, in key order and shuffled (sorted first), with and without Δ from the caller."""
    rng = np.random.default_rng(3)
    n_seq, per = 40, 300
    seq = np.repeat(np.arange(n_seq), per)
    pos = np.tile(np.arange(per), n_seq)
    s = -rng.exponential(1.0, seq.size)
    t = np.minimum(s + rng.normal(0, 0.3, seq.size), 0.0)
    order = rng.permutation(seq.size)
    for idx in (np.arange(seq.size), order):
        ss, tt, pp, qq = s[idx], t[idx], pos[idx], seq[idx]
        key = np.argsort(qq << 32 | pp, kind="stable")
        ks, kt = ss[key], tt[key]
        adj = (qq[key][1:] == qq[key][:-1]) & (pp[key][1:] == pp[key][:-1] + 1)
        want = {"sum_s": np.sum(ks), "sum_s2": np.sum(ks * ks), "sum_sd": np.sum(ks * (kt - ks)),
                "sum_abs_lag_prev": np.sum(np.abs(kt[1:] - ks[:-1])[adj]),
                "sum_abs_lag_next": np.sum(np.abs(kt[:-1] - ks[1:])[adj])}
        for extra in ({}, {"d": tt - ss}):
            c = CheckSums()
            assert c.add(ss, tt, pp, qq, **extra)
            row = c.row()
            assert row["n_adj"] == int(adj.sum()) and row["n_check_tokens"] == seq.size
            for name, value in want.items():
                assert np.float64(row[name]).tobytes() == np.float64(value).tobytes(), name
