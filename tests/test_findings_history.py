"""Gates with history and distribution (corridors around baseline runs, the tokens behind a max-type gate, the band
of a configuration) and the residual-signature findings first_token and lattice, on constructed runs, each checked
against numpy on the same tokens; the fp32-like control stays silent."""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

from analysis.__main__ import main
from analysis.findings import gates, residual
from analysis.findings import ranking as F
from analysis.summaries import schema as S

from helpers.data import metrics_load
from helpers.reference import delta_bins

CFG = {"model": "qwen3-30b", "dtype": "bf16", "engine": "vllm"}


def _tokens(run: str, seed: int, delta, steps: int = 3, n_seq: int = 10, length: int = 24) -> pl.DataFrame:
    """Tokens of one run: s = −Exp(1.5), Δ = delta(rng, pos) per sequence (t = s + Δ, kept ≤ 0 by a lower s)."""
    rng = np.random.default_rng(seed)
    parts = []
    for step in range(steps):
        for sample in range(n_seq):
            pos = np.arange(length, dtype=np.int32)
            d = delta(rng, pos)
            s = -rng.exponential(1.5, length) - np.maximum(d, 0.0)
            parts.append(pl.DataFrame({"run": run, "step": step, "sample": sample, "pos": pos,
                                       "sampler_logprob": s, "trainer_logprob": s + d}))
    return pl.concat(parts)


def normal(sd):
    return lambda rng, pos: rng.normal(0.0, sd, len(pos))


def first_heavy(rng, pos):
    return np.where(pos == 0, rng.normal(0.0, 0.3, len(pos)), rng.normal(0.0, 0.01, len(pos)))


def on_lattice(rng, pos):
    """60 % of tokens at a non-zero multiple of 0.125 (±1, ±2), the rest continuous noise."""
    k = rng.choice([-2, -1, 1, 2], len(pos)).astype(np.float64)
    return np.where(rng.random(len(pos)) < 0.6, 0.125 * k, rng.normal(0.0, 0.01, len(pos)))


def outlier(df: pl.DataFrame) -> pl.DataFrame:
    """One token far out: Δ = 5 at step 1, sample 3, position 7 (s = −6, t = −1); the others as they were."""
    at = (pl.col("step") == 1) & (pl.col("sample") == 3) & (pl.col("pos") == 7)
    return df.with_columns(sampler_logprob=pl.when(at).then(-6.0).otherwise(pl.col("sampler_logprob")),
                           trainer_logprob=pl.when(at).then(-1.0).otherwise(pl.col("trainer_logprob")))


RUNS = {
    "base1": normal(0.05), "base2": normal(0.05), "base3": normal(0.05), "same": normal(0.05),
    "worse": normal(0.2), "outlier": normal(0.05), "first": first_heavy, "lattice": on_lattice,
    "control": normal(1e-7), "other_cfg": normal(0.05),
}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    frames = {run: _tokens(run, i, make) for i, (run, make) in enumerate(RUNS.items())}
    frames["outlier"] = outlier(frames["outlier"])
    store = metrics_load(tmp_path_factory.mktemp("history"), pl.concat(frames.values()))
    for run in ("base1", "base2", "base3", "same", "worse", "outlier"):
        store.set_run_config(run, CFG)
    store.set_run_config("other_cfg", CFG | {"dtype": "fp8"})
    yield store, frames
    store.close()


def ref_metrics(df: pl.DataFrame) -> dict[str, float]:
    """numpy on the token rows: the corridor metrics this test reads."""
    d = df["trainer_logprob"].to_numpy() - df["sampler_logprob"].to_numpy()
    return {"kl_k3": float(np.mean(np.expm1(d) - d)), "kl_k1": float(np.mean(-d)),
            "log_ratio_abs_mean": float(np.mean(np.abs(d))), "log_ratio_abs_max": float(np.max(np.abs(d))),
            "ratio_max": float(np.exp(np.max(d))), "ratio_min": float(np.exp(np.min(d)))}


# -- corridors ---------------------------------------------------------------------------------------------------

def test_corridor_bounds_follow_the_miles_rule():
    c = gates.Corridor()
    assert c.bounds(1.0) == (1.0 - 0.8, 1.0 + 0.5)
    assert c.bounds(0.001) == (0.001 - 0.02, 0.001 + 0.02)  # the floor near zero
    assert c.bounds(-0.1) == (-0.1 - 0.8 * 0.1, -0.1 + 0.5 * 0.1)  # |ref|
    assert gates.parse_corridor(["rel_up=0.3", "floor=0.01"]) == gates.Corridor(0.3, 0.8, 0.01)
    for bad in (["rel=1"], ["floor=x"], ["rel_up=-1"], ["floor=nan"]):
        with pytest.raises(ValueError, match="corridor"):
            gates.parse_corridor(bad)


def test_nan_is_an_error_and_no_history_is_inactive():
    summary = pl.DataFrame({"run": ["a", "b", "c", "d"], "kl_k3": [0.01, 0.012, float("nan"), 0.011],
                            "kl_k1": [None, 0.1, 0.1, 0.1]})
    t = gates.corridor_table(summary, ["a", "c", "d"], ["b"], metrics=["kl_k3", "kl_k1"])
    status = {(r["run"], r["metric"]): r["status"] for r in t.iter_rows(named=True)}
    assert status == {("a", "kl_k3"): "pass", ("a", "kl_k1"): "error", ("c", "kl_k3"): "error",
                      ("c", "kl_k1"): "pass", ("d", "kl_k3"): "pass", ("d", "kl_k1"): "pass"}
    t = gates.corridor_table(summary, ["a"], ["c"], metrics=["kl_k3"])  # a NaN baseline
    assert t["status"].to_list() == ["error"] and "baseline c" in t["detail"][0]
    t = gates.corridor_table(summary, ["b"], ["a"], metrics=["kl_k1"])  # the baseline has no value: cold start
    assert t["status"].to_list() == ["inactive"] and t["passed"].to_list() == [None]
    t = gates.corridor_table(summary, ["b"], ["b"], metrics=["kl_k3"])  # a run is no baseline of itself
    assert t["status"].to_list() == ["inactive"]


def test_corridor_gates_against_numpy(db):
    store, frames = db
    baselines = ["base1", "base2", "base3"]
    table = gates.corridor_gates(store, ["same", "worse"], baselines)
    refs = {r: ref_metrics(frames[r]) for r in ["same", "worse", *baselines]}
    checked = 0
    for g in table.iter_rows(named=True):
        if g["metric"] not in refs["same"]:
            continue
        ref = float(np.mean([refs[b][g["metric"]] for b in baselines]))
        lo, hi = ref - max(0.8 * abs(ref), 0.02), ref + max(0.5 * abs(ref), 0.02)
        v = refs[g["run"]][g["metric"]]
        assert g["ref"] == pytest.approx(ref, rel=1e-9) and g["value"] == pytest.approx(v, rel=1e-9)
        assert g["lo"] == pytest.approx(lo, rel=1e-9) and g["hi"] == pytest.approx(hi, rel=1e-9)
        assert g["passed"] == (lo <= v <= hi), g
        checked += 1
    assert checked == 12
    passed = {(r["run"], r["metric"]): r["passed"] for r in table.iter_rows(named=True)}
    assert passed[("same", "kl_k3")] and passed[("same", "log_ratio_abs_mean")]
    assert not passed[("worse", "log_ratio_abs_mean")] and not passed[("worse", "log_ratio_abs_max")]
    found = F.findings_many(store, ["same", "worse"], baselines=baselines)
    assert "corridor" not in [f.kind for f in found["same"]]
    worse = [f for f in found["worse"] if f.kind == "corridor"]
    assert {f.numbers["metric"] for f in worse} >= {"log_ratio_abs_mean", "log_ratio_abs_max"}
    widest = next(f for f in worse if f.numbers["metric"] == "log_ratio_abs_max")
    assert widest.severity == "alert" and widest.numbers["n_tokens_beyond"] > F.OUTLIER_TOKENS


def test_one_outlier_token_reads_as_one(db):
    store, frames = db
    table = gates.corridor_gates(store, ["outlier"], ["base1", "base2", "base3"])
    row = table.filter(pl.col("metric") == "log_ratio_abs_max").row(0, named=True)
    assert row["status"] == "fail" and row["value"] == pytest.approx(5.0, rel=1e-12)
    d = frames["outlier"]["trainer_logprob"].to_numpy() - frames["outlier"]["sampler_logprob"].to_numpy()
    assert (np.abs(d) > row["hi"]).sum() == 1
    assert row["n_beyond_min"] == row["n_beyond_max"] == 1 and row["n_tokens"] == len(d)
    assert row["share_beyond"] == pytest.approx(1 / len(d), rel=1e-12)
    mean_row = table.filter(pl.col("metric") == "log_ratio_abs_mean").row(0, named=True)
    assert mean_row["status"] == "pass"  # the distribution stayed where the baselines are
    f = next(f for f in F.findings_many(store, ["outlier"], baselines=["base1", "base2", "base3"])["outlier"]
             if f.kind == "corridor" and f.numbers["metric"] == "log_ratio_abs_max")
    assert f.severity == "warn" and "1 of 720 tokens beyond it" in f.title and "outlier tokens" in f.title


@pytest.mark.parametrize("seed", range(3))
def test_tokens_beyond_brackets_the_exact_count(seed):
    rng = np.random.default_rng(seed)
    e = np.asarray(S.D_EDGES)
    d = np.concatenate([rng.normal(0, 0.3, 2000), rng.choice(e[(np.abs(e) < 3)], 200)])  # some exactly on edges
    b = delta_bins(d)
    counts = pl.DataFrame({"bin": b, "n": np.ones(len(b), np.int64)}).group_by("bin").agg(pl.col("n").sum())
    for x in [0.05, 0.1, float(e[e > 0.2][0]), 0.7, 2.0]:
        lo, hi, n = gates.tokens_beyond(counts, "abs", x)
        exact = int((np.abs(d) > x).sum())
        assert n == len(d) and lo <= exact <= hi
        if x in e:  # an edge: no bin straddles it
            assert lo == exact == hi
        lo, hi, _ = gates.tokens_beyond(counts, "high", math.exp(x))  # Δ > ln of the ratio edge
        assert lo <= int((d > math.log(math.exp(x))).sum()) <= hi
        lo, hi, _ = gates.tokens_beyond(counts, "low", math.exp(-x))
        assert lo <= int((d < math.log(math.exp(-x))).sum()) <= hi


# -- normal for this configuration ---------------------------------------------------------------------------------

def test_band_of_the_configuration(db):
    store, frames = db
    bands = gates.config_bands(store, ["worse", "same", "other_cfg", "control"])
    assert set(bands["run"]) == {"worse", "same", "other_cfg"}  # control has no config
    alone = bands.filter(pl.col("run") == "other_cfg")  # no other run with dtype fp8
    assert alone["n_peers"].to_list() == [0] * alone.height and alone["position"].null_count() == alone.height
    row = bands.filter((pl.col("run") == "worse") & (pl.col("metric") == "log_ratio_abs_mean")).row(0, named=True)
    peers = ["base1", "base2", "base3", "same", "outlier"]
    vals = sorted(ref_metrics(frames[p])["log_ratio_abs_mean"] for p in peers)
    assert row["n_peers"] == 5 and row["config"] == "model=qwen3-30b, engine=vllm, dtype=bf16"
    assert row["peer_min"] == pytest.approx(vals[0], rel=1e-9) and row["peer_max"] == pytest.approx(vals[-1], rel=1e-9)
    assert row["peer_median"] == pytest.approx(np.median(vals), rel=1e-9) and row["position"] == "above"
    same = bands.filter((pl.col("run") == "same") & (pl.col("metric") == "log_ratio_abs_mean")).row(0, named=True)
    assert same["position"] == "within"
    found = F.findings_many(store, ["worse", "same"])
    unusual = [f for f in found["worse"] if f.kind == "unusual_for_config"]
    assert "log_ratio_abs_mean" in {f.numbers["metric"] for f in unusual}
    # kl_k3: the outlier run's one token (k3 = e^5 − 6) lifts that peer above `worse`, so `worse` lies within
    kl = {p: ref_metrics(frames[p])["kl_k3"] for p in [*peers, "worse"]}
    assert min(kl[p] for p in peers) <= kl["worse"] <= max(kl[p] for p in peers)
    assert "kl_k3" not in {f.numbers["metric"] for f in unusual}
    assert "unusual_for_config" not in [f.kind for f in found["same"]]
    few = gates.normal_band(pl.DataFrame({"run": ["a", "b", "c"], "kl_k3": [1.0, 2.0, 3.0]}),
                            {r: CFG for r in "abc"}, ["a"], metrics=["kl_k3"])
    assert few["n_peers"].to_list() == [2] and few["position"].to_list() == [None]  # fewer than MIN_PEERS


# -- residual signatures --------------------------------------------------------------------------------------------

def _k3(d):
    return np.expm1(d) - d


def test_signature_table_against_numpy(db):
    store, frames = db
    sig = {r["run"]: r for r in residual.signature_table(store, ["first", "lattice", "control", "same"]).iter_rows(named=True)}
    for run in ("first", "lattice", "same"):
        df = frames[run]
        d = df["trainer_logprob"].to_numpy() - df["sampler_logprob"].to_numpy()
        pos = df["pos"].to_numpy()
        k3 = _k3(d)
        assert sig[run]["first_token_kl_share"] == pytest.approx(k3[pos == 0].sum() / k3.sum(), rel=1e-12)
        assert sig[run]["kl_k3"] == pytest.approx(k3.mean(), rel=1e-12)
        m = np.round(d / 0.125)
        nz = d != 0
        on = nz & (m != 0) & (np.abs(d / 0.125 - m) < 1e-6)
        assert sig[run]["lattice_share"] == pytest.approx(on.sum() / nz.sum(), rel=1e-12)
    assert sig["lattice"]["lattice_share"] > 0.5 and sig["same"]["lattice_share"] < 0.05
    # the control: every |Δ| is far below q·1e-6 would count in lattice_share_q; a non-zero multiple is needed
    assert sig["control"]["lattice_share"] == 0.0


def test_first_token_and_lattice_fire_where_built_and_not_on_the_control(db):
    store, _ = db
    found = F.findings_many(store, ["first", "lattice", "control", "same"])
    kinds = {run: [f.kind for f in fs] for run, fs in found.items()}
    assert "first_token" in kinds["first"] and "lattice" not in kinds["first"]
    first = next(f for f in found["first"] if f.kind == "first_token")
    assert first.numbers["first_token_kl_share"] > 0.3 and first.url.startswith("/token_drift")
    assert "lattice" in kinds["lattice"] and "first_token" not in kinds["lattice"]
    assert not {"first_token", "lattice"} & set(kinds["control"]) and not {"first_token", "lattice"} & set(kinds["same"])
    assert F.RULES["lattice"] and F.ACTIONS["first_token"][1]
    # another quantum: the lattice run's steps of 0.125 are also steps of 0.0625, not of 0.1
    assert "lattice" in [f.kind for f in F.findings_many(store, ["lattice"], q=0.0625)["lattice"]]
    assert "lattice" not in [f.kind for f in F.findings_many(store, ["lattice"], q=0.1)["lattice"]]


def test_cli_findings_with_baselines(tmp_path, capsys):
    frames = [_tokens(r, i, normal(0.05)) for i, r in enumerate(("base1", "base2"))]
    store = metrics_load(tmp_path, pl.concat([*frames, outlier(_tokens("outlier", 7, normal(0.05)))]))
    path = str(store.path)
    store.close()
    assert main(["findings", "--db", path, "--run", "outlier", "--baseline", "base1", "--baseline", "base2"]) == 0
    text = capsys.readouterr().out
    assert "corridor gates against base1, base2" in text
    assert "fail     log_ratio_abs_max" in text and "tokens beyond: 1 of 720" in text
    assert main(["findings", "--db", path, "--run", "outlier", "--baseline", "base1", "--format", "json",
                 "--corridor", "floor=0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["metric"]: r for r in out["corridor"]}
    assert rows["kl_k3"]["status"] == "pass" and rows["kl_k3"]["hi"] == pytest.approx(rows["kl_k3"]["ref"] + 0.5)
    assert isinstance(out["findings"], list)
    assert main(["findings", "--db", path, "--run", "outlier", "--baseline", "nope"]) == 1
    assert "no run named 'nope'" in capsys.readouterr().err
    assert main(["findings", "--db", path, "--run", "outlier", "--corridor", "floor=1"]) == 1
    assert "--corridor sets the corridor of --baseline" in capsys.readouterr().err
