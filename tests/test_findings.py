"""analysis.findings.ranking on runs built to show each kind (seeded synthetic runs and the bundled demo), the controls
that must stay silent, the shift-share decomposition, the gates and the CLI."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from analysis.__main__ import main
from analysis.findings import decomposition as D
from analysis.findings import gates
from analysis.findings import ranking as F
from analysis.metrics import token as metrics

from helpers.data import metrics_load

ROOT = Path(__file__).resolve().parent.parent
CAUSES = {"staleness", "routing_flips", "low_probability_tokens", "long_sequences", "spikes", "rising_trend"}


def _run(run: str, seed: int, steps: int, sd, n_seq: int = 8, length=(8, 30), versions=None) -> pl.DataFrame:
    """Tokens of one run: Δ ~ N(0, sd(step, sample, n, s)) per token (sd may be an array over the tokens);
    versions(step, sample) -> lag gives sampler_version = step − lag."""
    rng = np.random.default_rng(seed)
    parts = []
    for step in range(steps):
        for sample in range(n_seq):
            n = int(rng.integers(length[0], length[1] + 1))
            s = -rng.exponential(1.5, n)
            d = rng.normal(0.0, 1.0, n) * sd(step, sample, n, s)
            cols = {"run": [run] * n, "step": [step] * n, "sample": [sample] * n, "pos": np.arange(n, dtype=np.int32),
                    "sampler_logprob": s, "trainer_logprob": np.minimum(s + d, 0.0)}
            lag = versions(step, sample) if versions else 0
            cols |= {"sampler_version": np.full(n, step - lag), "trainer_version": np.full(n, step)}
            parts.append(pl.DataFrame(cols))
    return pl.concat(parts)


def _flip_run(run: str, seed: int, layers: int = 4) -> tuple[pl.DataFrame, pl.DataFrame]:
    """10% of tokens flip from a random layer on (so deeper layers flip more) and carry Δ ~ N(0, 0.3)."""
    rng = np.random.default_rng(seed)
    tokens = _run(run, seed, 6, lambda *a: 0.01)
    n = tokens.height
    flipped = rng.random(n) < 0.1
    start = rng.integers(0, layers, n)
    d = np.where(flipped, rng.normal(0.0, 0.3, n), tokens["trainer_logprob"].to_numpy() - tokens["sampler_logprob"].to_numpy())
    tokens = tokens.with_columns(trainer_logprob=pl.Series(np.minimum(tokens["sampler_logprob"].to_numpy() + d, 0.0)))
    keys = tokens.select("run", "step", "sample", "pos")
    S = np.argsort(rng.random((n * layers, 8)), axis=1)[:, :2].astype(np.int32)
    T = S.copy()
    for i in range(n):
        for layer in range(layers):
            if flipped[i] and layer >= start[i]:
                T[i * layers + layer, 1] = next(e for e in range(8) if e not in S[i * layers + layer])
    rep = keys[np.repeat(np.arange(n), layers)]
    routing = rep.with_columns(layer=pl.Series(np.tile(np.arange(layers, dtype=np.int32), n)),
                               sampler_experts=pl.Series(S.tolist(), dtype=pl.List(pl.Int32)),
                               trainer_experts=pl.Series(T.tolist(), dtype=pl.List(pl.Int32)))
    return tokens, routing


SYNTHETIC = {
    "healthy": lambda: _run("healthy", 1, 6, lambda *a: 1e-4),
    "stale": lambda: _run("stale", 2, 6, lambda step, sample, n, s: 0.3 if sample % 2 else 0.01,
                          versions=lambda step, sample: sample % 2),
    "lowprob": lambda: _run("lowprob", 3, 6, lambda step, sample, n, s: np.where(s < -4.0, 0.3, 0.01)),
    "long": lambda: _run("long", 4, 6, lambda step, sample, n, s: 0.004 * n, length=(2, 64)),
    "spiky": lambda: _run("spiky", 5, 10, lambda step, *a: 0.5 if step == 6 else 0.02),
    "rising": lambda: _run("rising", 6, 9, lambda step, *a: 0.01 * 1.5 ** step),
    "loud": lambda: _run("loud", 7, 4, lambda *a: 0.5),
}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    tokens = [make() for make in SYNTHETIC.values()]
    ftok, routing = _flip_run("flips", 8)
    store = metrics_load(tmp_path_factory.mktemp("findings"), pl.concat(tokens + [ftok], how="diagonal_relaxed"),
                         routing)
    found = F.findings_many(store, store.run_names())
    yield store, found
    store.close()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    store = Store(tmp_path_factory.mktemp("demo") / "demo.duckdb")
    assert all(o.status == "loaded" for o in ingest_paths(store, [ROOT / "data" / "demo"]))
    yield store, F.findings_many(store, store.run_names())
    store.close()


def kinds(found: list) -> list[str]:
    return [f.kind for f in found]


@pytest.mark.parametrize("run, kind", [("stale", "staleness"), ("flips", "routing_flips"),
                                       ("lowprob", "low_probability_tokens"), ("long", "long_sequences"),
                                       ("spiky", "spikes"), ("rising", "rising_trend")])
def test_each_cause_leads_on_the_run_built_to_show_it(synthetic, run, kind):
    _, found = synthetic
    got = found[run]
    assert got[0].kind == kind, [(f.kind, f.title) for f in got]
    # built with one cause only: no other cause is named
    assert set(kinds(got)) & CAUSES == {kind}, kinds(got)
    f = got[0]
    assert f.severity in ("warn", "alert") and f.action and f.source and f.numbers and f.url.startswith("/")


def test_step0_band_and_noise_floor_fire_where_built(synthetic):
    _, found = synthetic
    loud = {f.kind: f for f in found["loud"]}
    assert {"step0_mismatch", "band_violation", "noise_floor"} <= set(loud)
    bands = [f for f in found["loud"] if f.kind == "band_violation"]
    assert {f.numbers["gate"] for f in bands} >= {"slime log_ratio_abs_mean", "NeMo mult_prob_error 1.1"}
    assert all(f.source for f in bands)
    assert loud["step0_mismatch"].numbers["step"] == 0
    # the lag-1 sequences of `stale` start at step 0: mismatch there is staleness, not kernels
    assert "step0_mismatch" not in kinds(found["stale"])


def test_healthy_run_is_silent(synthetic):
    _, found = synthetic
    assert kinds(found["healthy"]) == ["healthy"]


def test_spike_and_trend_numbers(synthetic):
    store, found = synthetic
    spike = next(f for f in found["spiky"] if f.kind == "spikes")
    per_step = metrics.token_metrics(store, ["spiky"], by="step")
    kl = dict(zip(per_step["step"], per_step["kl_k3"]))
    assert spike.numbers["spike_steps"] == [6] and spike.numbers["worst_kl_k3"] == pytest.approx(kl[6], rel=1e-12)
    neighbours = [kl[s] for s in (3, 4, 5, 7, 8, 9)]
    assert spike.numbers["worst_factor"] == pytest.approx(kl[6] / np.median(neighbours), rel=1e-12)
    trend = next(f for f in found["rising"] if f.kind == "rising_trend")
    n = trend.numbers
    assert n["steps_first"] == [0, 2] and n["steps_last"] == [6, 8]
    parts = [n[f"decomposition_{t}"] for t in ("mix_length", "mix_prob", "mix_flip", "mix_stale", "within")]
    assert sum(parts) == pytest.approx(n["decomposition_B"] - n["decomposition_A"], rel=1e-12)
    assert n["decomposition_within"] > 0.9 * (n["decomposition_B"] - n["decomposition_A"])  # noise grows in place


def test_demo_leads(demo):
    """The demo's runs (200 lab steps of ~320 tokens each) lead with different causes: staleness where the weights
    are one update stale, low-probability tokens where routing is replayed (flips are gone), per-step spikes where
    bf16 or fp16 routers flip (a step's kl_k3 rests on a few flipped tokens), nothing in the fp32 control."""
    _, found = demo
    leads = {run: f[0].kind for run, f in found.items()}
    assert len(set(leads.values())) >= 3, leads
    for run in ("bf16-async", "bf16-async-icepop", "bf16-async-geo-rs"):
        assert leads[run] == "staleness"
    for run in ("bf16-replay", "bf16-replay-weights"):
        assert leads[run] == "low_probability_tokens" and "routing_flips" not in kinds(found[run])
    for run in ("bf16", "fp16", "bf16-fp32-head"):
        assert leads[run] == "spikes" and "routing_flips" in kinds(found[run])
    assert kinds(found["fp32"]) == ["healthy"]
    assert found["bf16-async"][0].severity == "alert"
    assert found["bf16-async"][0].url == \
        "/token_drift?tokens_tab=Where+the+mismatch+lives&tokens_dim=staleness+%28lag%29"


def test_evidence_pages_exist():
    from ui import glossary, nav
    stems = {p.url for p in nav.ALL}
    for page, _ in (F.TOKENS_WHERE, F.ROUTING_TOKENS, F.OVERVIEW, F.WATERFALL, F.SIMULATOR, F.GATES):
        assert page in stems
    for dim, label in F.TOKENS_DIM_LABELS.items():  # the radio binds its shown label to the URL
        assert glossary.DIMENSIONS[dim][0] == label


# -- decomposition ----------------------------------------------------------------------------------------

def _cells(rows):
    return pl.DataFrame(rows, schema=["step", "length", "prob", "flip", "stale", "n_tokens", "kl_sum"], orient="row")


def test_pure_staleness_mix_is_attributed_to_staleness():
    # same per-cell k (0.1 fresh, 0.5 stale); B has 75% stale tokens instead of 50%
    cells = _cells([(0, 3, -1, False, False, 10, 1.0), (0, 3, -1, False, True, 10, 5.0),
                    (1, 3, -1, False, False, 5, 0.5), (1, 3, -1, False, True, 15, 7.5)])
    t = dict(D.shift_share(cells, (0, 0), (1, 1)).select("term", "value").iter_rows())
    assert t["A"] == pytest.approx(0.3) and t["B"] == pytest.approx(0.4)
    assert t["mix_stale"] == pytest.approx(0.1, rel=1e-12)
    assert t["within"] == pytest.approx(0.0, abs=1e-15) and t["mix_length"] == t["mix_prob"] == t["mix_flip"] == 0.0


def test_within_drift_and_unseen_cells():
    # same mix, k doubles: all within; then a cell only B has (a new probability decade)
    cells = _cells([(0, 2, -2, False, False, 4, 0.4), (1, 2, -2, False, False, 4, 0.8)])
    t = dict(D.shift_share(cells, (0, 0), (1, 1)).select("term", "value").iter_rows())
    assert t["within"] == pytest.approx(0.1) and t["mix_prob"] == 0.0
    cells = _cells([(0, 2, -2, False, False, 4, 0.4), (1, 2, -2, False, False, 2, 0.2),
                    (1, 2, -5, True, False, 2, 3.0), (1, 4, -1, False, True, 3, 0.3)])
    df = D.shift_share(cells, (0, 0), (1, 1))
    t = dict(df.select("term", "value").iter_rows())
    assert t["B"] == pytest.approx(3.5 / 7, rel=1e-12)
    assert sum(df["value"][1:-1]) == pytest.approx(t["B"] - t["A"], rel=1e-12)


def test_decompose_matches_token_metrics(synthetic):
    store, _ = synthetic
    for run in ("flips", "stale", "rising", "long"):
        df = D.decompose(store, run, (0, 1), (3, 5))
        t = dict(df.select("term", "value").iter_rows())
        for side, rng in (("A", (0, 1)), ("B", (3, 5))):
            want = metrics.token_metrics(store, [run], by="run", steps=rng)["kl_k3"][0]
            assert t[side] == pytest.approx(want, rel=1e-12)
        assert sum(df["value"][1:-1]) == pytest.approx(t["B"] - t["A"], rel=1e-9, abs=1e-15)
    assert D.decompose(store, "flips", (0, 1), (50, 60)).is_empty()


def test_thinned_decomposition_reads_exactly_the_chosen_steps(synthetic):
    from analysis.metrics import sampled
    store, _ = synthetic
    a, b = (0, 2), (3, 5)
    n_step = dict(store.rows("SELECT step, count(*) FROM tokens WHERE run = 'flips' GROUP BY step"))
    whole = sum(n_step[s] for s in range(6))
    th = sampled.thin_steps(store, ["flips"], [a, b], budget=(whole + 1) // 2)
    assert th.stride == 2 and th.steps == (0, 2, 3, 5)  # every 2nd step of each range, from its first
    assert (th.n_total, th.n_read) == (whole, sum(n_step[s] for s in th.steps))
    assert th.label() == f"estimated from every 2nd step ({sampled.count_text(th.n_read)} of " \
                         f"{sampled.count_text(whole)} tokens)"
    assert sampled.thin_steps(store, ["flips"], [a, b], budget=whole).steps is None  # fits: every step
    # the filter reaches the token and the routing rows alike: same as the cells of those steps
    cells = D.kl_cells(store, "flips", (0, 5))
    assert cells["flip"].any()
    want = D.shift_share(cells.filter(pl.col("step").is_in(list(th.steps))), a, b)
    got = D.decompose(store, "flips", a, b, th.steps)
    assert_frame_equal(got, want)
    for side, steps in (("A", [0, 2]), ("B", [3, 5])):
        ref = metrics.token_metrics(store, ["flips"], by="step", steps=(min(steps), max(steps)))
        ref = ref.filter(pl.col("step").is_in(steps))
        kl = (ref["kl_k3"] * ref["n_tokens"]).sum() / ref["n_tokens"].sum()
        assert dict(got.select("term", "value").iter_rows())[side] == pytest.approx(kl, rel=1e-12)


def test_thinned_simulator_equals_the_simulator_over_those_steps(synthetic):
    from analysis.metrics import corrections as C
    store, _ = synthetic
    choices = [("icepop", {"alpha": 0.93, "beta": 1.07}), ("tis", {"C": 1.05})]  # off the bands: token rows
    assert all(C.reads_tokens(m, p) for m, p in choices)
    full = C.compare_methods(store, ["stale"], choices)
    thin = C.compare_methods(store, ["stale"], choices, only_steps=[1, 4])
    assert_frame_equal(thin["step"], full["step"].filter(pl.col("step").is_in([1, 4])))
    steps = full["step"].filter(pl.col("step").is_in([1, 4]))
    for row in thin["run"].iter_rows(named=True):  # per-run rows over those two steps only
        mine = steps.filter(pl.col("method") == row["method"])
        masked = (mine["masked_token_frac"] * mine["n_tokens"]).sum() / mine["n_tokens"].sum()
        assert row["masked_token_frac"] == pytest.approx(masked, rel=1e-12)
    assert thin["run"]["n_tokens"].to_list() == [int(full["step"].filter(
        pl.col("step").is_in([1, 4]) & (pl.col("method") == m))["n_tokens"].sum()) for m, _ in choices]
    # a choice the summaries answer reads every step whatever only_steps says (and costs no thinning)
    both = C.compare_methods(store, ["stale"], [("icepop", {"alpha": 0.9, "beta": 1.1}), choices[1]], only_steps=[1, 4])
    assert set(both["step"].filter(pl.col("method") == "icepop")["step"]) == set(full["step"]["step"])
    assert set(both["step"].filter(pl.col("method") == "tis")["step"]) == {1, 4}


# -- gates ------------------------------------------------------------------------------------------------

def test_gates_at_their_boundaries():
    base = {"run": "x", "kl_k3": 1e-3, "mult_prob_error": 1.05, "log_ratio_abs_mean": 0.1, "ratio_mean": 2.0,
            "ratio_std": 1.0, "ess": 0.3, "kl_k1": -0.1, "chi2_token": 1.0}
    summary = pl.DataFrame([base])
    per_step = pl.DataFrame({"run": ["x"] * 25, "step": list(range(25)),
                             "kl_k3": [0.015] * 20 + [0.0] * 5})  # only the first 20 steps count
    g = {r["gate"]: r for r in gates.gate_table(summary, per_step, ["x"]).iter_rows(named=True)}
    # strict bands fail at the threshold, inclusive ones pass
    assert not g["prime-rl mismatch KL"]["passed"] and g["prime-rl mismatch KL"]["value"] == pytest.approx(0.015)
    assert not g["NeMo mult_prob_error 1.05"]["passed"] and g["NeMo mult_prob_error 1.1"]["passed"]
    assert not g["NeMo gen_kl"]["passed"]
    for gate in ("slime log_ratio_abs_mean", "verl IS weight mean", "verl IS weight std", "verl ESS", "verl |kl_k1|",
                 "verl chi2_token"):
        assert g[gate]["passed"], gate
    assert g["prime-rl mismatch KL"]["metric"] == "mean kl_k3 over the first 20 steps"


def test_demo_gates(demo):
    store, _ = demo
    from analysis.metrics import dashboard
    t = dashboard.run_and_step_tables(store, ["fp32", "bf16-async"])
    g = gates.gate_table(t["run"], t["step"], ["fp32", "bf16-async"])
    assert g.filter(pl.col("run") == "fp32")["passed"].all()
    failed = set(g.filter((pl.col("run") == "bf16-async") & ~pl.col("passed"))["gate"])
    # one update of staleness at the lab's learning rate: kl_k3 0.017, mult_prob_error 1.28, but log_ratio_abs_mean
    # 0.052, inside slime's 0.1
    assert {"prime-rl mismatch KL", "NeMo mult_prob_error 1.1", "NeMo gen_kl"} <= failed
    assert "slime log_ratio_abs_mean" not in failed


# -- CLI --------------------------------------------------------------------------------------------------

def test_cli_findings(tmp_path, capsys):
    store = metrics_load(tmp_path / "db", pl.concat([SYNTHETIC["stale"](), SYNTHETIC["healthy"]()]))
    db = str(store.path)
    store.close()
    assert main(["findings", "--db", db, "--run", "stale", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got[0]["kind"] == "staleness" and got[0]["evidence"]["url"].startswith("/token_drift?")
    assert set(got[0]) >= {"kind", "severity", "title", "evidence", "action", "source"}
    assert main(["findings", "--db", db, "--steps", "0:2"]) == 0
    out = capsys.readouterr().out
    assert "== healthy" in out and "[info] healthy" in out and "try:" in out
    assert main(["findings", "--db", db, "--steps", "5-2"]) == 1
    assert "--steps takes A:B" in capsys.readouterr().err


def test_quantiles_match_numpy(synthetic):
    from analysis.metrics.corrections import band_log_width, log_ratio_quantiles
    store, _ = synthetic
    q = log_ratio_quantiles(store, ["long"], by="step").filter(pl.col("step") == 2).row(0, named=True)
    rows = store.sql("SELECT sample, trainer_logprob - sampler_logprob AS d FROM tokens WHERE run = 'long' AND step = 2")
    d = rows["d"].to_numpy()
    per = rows.group_by("sample").agg(pl.col("d").mean().alias("m"), pl.col("d").sum().alias("s"))
    for col, x in (("token", np.abs(d)), ("seq_mean", np.abs(per["m"].to_numpy())),
                   ("seq_sum", np.abs(per["s"].to_numpy()))):
        assert q[f"{col}_p50"] == pytest.approx(np.percentile(x, 50), rel=1e-12)
        assert q[f"{col}_p99"] == pytest.approx(np.percentile(x, 99), rel=1e-12)
    assert band_log_width("icepop", {"alpha": 0.5, "beta": 1.5}) == pytest.approx(math.log(1.5))
    assert band_log_width("geo_rs", {"lo": 1.01, "hi": 1.02}) == 0.0  # a band without 1 masks everything
    assert band_log_width("veto", {"tau": 1e-4}) == pytest.approx(-math.log(1e-4))
