"""analysis.metrics.corrections against a numpy reference written from METRICS.md (Corrections), on seeded sequences with
rewards and advantages loaded through the real ingest path (sequence JSON Lines), plus the edge cases."""
from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest

from analysis.__main__ import main
from analysis.metrics import corrections as C

from helpers.corrections import CHOICES, DEFAULTS, check, ref_corrections, seq_table_keys
from helpers.data import metrics_make_tokens
from helpers.reference import assert_close


def write_sequences(path, tokens: pl.DataFrame, seed: int, rewards: bool = True):
    """Sequence JSON Lines of `tokens`, each line with a reward (some null) and an advantage (some exactly 0)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for (run, step, sample), g in tokens.sort("run", "step", "sample", "pos").group_by(
                ["run", "step", "sample"], maintain_order=True):
            line = {"run": run, "step": step, "sample": sample,
                    "sampler_logprobs": g["sampler_logprob"].to_list(),
                    "trainer_logprobs": g["trainer_logprob"].to_list()}
            if rewards:
                u = rng.random()
                line["reward"] = None if u < 0.15 else float(rng.integers(0, 2))
                line["advantage"] = 0.0 if u > 0.85 else float(rng.normal())
            f.write(json.dumps(line) + "\n")


def load(tmp_path, tokens, seed=3, rewards=True, sub="db"):
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    folder = tmp_path / sub
    folder.mkdir()
    write_sequences(folder / "seqs.jsonl", tokens, seed, rewards)
    store = Store(tmp_path / f"{sub}.duckdb")
    outcomes = ingest_paths(store, [folder / "seqs.jsonl"])
    assert [o.status for o in outcomes] == ["loaded"], [o.line() for o in outcomes]
    return store


def seq_table(store) -> dict:
    return {(r, s, q): (rw, adv) for r, s, q, rw, adv in
            store.rows("SELECT run, step, sample, reward, advantage FROM sequences")}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    tokens = metrics_make_tokens(seed=21, steps=(0, 1, 2, 3), n_seq=9, sd=0.25, optional=False)
    # one token in 97 far below the sampler (r = e^-12 < the veto's 1e-4)
    far = (pl.int_range(pl.len()) % 97) == 5
    tokens = tokens.with_columns(trainer_logprob=pl.when(far).then(pl.col("sampler_logprob") - 12.0)
                                 .otherwise(pl.col("trainer_logprob")))
    store = load(tmp_path_factory.mktemp("corr"), tokens)
    yield store, tokens, seq_table(store)
    store.close()


@pytest.mark.parametrize("method, params", CHOICES)
@pytest.mark.parametrize("by", ["step", "run"])
@pytest.mark.parametrize("source", ["auto", "tokens"])  # auto: the per-sequence summaries, tis aside
def test_every_column_matches_numpy(seeded, method, params, by, source):
    store, tokens, seqs = seeded
    keys = ["run", "step"] if by == "step" else ["run"]
    df = C.corrections(store, ["a", "b"], method, params, by=by, source=source)
    assert df.columns == [c for c in C.COLUMNS if c != "step" or by == "step"]
    check(df, ref_corrections(tokens, seqs, method, params, keys), keys, method, params)


def test_seeded_data_exercises_every_path(seeded):
    """The reference comparison above means something only if the data masks some but not all, and has
    rewards and advantages of both signs among masked and kept sequences."""
    store, tokens, seqs = seeded
    for method, params in [c for c in CHOICES if c[0] != "tis"]:  # tis masks nothing
        row = C.corrections(store, ["a", "b"], method, params, by="run").row(0, named=True)
        assert 0 < row["masked_seq_frac"] < 1, (method, params, row)
        assert row["masked_reward_mean"] is not None and row["kept_reward_mean"] is not None
        assert row["masked_adv_pos_frac"] is not None and row["masked_adv_neg_frac"] is not None
    assert any(v[0] is None for v in seqs.values()) and any(v[1] == 0.0 for v in seqs.values())


def test_step_range_and_hand_example(tmp_path):
    # the docstring example: one sequence, r = 1 and 0.25 -> icepop masks one token
    tokens = pl.DataFrame({"run": ["e", "e"], "step": [0, 0], "sample": [0, 0], "pos": [0, 1],
                           "sampler_logprob": [-1.0, math.log(0.5)], "trainer_logprob": [-1.0, math.log(0.125)]})
    store = load(tmp_path, tokens)
    row = C.corrections(store, "e", "icepop", by="run").row(0, named=True)
    assert (row["masked_token_frac"], row["masked_seq_frac"], row["weight_mean"], row["ess_after"]) == (0.5, 1.0, 0.5, 1.0)
    assert C.corrections(store, "e", "icepop", steps=(1, 5)).is_empty()


def test_nothing_masked(seeded):
    store, tokens, seqs = seeded
    df = C.corrections(store, ["a", "b"], "icepop", {"alpha": 1e-12, "beta": 1e12}, by="step")
    assert df["masked_token_frac"].to_list() == [0.0] * df.height
    assert df["masked_seq_frac"].to_list() == [0.0] * df.height
    assert df["masked_reward_mean"].null_count() == df.height  # no masked sequence: NULL, not NaN
    assert df["kept_reward_mean"].null_count() == 0
    assert df["masked_adv_pos_frac"].to_list() == [0.0] * df.height


def test_everything_masked_gives_null_ess(seeded):
    store, tokens, seqs = seeded
    for method, params in (("geo_rs", {"lo": 1e6, "hi": 1e6}), ("veto", {"tau": 1e9})):
        df = C.corrections(store, ["a", "b"], method, params, by="step")
        assert df["masked_token_frac"].to_list() == [1.0] * df.height
        assert df["weight_mean"].to_list() == [0.0] * df.height
        assert df["ess_after"].null_count() == df.height
        assert df["kept_reward_mean"].null_count() == df.height
        assert df["masked_adv_neg_frac"].to_list() == [1.0] * df.height


def test_no_rewards_gives_null_reward_columns(tmp_path):
    tokens = metrics_make_tokens(seed=5, runs=("a",), steps=(0, 1), n_seq=6, optional=False)
    store = load(tmp_path, tokens, rewards=False)
    for method, params in CHOICES:
        df = C.corrections(store, "a", method, params, by="step")
        for col in ("masked_reward_mean", "kept_reward_mean", "masked_adv_pos_frac", "masked_adv_neg_frac"):
            assert df[col].null_count() == df.height, (method, col)
        check(df, ref_corrections(tokens, {k: (None, None) for k in seq_table_keys(tokens)}, method, params,
                                  ["run", "step"]), ["run", "step"], method, params)


def test_identical_logprobs_mask_nothing_with_defaults(tmp_path):
    rng = np.random.default_rng(1)
    s = -rng.exponential(2.0, 200)
    tokens = pl.DataFrame({"run": ["e"] * 200, "step": [0] * 200, "sample": rng.integers(0, 9, 200).tolist(),
                           "sampler_logprob": s, "trainer_logprob": s}).sort("sample")
    tokens = tokens.with_columns(pos=pl.int_range(pl.len()).over("sample"))
    store = load(tmp_path, tokens)
    for method in DEFAULTS:
        row = C.corrections(store, "e", method, by="run").row(0, named=True)
        assert (row["masked_token_frac"], row["masked_seq_frac"]) == (0.0, 0.0), method
        assert (row["weight_mean"], row["ess_after"]) == (1.0, 1.0), method


def test_bad_parameters_are_refused(seeded):
    store, _, _ = seeded
    with pytest.raises(ValueError, match="no parameter 'C'.*alpha"):
        C.corrections(store, "a", "icepop", {"C": 3})
    with pytest.raises(ValueError, match="alpha must be < beta"):
        C.corrections(store, "a", "icepop", {"alpha": 2, "beta": 1})
    with pytest.raises(ValueError, match="unknown correction method"):
        C.corrections(store, "a", "clip", {})
    with pytest.raises(ValueError, match="must be a number"):
        C.corrections(store, "a", "veto", {"tau": "x"})
    with pytest.raises(ValueError, match="K=V"):
        C.parse_param_args(["alpha"])


def test_cli(tmp_path, capsys):
    tokens = metrics_make_tokens(seed=9, runs=("a", "b"), steps=(0, 1), n_seq=6, optional=False)
    store = load(tmp_path, tokens)
    seqs, db = seq_table(store), str(store.path)
    store.close()  # the CLI opens the file read-only
    rc = main(["corrections", "--db", db, "--run", "a", "--method", "icepop", "--param", "alpha=0.8",
               "--param", "beta=1.25", "--by", "run", "--format", "json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    want = ref_corrections(tokens.filter(pl.col("run") == "a"), seqs, "icepop", {"alpha": 0.8, "beta": 1.25}, ["run"])
    assert_close(got[0]["masked_token_frac"], want[("a",)]["masked_token_frac"])
    assert_close(got[0]["ess_after"], want[("a",)]["ess_after"])
    assert main(["corrections", "--db", db, "--method", "veto", "--param", "alpha=1"]) == 1
    assert "veto has no parameter 'alpha'" in capsys.readouterr().err
    assert main(["corrections", "--db", db, "--run", "zz", "--method", "tis"]) == 1
    assert "no run named 'zz'" in capsys.readouterr().err
    # verl's rejection options chained with commas, as verl's config spells them
    rc = main(["corrections", "--db", db, "--run", "a", "--method", "verl_rs", "--param",
               "rollout_rs=token_k1,seq_sum_k2", "--param", "rollout_rs_threshold=0.3_3,6", "--by", "run",
               "--format", "json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    p = {"rollout_rs": "token_k1,seq_sum_k2", "rollout_rs_threshold": "0.3_3,6"}
    want = ref_corrections(tokens.filter(pl.col("run") == "a"), seqs, "verl_rs", p, ["run"])
    assert_close(got[0]["masked_token_frac"], want[("a",)]["masked_token_frac"])
    assert main(["corrections", "--db", db, "--method", "verl_rs", "--param", "rollout_rs=token_k9"]) == 1
    assert "rollout_rs option 'token_k9'" in capsys.readouterr().err
    assert main(["corrections", "--db", db, "--method", "verl_rs", "--param", "rollout_rs=seq_max_k2",
                 "--param", "rollout_rs_threshold=0.5_2"]) == 1
    assert "takes one upper bound" in capsys.readouterr().err


def test_one_pass_equals_the_separate_calls_and_compare_methods_stacks(seeded):
    store, _, _ = seeded
    both = C.corrections_by_step_and_run(store, ["a", "b"], "icepop", {"alpha": 0.8}, steps=(1, 3))
    for by in ("step", "run"):
        assert both[by].equals(C.corrections(store, ["a", "b"], "icepop", {"alpha": 0.8}, by=by, steps=(1, 3)))
    sim = C.compare_methods(store, ["a"], [("veto", {}), ("tis", {"C": 1.5})])
    assert sim["run"]["method"].to_list() == ["veto", "tis"]
    assert sim["step"].height == 2 * 4 and sim["step"].columns == list(C.COLUMNS)


def test_compare_methods_in_one_pass_equals_each_method_alone(seeded):
    """All the choices share one query (parameters prefixed per method: geo_rs and seq_rs both have lo/hi)."""
    store, _, _ = seeded
    sim = C.compare_methods(store, ["a", "b"], CHOICES, steps=(0, 2))
    for by, keys in (("step", ["method", "params", "run", "step"]), ("run", ["method", "params", "run"])):
        alone = pl.concat([C.corrections(store, ["a", "b"], m, p, by=by, steps=(0, 2)) for m, p in CHOICES])
        assert sim[by].select(keys).equals(alone.select(keys))
        for got, want in zip(sim[by].iter_rows(named=True), alone.iter_rows(named=True)):
            for col in C.COLUMNS[4:]:
                assert_close(got[col], want[col], f"{by} {got['method']} {col}")
