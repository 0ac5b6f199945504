"""Runs read against a partner: a trainer-vs-trainer rerun ingested with `ingest --pair-of RUN` (trainer_self), and
runs of one config differing only in routing replay (replay_residue); numbers against numpy on the same tokens, the
findings on the runs built to show them and silent on the fp32-like control."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from analysis.__main__ import main
from analysis.findings import pairs
from analysis.findings import ranking as F
from analysis.store import Store

from helpers.data import metrics_load


def _tokens(run: str, seed: int, sd: float, first_sd: float | None = None, lattice: float = 0.0, steps: int = 3,
            n_seq: int = 10, length: int = 24) -> pl.DataFrame:
    """Δ ~ N(0, sd) (N(0, first_sd) at position 0 when given; a share `lattice` of tokens at ±1/8)."""
    rng = np.random.default_rng(seed)
    n = steps * n_seq * length
    pos = np.tile(np.arange(length, dtype=np.int32), steps * n_seq)
    d = rng.normal(0.0, sd, n)
    if first_sd is not None:
        d = np.where(pos == 0, rng.normal(0.0, first_sd, n), d)
    d = np.where(rng.random(n) < lattice, 0.125 * rng.choice([-1, 1], n), d)
    s = -rng.exponential(1.5, n) - 0.5 - np.maximum(d, 0.0)
    return pl.DataFrame({"run": run, "step": np.repeat(np.arange(steps), n_seq * length),
                         "sample": np.tile(np.repeat(np.arange(n_seq), length), steps), "pos": pos,
                         "sampler_logprob": s, "trainer_logprob": s + d})


def ref(df: pl.DataFrame) -> dict:
    d = df["trainer_logprob"].to_numpy() - df["sampler_logprob"].to_numpy()
    pos = df["pos"].to_numpy()
    k3 = np.expm1(d) - d
    r = np.exp(d)
    m = np.round(d / 0.125)
    on = (d != 0) & (m != 0) & (np.abs(d / 0.125 - m) < 1e-6)
    return {"kl_k3": k3.mean(), "log_ratio_abs_mean": np.abs(d).mean(), "outside": np.mean(np.abs(r - 1) > 0.1),
            "first_token_kl_share": k3[pos == 0].sum() / k3.sum(), "lattice_share": on.sum() / (d != 0).sum()}


# -- trainer_self -------------------------------------------------------------------------------------------------

ENGINE = {"eng": 0.05, "eng2": 0.05, "control": 1e-7}
SELF = {"eng": 0.04, "eng2": 0.01, "control": 1e-7}  # the trainer against itself on the same tokens


@pytest.fixture(scope="module")
def paired(tmp_path_factory):
    """Engine runs loaded as usual; each trainer-vs-trainer rerun through the CLI with --pair-of."""
    tmp = tmp_path_factory.mktemp("pairs")
    frames = {run: _tokens(run, i, sd) for i, (run, sd) in enumerate(ENGINE.items())}
    store = metrics_load(tmp, pl.concat(frames.values()))
    path = str(store.path)
    store.close()
    for i, (run, sd) in enumerate(SELF.items()):
        name = f"{run}-trainer-self"
        frames[name] = _tokens(name, 100 + i, sd)
        frames[name].write_parquet(tmp / f"{run}-self.parquet")
        args = ["ingest", str(tmp / f"{run}-self.parquet"), "--db", path, "--pair-of", run]
        assert main(args if run != "eng2" else args + ["--run", "eng2-rerun"]) == 0
    frames["eng2-rerun"] = frames.pop("eng2-trainer-self").with_columns(run=pl.lit("eng2-rerun"))
    return path, frames


def test_ingest_pair_of_records_the_pairing(paired, capsys):
    path, frames = paired
    store = Store(path, read_only=True)
    assert store.run_config("eng-trainer-self") == {"pair_of": "eng", "pair_kind": "trainer_self"}
    assert store.run_config("eng2-rerun")["pair_of"] == "eng2"
    assert pairs.trainer_self_runs(store) == {"eng": ["eng-trainer-self"], "eng2": ["eng2-rerun"],
                                              "control": ["control-trainer-self"]}
    store.close()
    # a rerun keeps the config it came with, and is no run of that configuration (no peer in its band)
    from analysis.commands import mark_pairs
    from analysis.findings import gates
    from analysis.ingest.units import Outcome
    store = Store(path)
    store.set_run_config("eng2-rerun", {"model": "m", "dtype": "bf16"})
    assert mark_pairs(store, "eng2", [Outcome("f", "loaded", runs=["eng2-rerun", "eng2"])]) == ["eng2-rerun"]
    assert store.run_config("eng2-rerun") == {"model": "m", "dtype": "bf16", "pair_of": "eng2",
                                              "pair_kind": "trainer_self"}
    assert gates.config_key(store.run_config("eng2-rerun")) is None and gates.config_key({"model": "m"})
    store.close()
    assert main(["ingest", "x.parquet", "--db", path, "--pair-of", "nope"]) == 2
    assert "--pair-of: no run named 'nope'" in capsys.readouterr().err
    assert main(["ingest", "x.parquet", "--db", path, "--pair-of", "eng", "--run", "eng"]) == 2
    assert "needs a name of its own" in capsys.readouterr().err


def test_trainer_self_table_against_numpy(paired):
    path, frames = paired
    store = Store(path, read_only=True)
    table = {r["run"]: r for r in pairs.trainer_self_table(store, ["eng", "eng2", "control"]).iter_rows(named=True)}
    store.close()
    for run, other in (("eng", "eng-trainer-self"), ("eng2", "eng2-rerun")):
        a, b = ref(frames[run]), ref(frames[other])
        row = table[run]
        assert row["trainer_self_run"] == other and row["n_tokens"] == row["n_tokens_self"] == 720
        assert row["kl_k3"] == pytest.approx(a["kl_k3"], rel=1e-12)
        assert row["kl_k3_self"] == pytest.approx(b["kl_k3"], rel=1e-12)
        assert row["self_share"] == pytest.approx(b["kl_k3"] / a["kl_k3"], rel=1e-12)
        assert row["log_ratio_abs_mean_self"] == pytest.approx(b["log_ratio_abs_mean"], rel=1e-12)
        assert row["outside_0_9_1_1"] == a["outside"] and row["outside_0_9_1_1_self"] == b["outside"]


def test_trainer_self_fires_where_the_trainer_disagrees_with_itself(paired):
    path, _ = paired
    store = Store(path, read_only=True)
    found = F.findings_many(store, ["eng", "eng2", "control"])
    store.close()
    kinds = {run: [f.kind for f in fs] for run, fs in found.items()}
    assert "trainer_self" in kinds["eng"]
    assert "trainer_self" not in kinds["eng2"] and "trainer_self" not in kinds["control"]
    f = next(f for f in found["eng"] if f.kind == "trainer_self")
    assert f.numbers["self_share"] > F.SELF_SHARE and f.url == "/compare?compare_tab=Pairs"


# -- replay residue -----------------------------------------------------------------------------------------------

CFG = {"model": "moe", "dtype": "bf16", "seed": 1}
REPLAY = {  # run: (replay mode, config, tokens)
    "live": ("none", CFG | {"preset": "bf16"}, dict(sd=0.2)),
    "ids": ("ids", CFG | {"preset": "bf16-replay"}, dict(sd=0.03, first_sd=0.3)),
    "idsw": ("ids+weights", CFG | {"preset": "bf16-replay-weights"}, dict(sd=0.005, lattice=0.6)),
    "other_seed": ("ids", CFG | {"seed": 2}, dict(sd=0.03)),  # no live run of its config: no pair
    "control": (None, {"model": "moe", "dtype": "fp32"}, dict(sd=1e-7)),
}


@pytest.fixture(scope="module")
def replays(tmp_path_factory):
    frames = {run: _tokens(run, 20 + i, **kw) for i, (run, (_, _, kw)) in enumerate(REPLAY.items())}
    store = metrics_load(tmp_path_factory.mktemp("replay"), pl.concat(frames.values()))
    for run, (mode, cfg, _) in REPLAY.items():
        store.set_run_config(run, cfg | ({"replay": mode} if mode else {}))
    yield store, frames
    store.close()


def test_replay_groups_pair_runs_by_config(replays):
    store, _ = replays
    assert pairs.replay_groups(store, ["ids"]) == [{"none": ["live"], "ids": ["ids"], "ids+weights": ["idsw"]}]
    assert pairs.replay_groups(store, ["other_seed", "control"]) == []
    assert pairs.replay_mode({"replay": True}) is None and pairs.replay_mode({"replay": "IDS+weights"}) == \
        "ids+weights" and pairs.replay_mode({"replay": "r3"}) is None and pairs.replay_mode({}) is None


def test_replay_table_against_numpy(replays):
    store, frames = replays
    table = {r["run"]: r for r in pairs.replay_table(store, ["live"]).iter_rows(named=True)}
    assert set(table) == {"live", "ids", "idsw"}
    base = ref(frames["live"])["kl_k3"]
    for run in ("live", "ids", "idsw"):
        want, row = ref(frames[run]), table[run]
        assert row["baseline"] == "live" and row["kl_k3_baseline"] == pytest.approx(base, rel=1e-12)
        assert row["kl_k3"] == pytest.approx(want["kl_k3"], rel=1e-12)
        assert row["kl_k3_removed"] == pytest.approx(base - want["kl_k3"], rel=1e-12)
        assert row["removed_share"] == pytest.approx(1 - want["kl_k3"] / base, rel=1e-12, abs=1e-15)
        assert row["remaining_share"] == pytest.approx(want["kl_k3"] / base, rel=1e-12)
        for col in ("first_token_kl_share", "lattice_share", "log_ratio_abs_mean"):
            assert row[col] == pytest.approx(want[col], rel=1e-12), (run, col)
    assert table["live"]["removed_share"] == 0.0 and table["live"]["replay"] == "none"


def test_replay_residue_findings(replays):
    store, frames = replays
    found = F.findings_many(store, list(REPLAY))
    kinds = {run: [f.kind for f in fs] for run, fs in found.items()}
    for run in ("live", "other_seed", "control"):
        assert "replay_residue" not in kinds[run], run
    ids = next(f for f in found["ids"] if f.kind == "replay_residue")
    idsw = next(f for f in found["idsw"] if f.kind == "replay_residue")
    assert ids.severity == idsw.severity == "info"
    assert ids.numbers["removed_share"] == pytest.approx(1 - ref(frames["ids"])["kl_k3"] / ref(frames["live"])["kl_k3"],
                                                         rel=1e-12)
    # what remains after replay is named by its signature
    assert "on the first token" in ids.title and "first token" not in idsw.title
    assert "multiples of 0.125" in idsw.title and "multiples" not in ids.title
    assert ids.numbers["removed_share"] > 0.5 and idsw.numbers["removed_share"] > 0.5
