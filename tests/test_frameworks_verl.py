"""verl per-step batch dumps (FORMATS.md section 3) round-trip to canonical rows; each trap has a test."""
from __future__ import annotations

import pytest
import torch

from analysis.ingest import ingest_paths

from helpers.frameworks import PAD_ID, ROUTING_COLS, TOKEN_COLS, expected, stored, write_verl


def test_step_dumps_round_trip(tmp_path, store):
    folder = tmp_path / "verl-qwen3"
    _, exp1 = write_verl(folder, step=1, seed=1, extra={"temperature": 0.7, "meta_info": {"top_p": 1.0}})
    _, exp2 = write_verl(folder, step=2, seed=2)
    outcomes = ingest_paths(store, [folder])
    assert [(o.name, o.status, o.format) for o in outcomes] == [
        ("verl-qwen3/step_1.pt", "loaded", "verl"), ("verl-qwen3/step_2.pt", "loaded", "verl")], \
        [o.line() for o in outcomes]
    toks, routes = exp1.tokens + exp2.tokens, exp1.routing + exp2.routing
    assert stored(store, "tokens", TOKEN_COLS) == expected(toks, TOKEN_COLS)
    assert stored(store, "routing", ROUTING_COLS) == expected(routes, ROUTING_COLS, "routing")
    seq_cols = ("run", "step", "sample", "response_length")
    assert stored(store, "sequences", seq_cols) == expected(exp1.sequences + exp2.sequences, seq_cols, "sequences")
    # routed_experts is the sampler side: trainer_experts NULL, flips unknown (not "no flip")
    assert store.scalar("SELECT count(*) FROM routing WHERE trainer_experts IS NOT NULL OR flip IS NOT NULL") == 0
    assert store.run_config("verl-qwen3") == {"framework": "verl", "temperature": 0.7, "top_p": 1.0,
                                              "moe_layers": [0, 1],
                                              "routing": "sampler (rollout engine, routed_experts)"}


def test_trained_tokens_are_response_mask_not_logprob_zeros(tmp_path, store):
    path, exp = write_verl(tmp_path / "run", seed=4)
    d = torch.load(path, weights_only=True)
    ingest_paths(store, [tmp_path / "run"])
    got = {(r["sample"], r["pos"]) for r in stored(store, "tokens", TOKEN_COLS)}
    assert got == {tuple(x) for x in torch.nonzero(d["response_mask"] == 1).tolist()}
    # a trained token whose sampler log-prob is exactly 0.0 is kept
    assert d["rollout_log_probs"][1, 0] == 0.0 and (1, 0) in got
    # tool tokens (sampler 0.0, trainer real) and right padding (pad-token log-probs) are not
    assert d["response_mask"][0, 2] == 0 and d["old_log_probs"][0, 2] != 0 and (0, 2) not in got
    padded = torch.nonzero(d["responses"] == PAD_ID).tolist()
    assert padded and all(d["old_log_probs"][b, j] != 0 for b, j in padded)
    assert not got & {tuple(x) for x in padded}


def test_padding_id_is_not_zero_and_token_id_zero_is_real(tmp_path, store):
    path, exp = write_verl(tmp_path / "run", seed=5)
    ingest_paths(store, [tmp_path / "run"])
    ids = {(r["sample"], r["pos"]): r["token_id"] for r in stored(store, "tokens", TOKEN_COLS)}
    assert ids[(0, 1)] == 0  # a real token with id 0
    assert PAD_ID not in ids.values()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_routing_is_column_p_plus_j_minus_1_in_int16_and_int32(tmp_path, store, dtype):
    path, exp = write_verl(tmp_path / "run", dtype=dtype, seed=6)
    d = torch.load(path, weights_only=True)
    assert d["routed_experts"].dtype == dtype
    ingest_paths(store, [tmp_path / "run"])
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")
    P = d["prompts"].shape[1]
    for b in range(d["responses"].shape[0]):
        rows = store.rows("SELECT pos, sampler_experts FROM routing WHERE sample = ? AND layer = 1 ORDER BY pos", [b])
        for j, experts in rows:
            assert experts == d["routed_experts"][b, P + j - 1, 1].tolist()
        # the "response part" column P + j would be a zero row for the last generated token
        last = int(d["attention_mask"][b, P:].sum()) - 1
        assert d["routed_experts"][b, P + last].abs().sum() == 0
        assert rows[-1][0] == last and rows[-1][1] != [0, 0]


def test_dense_layers_dropped_and_zero_expert_kept(tmp_path, store):
    path, exp = write_verl(tmp_path / "run", n_layers=4, dense=(0, 2), k=1, seed=7)
    ingest_paths(store, [tmp_path / "run"])
    assert store.rows("SELECT DISTINCT layer FROM routing ORDER BY 1") == [(0,), (1,)]
    assert store.scalar("SELECT count(*) FROM routing WHERE sampler_experts = [0]") > 0
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")
    assert store.run_config("run")["moe_layers"] == [1, 3]


def test_single_file_dispatches_to_verl_reader(tmp_path, store):
    path, exp = write_verl(tmp_path / "run", seed=8)
    [o] = ingest_paths(store, [path], run="given")
    assert o.status == "loaded" and o.format == "pt", o.line()
    want = [dict(r, run="given") for r in exp.routing]
    assert stored(store, "routing", ROUTING_COLS) == expected(want, ROUTING_COLS, "routing")


def test_safetensors_dump_in_a_folder(tmp_path, store):
    _, exp = write_verl(tmp_path / "st-run", fmt="safetensors", seed=9)
    [o] = ingest_paths(store, [tmp_path / "st-run"])
    assert o.status == "loaded" and o.format == "verl", o.line()
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")


def test_missing_rollout_logprobs_names_the_switch(tmp_path, store):
    path, _ = write_verl(tmp_path / "run", seed=10)
    d = torch.load(path, weights_only=True)
    del d["rollout_log_probs"]
    torch.save(d, path)
    [o] = ingest_paths(store, [tmp_path / "run"])
    assert o.status == "refused"
    assert "required tensor 'rollout_log_probs' is missing" in o.message
    assert "actor_rollout_ref.rollout.calculate_log_probs=True" in o.message


def test_reload_is_a_no_op(tmp_path, store):
    write_verl(tmp_path / "run", seed=11)
    assert [o.status for o in ingest_paths(store, [tmp_path / "run"])] == ["loaded"]
    assert [o.status for o in ingest_paths(store, [tmp_path / "run"])] == ["skipped"]
