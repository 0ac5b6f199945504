"""prime-rl traces with the trainer's annotations (FORMATS.md "2026-H2"): the fixture is written in the layout of
prime-rl's file monitor and verifiers' Episode records (tests/helpers/frameworks.py, write_primerl_traces) and the
database must hold its values: log-probs exactly, mismatch_kl within its 6-decimal rounding, the precision floor."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from analysis.ingest import ingest_paths
from analysis.ingest.detect import detect

from helpers.frameworks import expected, stored, traces_episode, write_primerl_traces, zip_folder

COLS = ("run", "step", "sample", "pos", "token_id", "sampler_logprob", "trainer_logprob", "trainer_entropy",
        "sampler_version", "trainer_version")
SEQ_COLS = ("run", "step", "sample", "reward", "advantage", "prompt", "response", "response_length")
TRACES = "rollouts/step_{}/train/effective/traces.jsonl"


def test_folder_round_trip(tmp_path, store):
    out, exp = write_primerl_traces(tmp_path, steps=(1, 2), episodes=3)
    outcomes = {o.name: o for o in ingest_paths(store, [out])}
    loaded = sorted(n for n, o in outcomes.items() if o.status == "loaded")
    assert loaded == [f"traces-run/{TRACES.format(s)}" for s in (1, 2)], [o.line() for o in outcomes.values()]
    assert all(outcomes[n].format == "prime-rl-traces" for n in loaded)
    skipped = {n: o.message for n, o in outcomes.items() if o.status == "skipped"}
    assert sorted(skipped) == sorted(f"traces-run/rollouts/step_{s}/{k}/traces.jsonl"
                                     for s in (1, 2) for k in ("train/all", "eval/effective"))
    assert all("evaluation" in m for n, m in skipped.items() if "eval/" in n)
    # metrics.jsonl is prime-rl's metric sink: claimed, neither loaded nor refused
    assert not any("metrics.jsonl" in n for n in outcomes)
    assert stored(store, "tokens", COLS) == expected(exp.tokens, COLS)
    assert stored(store, "sequences", SEQ_COLS) == expected(exp.sequences, SEQ_COLS, table="sequences")
    assert store.run_names() == ["traces-run"] and store.run_config("traces-run") == {"framework": "prime-rl"}


def test_branches_and_untrained_traces(tmp_path, store):
    out, exp = write_primerl_traces(tmp_path, steps=(3,), episodes=2, extra_files=False)
    ingest_paths(store, [out])
    # episode 1 branches (two leaves): samples 1000 and 1001; the non-trainable and failed traces add nothing
    assert [r[0] for r in store.rows("SELECT DISTINCT sample FROM tokens ORDER BY 1")] == [0, 1000, 1001]
    rec = json.loads((out / TRACES.format(3)).read_text().splitlines()[1])
    nodes = rec["traces"][0]["nodes"]
    n_second_leaf = sum(nodes[5]["mask"])
    assert store.scalar("SELECT count(*) FROM tokens WHERE sample = 1001") == n_second_leaf
    # the second leaf's tokens are exactly node 5's sampled ones, in order, pos 0..n-1
    rows = store.rows("SELECT pos, token_id, sampler_logprob FROM tokens WHERE sample = 1001 ORDER BY pos")
    sampled = [t for t, m in zip(nodes[5]["token_ids"], nodes[5]["mask"]) if m]
    assert rows == [(i, t, s) for i, (t, s) in enumerate(zip(sampled, nodes[5]["logprobs"]))]


def test_mismatch_kl_equals_the_files_within_its_rounding(tmp_path, store):
    out, exp = write_primerl_traces(tmp_path, steps=(1,), episodes=4, extra_files=False)
    ingest_paths(store, [out])
    d = np.array([r[0] for r in store.rows("SELECT trainer_logprob - sampler_logprob FROM tokens "
                                           "ORDER BY run, step, sample, pos")])
    ours = np.expm1(d) - d  # k3 = r - 1 - log r, prime-rl's mismatch_kl (trainer/rl/loss.py:100-106 at 559b447)
    theirs = np.array([t["mismatch_kl"] for t in expected(exp.tokens, ("run", "step", "sample", "pos",
                                                                        "mismatch_kl"))])
    assert len(ours) == len(theirs) > 10
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=0.5e-6 + 1e-12)
    assert ((theirs == 0) & (ours > 0)).any()  # the rounding flattened some to zero: the floor is real


def test_precision_floor_is_recorded_per_file(tmp_path, store):
    out, _ = write_primerl_traces(tmp_path, steps=(1, 2), extra_files=False)
    ingest_paths(store, [out])
    assert store.rows("SELECT precision_floor FROM files ORDER BY file_id") == [(1e-6,), (1e-6,)]
    assert store.precision_floors() == {"traces-run": 1e-6}


def test_logprobs_written_with_few_decimals_raise_the_floor(tmp_path, store):
    out, exp = write_primerl_traces(tmp_path, steps=(1,), lp_decimals=4, extra_files=False)
    ingest_paths(store, [out])
    # trainer_logprobs written with 4 decimals: half a unit of the 4th, coarser than mismatch_kl's 1e-6
    assert store.precision_floors() == {"traces-run": pytest.approx(5e-5, rel=1e-12)}
    assert stored(store, "tokens", COLS) == expected(exp.tokens, COLS)


def test_a_lone_file_is_recognised_by_content(tmp_path, store):
    out, exp = write_primerl_traces(tmp_path, steps=(2,), episodes=2, extra_files=False)
    f = out / TRACES.format(2)
    with open(f, "rb") as fp:
        assert detect(fp, "traces.jsonl").format == "prime-rl-traces"
    # given alone, inside its folders: run and step from them
    (o,) = ingest_paths(store, [f])
    assert o.status == "loaded" and o.runs == ["traces-run"], o.line()
    assert stored(store, "tokens", COLS) == expected(exp.tokens, COLS)


def test_a_file_outside_its_folders_takes_the_dispatch_step(tmp_path, store):
    out, _ = write_primerl_traces(tmp_path / "a", steps=(4,), episodes=1, extra_files=False)
    loose = tmp_path / "loose.jsonl"
    shutil.copy(out / TRACES.format(4), loose)
    (o,) = ingest_paths(store, [loose], run="mine")
    assert o.status == "loaded", o.line()
    # run.work.step (the builder dispatches at step - 1) and no trainer_version without the trained step
    assert store.rows("SELECT DISTINCT step, trainer_version FROM tokens") == [(3, None)]


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_half_formed_trace_is_refused_whole(tmp_path, store):
    rng = np.random.default_rng(5)
    good, _ = traces_episode(rng, 1, 0)
    bad, _ = traces_episode(rng, 1, 1)
    del bad["traces"][0]["nodes"][4]["trainer_logprobs"]  # the second turn was never annotated
    f = tmp_path / "run" / TRACES.format(1)
    _write(f, [good, bad])
    (o,) = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "refused"
    assert "traces.jsonl" in o.message and "line 2 trace 0 branch 0 node 4" in o.message, o.message
    assert "'trainer_logprobs'" in o.message
    assert store.scalar("SELECT count(*) FROM tokens") == 0 and store.scalar("SELECT count(*) FROM files") == 0


def test_traces_without_any_annotation_are_refused(tmp_path, store):
    rng = np.random.default_rng(6)
    f = tmp_path / "run" / TRACES.format(1)
    _write(f, [traces_episode(rng, 1, e, annotate=False)[0] for e in range(2)])
    (o,) = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "refused" and "no trainer annotation" in o.message and "line 1" in o.message, o.message


@pytest.mark.parametrize("key", ["trainer_logprobs", "logprobs", "mismatch_kl"])
def test_an_annotation_of_the_wrong_length_is_refused(tmp_path, store, key):
    rng = np.random.default_rng(7)
    rec, _ = traces_episode(rng, 1, 0)
    rec["traces"][0]["nodes"][2][key].append(-0.5)
    f = tmp_path / "run" / TRACES.format(1)
    _write(f, [rec])
    (o,) = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "refused" and f"'{key}' has" in o.message and "node 2" in o.message, o.message


def test_a_null_trainer_logprob_is_refused(tmp_path, store):
    rng = np.random.default_rng(8)
    rec, _ = traces_episode(rng, 1, 0)
    rec["traces"][0]["nodes"][4]["trainer_logprobs"][1] = None
    f = tmp_path / "run" / TRACES.format(1)
    _write(f, [rec])
    (o,) = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "refused" and "sampled token 1" in o.message and "node 4" in o.message, o.message


def test_a_step_without_its_effective_cohort_waits(tmp_path, store):
    rng = np.random.default_rng(9)
    _write(tmp_path / "run" / "rollouts" / "step_1" / "train" / "all" / "traces.jsonl", [traces_episode(rng, 1, 0)[0]])
    (o,) = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "skipped" and "not finalised" in o.message, o.line()


def test_the_command_line_and_the_upload_recognise_the_layout(tmp_path, capsys):
    from analysis.__main__ import main
    from analysis.ingest.uploads import ingest_uploads
    from analysis.store import Store
    out, exp = write_primerl_traces(tmp_path / "logs", steps=(1, 2), episodes=2)
    assert main(["ingest", str(out), "--db", str(tmp_path / "cli.duckdb")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("loaded ") and "[prime-rl-traces]" in line for line in lines) == 2, lines
    store = Store(tmp_path / "up.duckdb")
    outcomes = ingest_uploads(store, [("my-run.zip", zip_folder(out))])
    assert sorted(o.status for o in outcomes) == ["loaded"] * 2 + ["skipped"] * 4, [o.line() for o in outcomes]
    assert stored(store, "tokens", COLS) == expected(exp.tokens, COLS)  # the run: the zipped output dir
    # one traces file uploaded alone: recognised by content; the run named at upload, the step its episodes'
    with open(out / TRACES.format(2), "rb") as fp:
        (o,) = ingest_uploads(Store(tmp_path / "one.duckdb"), [("traces.jsonl", fp)], run="uploaded")
    assert o.status == "loaded" and o.format == "prime-rl-traces" and o.runs == ["uploaded"], o.line()
    store.close()
