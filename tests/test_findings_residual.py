"""The residual-signature findings read from the summaries where they hold them (token rows for older rows, another
quantum, or a lattice count the Δ bins leave open), each share against numpy on every token at rel 1e-12; and the
retokenization and per_turn findings on multi-turn runs built to show them, silent on the fp32-like control."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.findings import ranking as F
from analysis.findings import residual
from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import schema as S

from helpers.data import metrics_load
from helpers.logger_context import context_step, trained
from helpers.reference import delta_bins

TURN = 8  # tokens per turn: three turns of a 24-token response


def _tokens(run: str, seed: int, delta, steps: int = 3, n_seq: int = 10, length: int = 24,
            segments: bool = True) -> pl.DataFrame:
    """Tokens of one run: s = −Exp(1.5) − 0.5, Δ = delta(rng, pos, segment) (t = s + Δ kept ≤ 0), segment =
    pos // TURN (turn starts at 0, 8, 16)."""
    rng = np.random.default_rng(seed)
    parts = []
    for step in range(steps):
        for sample in range(n_seq):
            pos = np.arange(length, dtype=np.int32)
            seg = pos // TURN
            d = delta(rng, pos, seg)
            s = -rng.exponential(1.5, length) - 0.5 - np.maximum(d, 0.0)
            cols = {"run": run, "step": step, "sample": sample, "pos": pos, "sampler_logprob": s,
                    "trainer_logprob": s + d}
            if segments:
                cols["segment"] = seg.astype(np.int32)
            parts.append(pl.DataFrame(cols))
    return pl.concat(parts)


def noise(sd):
    return lambda rng, pos, seg: rng.normal(0.0, sd, len(pos))


def retokenized(rng, pos, seg):
    """Δ = −12 at the first token of turns 1 and 2 (60 % of them), noise elsewhere."""
    d = rng.normal(0.0, 0.05, len(pos))
    start = (pos % TURN == 0) & (seg > 0) & (rng.random(len(pos)) < 0.6)
    return np.where(start, -12.0, d)


def last_turn(rng, pos, seg):
    return np.where(seg == 2, rng.normal(0.0, 0.3, len(pos)), rng.normal(0.0, 0.02, len(pos)))


def straddling(rng, pos, seg):
    """Multiples of 1/8 on half the tokens, Δ = 1.1e-7 (a zero multiple, in the Δ bin that straddles q·1e-6) on a
    quarter, noise on the rest: the summaries' bounds leave the count open."""
    u = rng.random(len(pos))
    return np.where(u < 0.5, 0.125 * rng.choice([-2, -1, 1, 2], len(pos)),
                    np.where(u < 0.75, 1.1e-7, rng.normal(0.0, 0.05, len(pos))))


RUNS = {"retok": retokenized, "turns": last_turn, "plain": noise(0.05), "control": noise(1e-7),
        "straddle": straddling, "old": noise(0.05)}


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    frames = {run: _tokens(run, i, make) for i, (run, make) in enumerate(RUNS.items())}
    store = metrics_load(tmp_path_factory.mktemp("residual"), pl.concat(frames.values()))
    # "old": summary rows written before the residual counts existed (nulls), as a database of then holds
    with store.transaction() as w:
        w.execute("UPDATE summary_step SET " + ", ".join(f"{c} = NULL" for c in S.RESIDUAL_SUM_NAMES)
                  + " WHERE run = ?", ["old"])
    yield store, frames
    store.close()


def ref(df: pl.DataFrame, q: float = 0.125) -> dict:
    """numpy over every token: the signature columns by their definitions."""
    d = df["trainer_logprob"].to_numpy() - df["sampler_logprob"].to_numpy()
    pos = df["pos"].to_numpy()
    k3 = np.expm1(np.clip(d, -20, 20)) - d
    nz = d != 0
    m = np.round(d / q)
    on = nz & (m != 0) & (np.abs(d / q - m) < 1e-6)
    out = {"kl_k3": k3.mean(), "first_token_kl_share": k3[pos == 0].sum() / k3.sum(),
           "k3_first": k3[pos == 0].mean(), "k3_rest": k3[pos > 0].mean(), "n_first": int((pos == 0).sum()),
           "n_nonzero": int(nz.sum()), "lattice_share": on.sum() / nz.sum() if nz.any() else None}
    if "segment" in df.columns:
        key = df.select("step", "sample", "segment").to_numpy()
        first = np.zeros(len(d), bool)
        best: dict = {}
        for i, k in enumerate(map(tuple, key)):
            if k not in best or pos[i] < pos[best[k]]:
                best[k] = i
        first[list(best.values())] = True
        low = d < -10
        out |= {"n_seg_first": int(first.sum()), "n_seg_first_low": int((first & low).sum()),
                "n_seg_rest": int((~first).sum()), "n_seg_rest_low": int((~first & low).sum())}
        out["boundary_low_share"] = out["n_seg_first_low"] / out["n_seg_first"]
        out["elsewhere_low_share"] = out["n_seg_rest_low"] / out["n_seg_rest"]
    return out


def assert_signature(row: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, float):
            assert row[k] == pytest.approx(v, rel=1e-12, abs=0.0 if v else 1e-300), k
        else:
            assert row[k] == v, k


def test_signatures_come_from_the_summaries_where_they_hold_them(db):
    store, frames = db
    sig = {r["run"]: r for r in residual.signature_table(store, list(RUNS)).iter_rows(named=True)}
    for run in RUNS:
        want = ref(frames[run])
        if run == "control":  # k3 of |Δ| ~ 1e-7 is rounding: only the counts are compared
            want = {k: v for k, v in want.items() if not k.startswith(("kl", "k3", "first_token"))}
        assert_signature(sig[run], want)
    assert {r: sig[r]["lattice_from"] for r in RUNS} == {
        "retok": "summaries", "turns": "summaries", "plain": "summaries", "control": "summaries",
        "straddle": "summaries and token rows", "old": "token rows"}
    assert sig["old"]["segments_from"] == "token rows" and sig["plain"]["segments_from"] == "summaries"
    # the control: the summaries count its tiny Δ as on the lattice (0·q); the finding's share leaves them out
    assert store.scalar("SELECT sum(n_lattice) / sum(n_d_nonzero) FROM summary_step WHERE run = 'control'") > 0.5
    assert sig["control"]["lattice_share"] == 0.0
    assert sig["straddle"]["lattice_share"] == pytest.approx(0.5, abs=0.06)
    # another quantum reads the token rows
    other = residual.signature_table(store, ["plain"], q=0.0625).row(0, named=True)
    assert other["lattice_from"] == "token rows"
    assert other["lattice_share"] == pytest.approx(ref(frames["plain"], 0.0625)["lattice_share"], rel=1e-12, abs=0)


@pytest.mark.parametrize("seed", range(4))
def test_zero_multiple_bounds_bracket_the_brute_force_count(seed):
    rng = np.random.default_rng(seed)
    edges = np.asarray(S.D_EDGES)
    d = np.concatenate([rng.normal(0, 1e-7, 300), rng.normal(0, 0.05, 300), 0.125 * rng.integers(-3, 4, 200),
                        rng.choice(edges[np.abs(edges) < 1], 50), [1.25e-7, -1.25e-7, 1.2e-7, 0.0]])
    b = delta_bins(d)
    counts = pl.DataFrame({"bin": b, "n": np.ones(len(b), np.int64)}).group_by("bin").agg(pl.col("n").sum())
    sure, maybe, far, total = residual.zero_multiple_bounds(counts)
    m = np.round(d / 0.125)
    on = (d != 0) & (np.abs(d / 0.125 - m) < 1e-6)
    zero, nonzero = int((on & (m == 0)).sum()), int((on & (m != 0)).sum())
    assert total == len(d) and sure <= zero <= sure + maybe and nonzero <= far
    share = residual.lattice_from_counts(int((d != 0).sum()), int(on.sum()), sure, maybe, far)
    assert share is None or share == nonzero / (d != 0).sum()


def test_logger_sample_reads_every_token_from_the_summaries(tmp_path):
    """A DriftLogger run keeping 10 % of its token rows: the signatures still cover every token (summaries)."""
    steps = {step: context_step(step) for step in (2, 5)}
    log = DriftLogger(tmp_path / "logs", "r", token_sample=0.1, worst_sequences=1, top_tokens=4)
    for step, data in steps.items():
        log.log_step(step, **data)
    store = Store(tmp_path / "l.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    parts = [trained(step, data) for step, data in steps.items()]
    x = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    df = pl.DataFrame({"step": x["step"], "sample": x["sample"], "pos": x["pos"], "segment": x["segment"],
                       "sampler_logprob": x["s"], "trainer_logprob": x["t"]})
    row = residual.signature_table(store, ["r"]).row(0, named=True)
    assert row["lattice_from"] == "summaries" and row["segments_from"] == "summaries"
    assert store.scalar("SELECT count(*) FROM tokens") < len(df)
    assert_signature(row, ref(df))
    store.close()


def _k3(d):
    return np.expm1(d) - d


def test_retokenization_and_per_turn_fire_where_built(db):
    store, frames = db
    found = F.findings_many(store, list(RUNS))
    kinds = {run: {f.kind for f in fs} for run, fs in found.items()}
    assert "retokenization" in kinds["retok"] and "per_turn" not in kinds["retok"]
    assert "per_turn" in kinds["turns"] and "retokenization" not in kinds["turns"]
    for run in ("plain", "control", "old", "straddle"):
        assert not {"retokenization", "per_turn"} & kinds[run], (run, kinds[run])
    retok = next(f for f in found["retok"] if f.kind == "retokenization")
    want = ref(frames["retok"])
    assert retok.numbers["boundary_low_share"] == want["boundary_low_share"]
    assert retok.numbers["n_seg_first_low"] == want["n_seg_first_low"] and retok.url.startswith("/token_drift")
    turn = next(f for f in found["turns"] if f.kind == "per_turn")
    df = frames["turns"]
    d = df["trainer_logprob"].to_numpy() - df["sampler_logprob"].to_numpy()
    seg = df["segment"].to_numpy()
    by_turn = [_k3(d[seg == j]).mean() for j in range(3)]
    assert turn.numbers["turn"] == 2
    assert turn.numbers["kl_k3_by_turn"] == pytest.approx(by_turn, rel=1e-12)
    assert turn.numbers["abs_delta_by_turn"] == pytest.approx([np.abs(d[seg == j]).mean() for j in range(3)],
                                                             rel=1e-12)
    assert turn.numbers["share_of_kl"] == pytest.approx(_k3(d[seg == 2]).sum() / _k3(d).sum(), rel=1e-12)
    assert turn.numbers["kl_k3_other_turns"] == pytest.approx(_k3(d[seg != 2]).mean(), rel=1e-12)
    assert "tokens_dim=turn" in turn.url
    assert F.RULES["retokenization"] and F.ACTIONS["per_turn"][1] and math.isfinite(F.RETOK_RATIO)


def test_runs_without_segments_stay_silent(tmp_path):
    store = metrics_load(tmp_path, _tokens("flat", 3, noise(0.05), segments=False))
    row = residual.signature_table(store, ["flat"]).row(0, named=True)
    assert row["n_seg_first"] == 0 and row["boundary_low_share"] is None
    assert not {"retokenization", "per_turn"} & {f.kind for f in F.findings_many(store, ["flat"])["flat"]}
    store.close()


def test_cli_findings_print_the_new_kinds(db, tmp_path, capsys):
    from analysis.__main__ import main
    _, frames = db
    store = metrics_load(tmp_path, pl.concat([frames["turns"], frames["retok"]]))
    path = str(store.path)
    store.close()
    assert main(["findings", "--db", path, "--run", "turns", "--run", "retok"]) == 0
    text = capsys.readouterr().out
    assert "] per_turn: Turn 2 of 3" in text and "kl_k3_by_turn = [" in text
    assert "[warn] retokenization:" in text and "see: /token_drift?" in text
