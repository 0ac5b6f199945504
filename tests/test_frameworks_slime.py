"""slime `--dump-details` folders (FORMATS.md section 2) round-trip to canonical rows; each trap has a test."""
from __future__ import annotations

import shlex
import sys

import numpy as np
import torch

from analysis.ingest import ingest_paths

from helpers.frameworks import ROUTING_COLS, TOKEN_COLS, expected, stored, write_slime


def test_dump_folder_round_trip(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0, 1))
    outcomes = ingest_paths(store, [dump])
    status = {o.name: o.status for o in outcomes}
    assert status == {"slime-dump/{rollout_data,train_data}/0.pt": "loaded",
                      "slime-dump/{rollout_data,train_data}/1.pt": "loaded",
                      "slime-dump/rollout_data/eval_0.pt": "skipped"}, [o.line() for o in outcomes]
    cols = TOKEN_COLS + ("sampler_version",)
    assert stored(store, "tokens", cols) == expected(exp.tokens, cols)
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")
    seq_cols = ("run", "step", "sample", "reward", "response_length")
    assert stored(store, "sequences", seq_cols) == expected(exp.sequences, seq_cols, "sequences")
    # one-sided routing: the trainer replays the sampler's experts, so its side is NULL, never a copy
    assert store.scalar("SELECT count(*) FROM routing WHERE trainer_experts IS NOT NULL OR flip IS NOT NULL") == 0
    # run context from the dump: sampling settings in the samples' metadata, which layers are MoE
    assert store.run_config("slime-dump") == {"framework": "slime", "temperature": 0.8, "top_p": 0.95,
                                              "moe_layers": [0, 2],
                                              "routing": "sampler (rollout engine, rollout_routed_experts)"}


def test_step_is_rollout_id_and_routing_alignment_is_row_p_plus_j_minus_1(tmp_path, store):
    dump, _ = write_slime(tmp_path, rollout_ids=(5,), removed=(), eval_ids=())
    ingest_paths(store, [dump])
    assert store.rows("SELECT DISTINCT step FROM tokens") == [(5,)]
    rollout = torch.load(dump / "rollout_data" / "5.pt", weights_only=True)["samples"]
    train = torch.load(dump / "train_data" / "5.pt", weights_only=True)["samples"]
    for ts in train:
        b = ts["rollout_position"]
        P = ts["total_lengths"] - ts["response_lengths"]
        x = rollout[b]["rollout_routed_experts"]
        got = store.rows("SELECT pos, sampler_experts FROM routing WHERE sample = ? AND layer = 0 ORDER BY pos", [b])
        assert got, b
        for j, experts in got:
            assert experts == x[P + j - 1, 0].tolist()  # the row before the token, not its own row P + j
        # response token 0 reads the last prompt position's row
        assert got[0] == (0, x[P - 1, 0].tolist())
        # and the last response token has a row although the engine has none for its own position
        assert x.shape[0] == ts["total_lengths"] - 1 and got[-1][0] == ts["response_lengths"] - 1


def test_tool_tokens_with_zero_sampler_logprob_are_excluded(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), removed=(), eval_ids=())
    ingest_paths(store, [dump])
    train = torch.load(dump / "train_data" / "0.pt", weights_only=True)["samples"]
    for ts in train:
        mask = ts["loss_masks"].tolist()
        tool = [j for j, m in enumerate(mask) if not m]
        assert tool and all(ts["rollout_log_probs"][j] == 0.0 for j in tool)
        assert all(ts["log_probs"][j] != 0.0 for j in tool)  # the trainer has real values there
        pos = [r[0] for r in store.rows("SELECT pos FROM tokens WHERE sample = ? ORDER BY pos",
                                        [ts["rollout_position"]])]
        assert pos == [j for j, m in enumerate(mask) if m]


def test_removed_samples_contribute_nothing(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), removed=(1, 3), eval_ids=())
    rollout = torch.load(dump / "rollout_data" / "0.pt", weights_only=True)["samples"]
    train = torch.load(dump / "train_data" / "0.pt", weights_only=True)["samples"]
    # the rollout dump keeps its loss mask; only the train dump's is all zeros
    assert rollout[1]["remove_sample"] and any(rollout[1]["loss_mask"]) and not train[1]["loss_masks"].any()
    ingest_paths(store, [dump])
    for table in ("tokens", "routing", "sequences"):
        assert store.rows(f"SELECT DISTINCT sample FROM {table} ORDER BY 1") == [(0,), (2,)]


def test_dense_layers_dropped_by_layer_and_zero_is_a_valid_expert(tmp_path, store):
    # top-1 routing over 4 experts: many rows of MoE layers are [0], a real expert; layers 0 and 3 dense
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), n_layers=4, dense=(0, 3), k=1, eval_ids=(), seed=3)
    ingest_paths(store, [dump])
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")
    assert store.rows("SELECT DISTINCT layer FROM routing ORDER BY 1") == [(0,), (1,)]
    assert store.scalar("SELECT count(*) FROM routing WHERE sampler_experts = [0]") > 0
    assert store.run_config("slime-dump")["moe_layers"] == [1, 2]


def test_eval_dumps_are_not_merged_into_the_step(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), eval_ids=(0, 1))
    outcomes = ingest_paths(store, [dump])
    skipped = sorted((o.name, o.message) for o in outcomes if o.status == "skipped")
    assert skipped == [(f"slime-dump/rollout_data/eval_{i}.pt", "evaluation rollout (no trainer side): not loaded")
                       for i in (0, 1)]
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)


def test_rollout_without_train_dump_is_skipped_with_reason(tmp_path, store):
    dump, _ = write_slime(tmp_path, rollout_ids=(0, 1), eval_ids=())
    (dump / "train_data" / "1.pt").unlink()
    outcomes = {o.name: o for o in ingest_paths(store, [dump])}
    o = outcomes["slime-dump/{rollout_data,train_data}/1.pt"]
    assert o.status == "skipped" and "no train_data/1.pt" in o.message
    assert store.rows("SELECT DISTINCT step FROM tokens") == [(0,)]


def test_train_dump_alone_gives_tokens_without_routing(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), eval_ids=())
    (dump / "rollout_data" / "0.pt").unlink()
    [o] = ingest_paths(store, [dump])
    assert o.status == "loaded", o.line()
    assert stored(store, "tokens", TOKEN_COLS) == expected(exp.tokens, TOKEN_COLS)
    assert store.scalar("SELECT count(*) FROM routing") == 0


def test_numpy_routing_refused_with_the_conversion_command_which_works(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), eval_ids=(), numpy_routing=True)
    [o] = ingest_paths(store, [dump])
    assert o.status == "refused"
    assert "0.pt: refused: loading it would need pickle, which can run code" in o.message
    assert "numpy" in o.message
    cmd = o.message[o.message.index("python -c"):].rstrip(")")
    assert cmd.endswith("in.pt out.pt")
    assert store.scalar("SELECT count(*) FROM tokens") == 0 and store.scalar("SELECT count(*) FROM files") == 0
    # the command from the message converts the dump (run here in-process on our own trusted fixture)
    argv = shlex.split(cmd)
    code = argv[2]
    src = dump / "rollout_data" / "0.pt"
    old_argv = sys.argv
    try:
        sys.argv = ["-c", str(src), str(src)]
        exec(compile(code, "<conversion>", "exec"), {})
    finally:
        sys.argv = old_argv
    [o] = ingest_paths(store, [dump])
    assert o.status == "loaded", o.line()
    assert stored(store, "routing", ROUTING_COLS) == expected(exp.routing, ROUTING_COLS, "routing")


class _Boom:
    """Pickles into a call that would leave a mark if it ever ran."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (open, (self.mark, "w"))


def test_pickle_objects_in_metadata_are_refused_without_running_them(tmp_path, store):
    dump, _ = write_slime(tmp_path, rollout_ids=(0,), eval_ids=())
    path = dump / "rollout_data" / "0.pt"
    d = torch.load(path, weights_only=True)
    mark = tmp_path / "pwned"
    d["samples"][0]["metadata"]["custom"] = _Boom(str(mark))
    torch.save(d, path)
    [o] = ingest_paths(store, [dump])
    assert o.status == "refused" and "would need pickle" in o.message
    assert not mark.exists()


def test_mismatched_rollout_and_train_dumps_are_refused(tmp_path, store):
    dump, _ = write_slime(tmp_path, rollout_ids=(0,), eval_ids=())
    path = dump / "train_data" / "0.pt"
    d = torch.load(path, weights_only=True)
    d["samples"][3]["tokens"] = d["samples"][3]["tokens"].flip(0)
    torch.save(d, path)
    [o] = ingest_paths(store, [dump])
    assert o.status == "refused"
    assert o.message == ("slime-dump/{rollout_data,train_data}/0.pt: train_data/0.pt sample 3: tokens differ from "
                         "rollout_data sample 3 (rollout_position) (the rollout and train dumps must come from the "
                         "same rollout id of one run)")


def test_reload_is_a_no_op_and_tokenizer_files_are_not_logs(tmp_path, store):
    dump, exp = write_slime(tmp_path, rollout_ids=(0,), eval_ids=())
    first = ingest_paths(store, [tmp_path])  # a parent folder: the dump is found inside
    assert [o.status for o in first] == ["loaded"], [o.line() for o in first]
    again = ingest_paths(store, [dump])
    assert [o.status for o in again] == ["skipped"]
    assert store.scalar("SELECT count(*) FROM tokens") == len(exp.tokens)


def test_weight_versions_that_are_not_numbers_leave_version_null(tmp_path, store):
    dump, _ = write_slime(tmp_path, rollout_ids=(0,), eval_ids=())
    path = dump / "rollout_data" / "0.pt"
    d = torch.load(path, weights_only=True)
    for s in d["samples"]:
        s["weight_versions"] = ["default"]
    torch.save(d, path)
    ingest_paths(store, [dump])
    assert store.scalar("SELECT count(*) FROM tokens WHERE sampler_version IS NOT NULL") == 0
    assert store.scalar("SELECT count(*) FROM tokens") > 0
    assert np.isfinite(store.scalar("SELECT sum(sampler_logprob) FROM tokens"))
