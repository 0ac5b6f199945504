"""miles `--dump-details` (radixark/miles at 31f1ca9): the dump is written here the way miles' own code writes it
(rollout_data via save_debug_rollout_data, the parquet mirror via save_dashboard_columns, train_data through
convert_samples_to_train_data -> split_train_data_by_dp_raw -> process_rollout_data_shard -> the actor's tensors ->
save_debug_train_data_for_rank, as its tests/fast/dashboard/dummy_dump.py drives them), and the database must hold
the fixture's values."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import torch

from analysis.ingest import ingest_paths

from helpers.frameworks import expected, f32, stored, zip_folder

COLS = ("run", "step", "sample", "pos", "token_id", "sampler_logprob", "trainer_logprob", "trainer_entropy",
        "sampler_version", "trainer_version")
SEQ_COLS = ("run", "step", "sample", "reward", "advantage", "prompt", "response", "response_length")


def _sample(rng, index: int, group: int, remove: bool = False) -> dict:
    """Sample.to_dict() (miles/utils/types.py:153-158): the dataclass' fields, status as its value."""
    P, R = int(rng.integers(3, 7)), int(rng.integers(4, 10))
    agentic = index % 3 == 0
    prompt = [{"role": "user", "content": "1+1?"}, {"role": "tool", "content": "2"}] if agentic else "What is 1+1?"
    mask = [1] * R
    if agentic:  # a tool turn inside the response: not trained
        mask[1:3] = [0, 0]
    return {"group_index": group, "index": index, "rollout_id": None, "prompt": prompt,
            "tokens": [int(t) for t in rng.integers(0, 500, P + R)], "multimodal_inputs": None,
            "multimodal_train_inputs": None, "response": f"answer {index}", "response_length": R, "label": "2",
            "reward": float(rng.integers(0, 2)), "loss_mask": mask,
            "weight_versions": [str(index % 3), str(index % 3 + 1)] if agentic else [str(index % 3)],
            "rollout_log_probs": [f32(-rng.exponential(0.6)) for _ in range(R)], "rollout_routed_experts": None,
            "rollout_indexer_topk": None, "remove_sample": remove, "teacher_log_probs": None, "opd_reverse_kl": None,
            "status": "completed", "metadata": {}, "generate_function_path": None, "train_metadata": None,
            "adapter": None, "reward_spec": None, "routing_key": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0}}


def write_miles(root, name="miles-dump", rollout_ids=(0, 1), n=6, dp=2, tp=2, seed=0, columns=True,
                remove=(4,), with_eval=True):
    """A `--dump-details` folder; returns (its path, expected token rows, expected sequence rows)."""
    rng = np.random.default_rng(seed)
    dump = root / name
    tokens, seqs = [], []
    for rid in rollout_ids:
        samples = [_sample(rng, rid * n + i, i // 2, remove=i in remove) for i in range(n)]
        # save_debug_rollout_data (miles/ray/rollout/debug_data.py:103-117)
        (dump / "rollout_data").mkdir(parents=True, exist_ok=True)
        torch.save({"rollout_id": rid, "metadata": {}, "samples": samples}, dump / "rollout_data" / f"{rid}.pt")
        if with_eval and rid == rollout_ids[0]:
            torch.save({"rollout_id": rid, "metadata": {}, "samples": samples[:2]},
                       dump / "rollout_data" / f"eval_{rid}.pt")
        if columns:  # save_dashboard_columns (debug_data.py:36-72), with its polars schema
            schema = dict(sample_index=pl.Int32, response_length=pl.Int32, total_length=pl.Int32,
                          tokens=pl.List(pl.Int32), loss_mask=pl.List(pl.Int8), rollout_log_probs=pl.List(pl.Float32))
            frame = pl.DataFrame([dict(sample_index=s["index"], response_length=s["response_length"],
                                       total_length=len(s["tokens"]), tokens=s["tokens"], loss_mask=s["loss_mask"],
                                       rollout_log_probs=s["rollout_log_probs"]) for s in samples], schema=schema)
            (dump / "dashboard_columns").mkdir(exist_ok=True)
            frame.write_parquet(dump / "dashboard_columns" / f"rollout_{rid}.parquet", row_group_size=8)
        # convert_samples_to_train_data (miles/ray/rollout/train_data_conversion.py:50-159): a removed sample's
        # loss mask becomes all zeros; raw_reward stays batch-global
        data = {"tokens": [s["tokens"] for s in samples], "response_lengths": [s["response_length"] for s in samples],
                "rewards": [s["reward"] - 0.5 for s in samples], "raw_reward": [s["reward"] for s in samples],
                "truncated": [0] * n, "sample_indices": [s["index"] for s in samples],
                "loss_masks": [[0] * s["response_length"] if s["remove_sample"] else s["loss_mask"] for s in samples],
                "rollout_log_probs": [s["rollout_log_probs"] for s in samples],
                "weight_versions": [s["weight_versions"] for s in samples]}
        data["total_lengths"] = [len(t) for t in data["tokens"]]
        # split_train_data_by_dp_raw without balancing, then process_rollout_data_shard (lines 330-410)
        for d in range(dp):
            part = list(range(d, n, dp))
            shard = {k: [v[j] for j in part] for k, v in data.items() if k not in ("raw_reward",)}
            shard["raw_reward"] = data["raw_reward"]
            # the actor's tensors (dummy_dump.py:_apply_dummy_actor_columns): float32 log-probs
            R = shard["response_lengths"]
            shard["tokens"] = [torch.tensor(t) for t in shard["tokens"]]
            shard["loss_masks"] = [torch.tensor(m, dtype=torch.int32) for m in shard["loss_masks"]]
            shard["rollout_log_probs"] = [torch.tensor(p) for p in shard["rollout_log_probs"]]
            shard["log_probs"] = [torch.tensor(np.minimum(p.double().numpy() + rng.normal(0, 0.03, r), 0),
                                               dtype=torch.float32) for p, r in zip(shard["rollout_log_probs"], R)]
            shard["advantages"] = [torch.tensor(rng.normal(0, 1, r), dtype=torch.float32) for r in R]
            shard["entropy"] = [torch.tensor(rng.uniform(0, 3, r), dtype=torch.float32) for r in R]
            for dup in range(tp):  # tensor-parallel peers write the same shard
                (dump / "train_data").mkdir(exist_ok=True)
                torch.save({"rollout_id": rid, "rank": d * tp + dup, "rollout_data": shard, "cp_rank": 0,
                            "cp_size": 1, "qkv_format": "thd"}, dump / "train_data" / f"{rid}_{d * tp + dup}.pt")
            for k, j in enumerate(part):
                s = samples[j]
                if s["remove_sample"]:
                    continue
                mask = np.array(s["loss_mask"]) != 0
                P = len(s["tokens"]) - s["response_length"]
                version = min(int(v) for v in s["weight_versions"])
                t = shard["log_probs"][k].double().numpy()
                for pos in np.flatnonzero(mask):
                    tokens.append({"run": name, "step": rid, "sample": s["index"], "pos": int(pos),
                                   "token_id": s["tokens"][P + pos], "sampler_logprob": s["rollout_log_probs"][pos],
                                   "trainer_logprob": float(t[pos]),
                                   "trainer_entropy": float(shard["entropy"][k][pos]),
                                   "sampler_version": version, "trainer_version": rid})
                adv = shard["advantages"][k].double().numpy()[mask]
                prompt = s["prompt"] if isinstance(s["prompt"], str) else json.dumps(s["prompt"], ensure_ascii=False)
                seqs.append({"run": name, "step": rid, "sample": s["index"], "reward": s["reward"],
                             "advantage": float(adv.mean()), "prompt": prompt, "response": s["response"],
                             "response_length": s["response_length"]})
    for sub in ("tokenizer", "trajectory", "policy_loss_debug", "dashboard"):
        (dump / sub).mkdir(exist_ok=True)
    (dump / "tokenizer" / "tokenizer.json").write_text("{}")
    (dump / "trajectory" / "0.jsonl").write_text(json.dumps({"sample_index": 0, "messages": []}) + "\n")
    # maybe_dump_policy_loss_debug (backends/training_utils/debug_dump.py:24-60): per call, no step or sample id
    torch.save({"rank": 0, "call": 0, "samples": [{"index": 0, "train_log_probs": torch.zeros(3),
                                                   "old_log_probs": torch.zeros(3)}]},
               dump / "policy_loss_debug" / "rank_0_call_0.pt")
    pl.DataFrame({"rollout_id": [0], "reward_mean": [0.5]}).write_parquet(dump / "dashboard" / "summary.parquet")
    return dump, tokens, seqs


def test_dump_round_trip(tmp_path, store):
    dump, tokens, seqs = write_miles(tmp_path)
    outcomes = ingest_paths(store, [dump])
    by_status = {}
    for o in outcomes:
        by_status.setdefault(o.status, []).append(o)
    assert sorted(o.name for o in by_status["loaded"]) == [
        f"miles-dump/{{rollout_data,train_data,dashboard_columns}}/{rid}" for rid in (0, 1)], \
        [o.line() for o in outcomes]
    assert all(o.format == "miles" for o in by_status["loaded"])
    assert [o.name for o in by_status["skipped"]] == ["miles-dump/rollout_data/eval_0.pt"]
    assert "refused" not in by_status and "error" not in by_status  # tokenizer/, trajectory/ are claimed
    assert stored(store, "tokens", COLS) == expected(tokens, COLS)
    assert stored(store, "sequences", SEQ_COLS) == expected(seqs, SEQ_COLS, table="sequences")
    # tensor-parallel copies count once; the removed sample (all-zero loss mask) gives no row
    assert store.scalar("SELECT count(DISTINCT (step, sample)) FROM tokens") == 2 * 5
    assert store.run_config("miles-dump") == {"framework": "miles"}
    assert store.precision_floors() == {}  # float32 values, written whole


def test_without_the_parquet_mirror_the_train_dump_gives_the_sampler_side(tmp_path, store):
    dump, tokens, _ = write_miles(tmp_path, columns=False, rollout_ids=(3,), with_eval=False)
    assert [o.status for o in ingest_paths(store, [dump])] == ["loaded"]
    assert stored(store, "tokens", COLS) == expected(tokens, COLS)


def test_mirror_and_train_dump_disagreeing_is_refused(tmp_path, store):
    dump, _, _ = write_miles(tmp_path, rollout_ids=(0,), with_eval=False)
    f = dump / "dashboard_columns" / "rollout_0.parquet"
    frame = pl.read_parquet(f)
    lp = frame["rollout_log_probs"].to_list()
    lp[1][2] -= 0.25
    frame.with_columns(pl.Series("rollout_log_probs", lp, dtype=pl.List(pl.Float32))).write_parquet(f)
    (o,) = ingest_paths(store, [dump])
    assert o.status == "refused" and "sample_index 1, response token 2" in o.message, o.message
    assert store.scalar("SELECT count(*) FROM tokens") == 0


def test_a_rollout_without_train_data_waits(tmp_path, store):
    dump, _, _ = write_miles(tmp_path, rollout_ids=(0, 1), with_eval=False)
    for f in (dump / "train_data").glob("1_*.pt"):
        f.unlink()
    outcomes = {o.name.rsplit("/", 1)[-1]: o for o in ingest_paths(store, [dump])}
    assert outcomes["0"].status == "loaded" and outcomes["1"].status == "skipped"
    assert "train_data/1_<rank>.pt" in outcomes["1"].message


def test_lone_files_are_refused_with_the_way_forward(tmp_path, store):
    dump, _, _ = write_miles(tmp_path, rollout_ids=(0,), with_eval=False)
    for f, what in ((dump / "dashboard_columns" / "rollout_0.parquet", "sampler's log-probs only"),
                    (dump / "train_data" / "0_0.pt", "without its folder")):
        (o,) = ingest_paths(store, [f])
        assert o.status == "refused" and what in o.message and "--dump-details folder" in o.message, o.message
        assert f.name in o.message


def test_context_parallel_and_missing_trainer_logprobs_are_refused(tmp_path, store):
    dump, _, _ = write_miles(tmp_path, rollout_ids=(0,), with_eval=False, tp=1)
    f = dump / "train_data" / "0_1.pt"
    pack = torch.load(f, weights_only=True)
    pack["cp_size"] = 2
    torch.save(pack, f)
    (o,) = ingest_paths(store, [dump])
    assert o.status == "refused" and "train_data/0_1.pt" in o.message and "cp_size 2" in o.message, o.message
    pack["cp_size"] = 1
    del pack["rollout_data"]["log_probs"]
    torch.save(pack, f)
    (o,) = ingest_paths(store, [dump])
    assert o.status == "refused" and "'log_probs'" in o.message and "sample_index" in o.message, o.message


def test_an_uploaded_zip_of_the_dump_loads(tmp_path):
    from analysis.ingest.uploads import ingest_uploads
    from analysis.store import Store
    dump, tokens, _ = write_miles(tmp_path / "logs")
    store = Store(tmp_path / "up.duckdb")
    outcomes = ingest_uploads(store, [("dump.zip", zip_folder(dump))])
    assert sorted(o.status for o in outcomes) == ["loaded", "loaded", "skipped"], [o.line() for o in outcomes]
    assert all(o.format == "miles" for o in outcomes)
    assert stored(store, "tokens", COLS) == expected(tokens, COLS)
    store.close()


def test_a_missing_rank_file_waits(tmp_path, store):
    dump, _, _ = write_miles(tmp_path, rollout_ids=(0,), with_eval=False, tp=1, dp=3)
    (dump / "train_data" / "0_1.pt").unlink()  # ranks 0 and 2 are there
    (o,) = ingest_paths(store, [dump])
    assert o.status == "skipped" and "train_data/0_1.pt is missing" in o.message, o.line()
