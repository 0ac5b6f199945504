"""prime-rl token exports (FORMATS.md section 1) round-trip to canonical rows; each trap has a test."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from analysis.ingest import ingest_paths

from helpers.frameworks import TOKEN_COLS, expected, primerl_record, stored, write_primerl, write_primerl_single_file


def test_step_folders_round_trip(tmp_path, store):
    export, exp = write_primerl(tmp_path / "out", steps=(1, 2), ranks=2, per_rank=3)
    outcomes = ingest_paths(store, [export])
    assert [o.status for o in outcomes] == ["loaded", "loaded"], [o.line() for o in outcomes]
    assert [o.name for o in outcomes] == ["token_exports/step_1", "token_exports/step_2"]
    assert all(o.format == "prime-rl" for o in outcomes)
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)
    # the run is the trainer's output_dir (the folder holding token_exports/), with its context
    assert store.run_names() == ["primerl-run"]
    assert store.run_config("primerl-run") == {"framework": "prime-rl"}


def test_output_dir_or_parent_folder_finds_the_export(tmp_path, store):
    export, exp = write_primerl(tmp_path / "runs", steps=(1,), ranks=1, per_rank=2)
    outcomes = ingest_paths(store, [tmp_path / "runs"])
    assert [o.status for o in outcomes] == ["loaded"]
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)


def test_trained_tokens_are_exactly_loss_mask_and_zero_logprob_is_kept(tmp_path, store):
    export, exp = write_primerl(tmp_path, steps=(1,), ranks=1, per_rank=1, zero_trained=True)
    ingest_paths(store, [export])
    rec = json.loads((export / "step_1" / "rank_0.jsonl").read_text().splitlines()[0])
    n_trained = sum(rec["loss_mask"])
    rows = stored(store, "tokens", TOKEN_COLS)
    assert len(rows) == n_trained < len(rec["token_ids"])
    # the first trained token has sampler log-prob exactly 0.0 and is a real row, not padding
    first = rec["loss_mask"].index(True)
    assert rec["inference_logprobs"][first] == 0.0
    assert rows[0]["sampler_logprob"] == 0.0 and rows[0]["token_id"] == rec["token_ids"][first]
    # untrained tokens (prompt, tool turn) with their 0.0 sampler values never appear
    assert [r["token_id"] for r in rows] == [t for t, m in zip(rec["token_ids"], rec["loss_mask"]) if m]


def test_pos_is_index_among_trained_tokens_across_tool_turn(tmp_path, store):
    export, _ = write_primerl(tmp_path, steps=(1,), ranks=1, per_rank=1)
    ingest_paths(store, [export])
    rec = json.loads((export / "step_1" / "rank_0.jsonl").read_text().splitlines()[0])
    pos = [r["pos"] for r in stored(store, "tokens", TOKEN_COLS)]
    assert pos == list(range(sum(rec["loss_mask"])))  # the tool turn leaves no hole


def test_sample_id_encodes_rank_and_export_sequence_idx(tmp_path, store):
    export, _ = write_primerl(tmp_path, steps=(4,), ranks=3, per_rank=2)
    ingest_paths(store, [export])
    samples = [r[0] for r in store.rows("SELECT DISTINCT sample FROM tokens ORDER BY 1")]
    assert samples == [0, 1, 1_000_000, 1_000_001, 2_000_000, 2_000_001]
    assert store.rows("SELECT DISTINCT step FROM tokens") == [(4,)]  # the trainer step as exported


def test_logprobs_are_the_two_columns_not_mismatch_kl(tmp_path, store):
    export, _ = write_primerl(tmp_path, steps=(1,), ranks=1, per_rank=2)
    # corrupt the exported derived columns: they must not matter
    path = export / "step_1" / "rank_0.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for r in recs:
        r["mismatch_kl"] = [123.0] * len(r["token_ids"])
        r["importance_ratio"] = [None] * len(r["token_ids"])
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    ingest_paths(store, [export])
    got = store.rows("SELECT sampler_logprob, trainer_logprob FROM tokens ORDER BY sample, pos")
    want = [(s, t) for r in recs for s, t, m in zip(r["inference_logprobs"], r["trainer_logprobs"], r["loss_mask"])
            if m]
    assert got == want
    # k3 from the stored doubles equals an independent double computation, not the float32 export
    kl = store.scalar("SELECT avg(exp(trainer_logprob - sampler_logprob) - 1 - (trainer_logprob - sampler_logprob)) "
                      "FROM tokens")
    d = np.array([t - s for s, t in want])
    assert kl == pytest.approx(float(np.mean(np.exp(d) - 1 - d)), rel=1e-12)


def test_step_without_stable_is_skipped_while_others_have_it(tmp_path, store):
    export, exp = write_primerl(tmp_path / "out", steps=(1, 2, 3), ranks=2, per_rank=1, stable=(1, 2))
    outcomes = ingest_paths(store, [export])
    by_name = {o.name: o for o in outcomes}
    assert by_name["token_exports/step_3"].status == "skipped"
    assert "no STABLE marker" in by_name["token_exports/step_3"].message
    assert "still writing" in by_name["token_exports/step_3"].message
    assert {o.status for n, o in by_name.items() if n != "token_exports/step_3"} == {"loaded"}
    assert store.rows("SELECT DISTINCT step FROM tokens ORDER BY 1") == [(1,), (2,)]
    # once the trainer marks it, loading again adds step 3 only
    (export / "step_3" / "STABLE").touch()
    again = ingest_paths(store, [export])
    assert [o.status for o in again] == ["skipped", "skipped", "loaded"]
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)


def test_in_progress_step_folder_given_alone_is_skipped_and_rank_file_refused(tmp_path, store):
    export, _ = write_primerl(tmp_path / "out", steps=(1, 2), ranks=1, per_rank=1, stable=(1,))
    [o] = ingest_paths(store, [export / "step_2"])
    assert o.status == "skipped" and "no STABLE marker" in o.message
    [o] = ingest_paths(store, [export / "step_2" / "rank_0.jsonl"])
    assert o.status == "refused" and "still writing" in o.message
    assert store.scalar("SELECT count(*) FROM tokens") == 0


def test_export_without_any_stable_loads_every_step(tmp_path, store):
    export, exp = write_primerl(tmp_path / "out", steps=(1, 2), stable=False)
    outcomes = ingest_paths(store, [export])
    assert [o.status for o in outcomes] == ["loaded", "loaded"]
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)


def test_old_single_rank_file_holds_all_steps(tmp_path, store):
    export, exp = write_primerl_single_file(tmp_path, steps=(1, 2, 3))
    outcomes = ingest_paths(store, [export])
    assert [(o.name, o.status) for o in outcomes] == [("token_exports/rank_0.jsonl", "loaded")]
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)
    assert store.rows("SELECT DISTINCT step FROM tokens ORDER BY 1") == [(1,), (2,), (3,)]


def test_single_rank_file_is_recognised_by_content(tmp_path, store):
    export, exp = write_primerl(tmp_path / "out", steps=(1,), ranks=2, per_rank=2)
    renamed = tmp_path / "whatever.txt"
    shutil.copy(export / "step_1" / "rank_1.jsonl", renamed)
    [o] = ingest_paths(store, [renamed], run="named")
    assert o.status == "loaded" and o.format == "prime-rl", o.line()
    want = [dict(r, run="named") for r in exp.tokens if r["sample"] >= 1_000_000]
    assert stored(store, "tokens", TOKEN_COLS) == expected(want, TOKEN_COLS)
    # without --run, a file outside token_exports/ has no run name to default to
    [o] = ingest_paths(store, [renamed])
    assert o.status == "refused" and "pass --run NAME" in o.message


def test_unknown_keys_ignored_and_missing_export_index_counted(tmp_path, store):
    rng = np.random.default_rng(5)
    export = tmp_path / "r" / "token_exports" / "step_7"
    export.mkdir(parents=True)
    recs = []
    for idx in range(3):
        rec, _ = primerl_record(rng, 7, 0, idx, 0, idx)
        del rec["export_sequence_idx"]
        rec["brand_new_field"] = [1, 2, 3]
        recs.append(rec)
    (export / "rank_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    [o] = ingest_paths(store, [export.parent])
    assert o.status == "loaded", o.line()
    assert store.rows("SELECT DISTINCT sample FROM tokens ORDER BY 1") == [(0,), (1,), (2,)]


def test_null_logprob_on_trained_token_refuses_the_step(tmp_path, store):
    export, _ = write_primerl(tmp_path / "out", steps=(1,), ranks=2, per_rank=2)
    path = export / "step_1" / "rank_1.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    i = recs[1]["loss_mask"].index(True)
    recs[1]["trainer_logprobs"][i] = None  # the exporter writes non-finite values as null
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    [o] = ingest_paths(store, [export])
    assert o.status == "refused"
    assert o.message == (f"token_exports/step_1: rank_1.jsonl line 2 (step 1, rank 1, export_sequence_idx 1), "
                         f"token {i}: 'trainer_logprobs' is None on a trained token (the exporter writes non-finite "
                         f"values as null) (a trained token needs finite log-probs from both sides)")
    assert store.scalar("SELECT count(*) FROM tokens") == 0  # all-or-nothing: rank_0 is not loaded either
