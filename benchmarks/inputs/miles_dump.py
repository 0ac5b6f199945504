"""A miles `--dump-details` folder of one seeded GRPO run (radixark/miles at 31f1ca9; the layout that
analysis/ingest/frameworks/miles.py reads and that tests/test_frameworks_miles.py writes through miles' own
conventions): per rollout id, rollout_data/{id}.pt (Sample.to_dict() of each sample), the dashboard's parquet
mirror dashboard_columns/rollout_{id}.parquet, and one train shard train_data/{id}_0.pt (dp = tp = 1). Both tools
read this same folder in bench_pages.py --miles: miles' dashboard serves it as it is, Driftscope ingests it.

Default size: 40 steps × 8 prompts × 8 responses of 128–384 tokens ≈ 655k response tokens. Prompts and responses
are text; Δ = t − s is noise of sd 0.01 except one planted block (step 23, one response, 24 tokens of Δ ≈ 0.8)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from harness import WORK

DUMP = WORK / "miles-dump" / "miles-run"
VERSION = "1"
STEPS, PROMPTS, PER_PROMPT = 40, 8, 8
PLANT = (23, 5, 100, 24)  # step, sample (within the step), first position, tokens: the anomalous block
WORDS = ["the", " sum", " of", " 3", " and", " 4", " is", " 7", ".", " so", " x", " =", " 12", " then", " we",
         " add", " carry", " one", "\n", " answer"]


def _sample(index: int, group: int, prompt: str, response: str, tokens: list[int], R: int, reward: float,
            version: int, s: list[float]) -> dict:
    """Sample.to_dict() (miles/utils/types.py:153-158): the dataclass' fields, status as its value."""
    return {"group_index": group, "index": index, "rollout_id": None, "prompt": prompt, "tokens": tokens,
            "multimodal_inputs": None, "multimodal_train_inputs": None, "response": response, "response_length": R,
            "label": "7", "reward": reward, "loss_mask": [1] * R, "weight_versions": [str(version)],
            "rollout_log_probs": s, "rollout_routed_experts": None, "rollout_indexer_topk": None,
            "remove_sample": False, "teacher_log_probs": None, "opd_reverse_kl": None, "status": "completed",
            "metadata": {}, "generate_function_path": None, "train_metadata": None, "adapter": None,
            "reward_spec": None, "routing_key": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0}}


def build(dump: Path = DUMP, steps: int = STEPS, seed: int = 0) -> int:
    """Write the folder (replacing one there); returns its number of response tokens."""
    import shutil

    import polars as pl
    import torch

    if dump.exists():
        shutil.rmtree(dump)
    for sub in ("rollout_data", "train_data", "dashboard_columns", "dashboard"):
        (dump / sub).mkdir(parents=True)
    rng = np.random.default_rng(seed)
    n_tokens = 0
    t0 = time.perf_counter()
    for rid in range(steps):
        samples, shard = [], {k: [] for k in ("tokens", "response_lengths", "rewards", "truncated", "sample_indices",
                                             "loss_masks", "rollout_log_probs", "weight_versions", "total_lengths",
                                             "log_probs", "advantages", "entropy")}
        raw = []
        for g in range(PROMPTS):
            a, b = int(rng.integers(10, 99)), int(rng.integers(10, 99))
            prompt = f"Step {rid}, problem {g}: what is {a} + {b}? Think step by step."
            P = 24
            rewards = rng.integers(0, 2, PER_PROMPT).astype(float)
            for j in range(PER_PROMPT):
                i = g * PER_PROMPT + j
                index = rid * PROMPTS * PER_PROMPT + i
                R = int(rng.integers(128, 385))
                ids = rng.integers(0, len(WORDS), R)
                s = -rng.exponential(0.7, R) - 1e-3
                d = rng.normal(0.0, 0.01, R)
                if (rid, i) == PLANT[:2]:
                    d[PLANT[2]:PLANT[2] + PLANT[3]] += 0.8
                t = np.minimum(s + d, 0.0)
                tokens = [int(x) for x in rng.integers(0, 500, P)] + [int(x) for x in ids]
                version = max(0, rid - int(rng.integers(0, 2)))
                samples.append(_sample(index, g, prompt, "".join(WORDS[k] for k in ids), tokens, R,
                                       float(rewards[j]), version, np.float32(s).tolist()))
                raw.append(float(rewards[j]))
                shard["tokens"].append(torch.tensor(tokens))
                shard["response_lengths"].append(R)
                shard["rewards"].append(float(rewards[j] - rewards.mean()))
                shard["truncated"].append(0)
                shard["sample_indices"].append(index)
                shard["loss_masks"].append(torch.ones(R, dtype=torch.int32))
                shard["rollout_log_probs"].append(torch.tensor(np.float32(s)))
                shard["weight_versions"].append([str(version)])
                shard["total_lengths"].append(P + R)
                shard["log_probs"].append(torch.tensor(np.float32(t)))
                shard["advantages"].append(torch.full((R,), float(rewards[j] - rewards.mean())))
                shard["entropy"].append(torch.tensor(np.float32(rng.uniform(0, 3, R))))
                n_tokens += R
        shard["raw_reward"] = raw
        # save_debug_rollout_data (miles/ray/rollout/debug_data.py:103-117)
        torch.save({"rollout_id": rid, "metadata": {}, "samples": samples}, dump / "rollout_data" / f"{rid}.pt")
        # save_dashboard_columns (debug_data.py:36-72), with its polars schema
        schema = dict(sample_index=pl.Int32, response_length=pl.Int32, total_length=pl.Int32,
                      tokens=pl.List(pl.Int32), loss_mask=pl.List(pl.Int8), rollout_log_probs=pl.List(pl.Float32))
        pl.DataFrame([dict(sample_index=x["index"], response_length=x["response_length"],
                           total_length=len(x["tokens"]), tokens=x["tokens"], loss_mask=x["loss_mask"],
                           rollout_log_probs=x["rollout_log_probs"]) for x in samples], schema=schema) \
            .write_parquet(dump / "dashboard_columns" / f"rollout_{rid}.parquet")
        # save_debug_train_data_for_rank (miles/utils/train_dump_utils.py:24-44)
        torch.save({"rollout_id": rid, "rank": 0, "rollout_data": shard, "cp_rank": 0, "cp_size": 1,
                    "qkv_format": "thd"}, dump / "train_data" / f"{rid}_0.pt")
    (dump.parent / "built.json").write_text(json.dumps({"version": VERSION, "steps": steps, "tokens": n_tokens}))
    print(f"built {dump}: {steps} rollouts, {n_tokens:,} tokens in {time.perf_counter() - t0:.1f}s")
    return n_tokens


def ensure(steps: int = STEPS) -> tuple[Path, int]:
    """The folder and its token count, built when missing or of another version or size."""
    marker = DUMP.parent / "built.json"
    if marker.exists():
        info = json.loads(marker.read_text())
        if info.get("version") == VERSION and info.get("steps") == steps and DUMP.is_dir():
            return DUMP, info["tokens"]
    return DUMP, build(DUMP, steps)
