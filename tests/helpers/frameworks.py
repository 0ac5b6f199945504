"""Builders of framework dump folders in the real layouts of FORMATS.md (prime-rl token exports, slime
`--dump-details`, verl per-step batch dumps), each returning the canonical rows an importer must produce,
computed here straight from the generated values (not with the importers' code).

Every builder is seeded: the same arguments write the same files.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

PAD_ID = 151643  # Qwen's pad id, what verl pads with (not 0)


def f32(x) -> float:
    """A float32 value as the double JSON prints and torch.float32 holds."""
    return float(np.float32(x))


@dataclass
class Expected:
    tokens: list[dict] = field(default_factory=list)   # run, step, sample, pos, token_id, sampler_logprob, trainer_logprob
    routing: list[dict] = field(default_factory=list)  # run, step, sample, pos, layer, sampler_experts
    sequences: list[dict] = field(default_factory=list)

    def token_keys(self) -> list[tuple]:
        return sorted((r["run"], r["step"], r["sample"], r["pos"]) for r in self.tokens)


def _topk_row(rng: np.random.Generator, n_experts: int, k: int) -> list[int]:
    return [int(e) for e in rng.permutation(n_experts)[:k]]


# ---------------------------------------------------------------------------------------------------
# prime-rl
# ---------------------------------------------------------------------------------------------------
VOCAB = 1000


def primerl_record(rng, step: int, rank: int, idx: int, micro_step: int, micro_idx: int, *, zero_trained=False,
                   old_keys=False) -> tuple[dict, list[tuple[int, int, float, float]]]:
    """One exported sample: prompt, completion, a tool turn (untrained), a second completion.

    Returns the record and (position in sample, token id, s, t) of its trained tokens, in order."""
    seg = [("prompt", int(rng.integers(3, 7))), ("completion", int(rng.integers(2, 6))),
           ("tool", int(rng.integers(2, 4))), ("completion", int(rng.integers(2, 6)))]
    token_ids, loss_mask, inf, adv = [], [], [], []
    for kind, n in seg:
        for _ in range(n):
            token_ids.append(int(rng.integers(0, VOCAB)))
            sampled = kind == "completion"
            loss_mask.append(sampled)
            inf.append(f32(-rng.exponential(0.7)) if sampled else 0.0)  # 0.0 on every non-sampled token
            adv.append(0.5 if sampled else 0.0)
    n = len(token_ids)
    if zero_trained:  # a sampler log-prob of exactly 0.0 on a trained token is legitimate
        inf[loss_mask.index(True)] = 0.0
    trainer = [f32(math.log(1 / VOCAB))] + [f32(-rng.exponential(0.7)) for _ in range(n - 1)]
    for i in range(n):
        if loss_mask[i] and inf[i] != 0.0:
            trainer[i] = f32(inf[i] + rng.normal(0, 0.02)) if inf[i] + 0.1 < 0 else inf[i]
    ratio = [f32(math.exp(t - s)) for s, t in zip(inf, trainer)]
    rec = {"schema_version": 1, "step": step, "rank": rank, "micro_step": micro_step,
           "micro_sequence_idx": micro_idx, "export_sequence_idx": idx, "env_name": "math",
           "token_ids": token_ids, "position_ids": list(range(n)), "loss_mask": loss_mask, "advantages": adv,
           "inference_logprobs": inf, "trainer_logprobs": trainer,
           "entropy": [f32(math.log(VOCAB))] + [f32(rng.uniform(0, 3)) for _ in range(n - 1)],
           "mismatch_kl": [f32(r - math.log(r) - 1) for r in ratio],  # float32: must be ignored
           "log_importance_ratio": [f32(t - s) for s, t in zip(inf, trainer)], "importance_ratio": ratio,
           "prob_delta": [f32(math.exp(t) - math.exp(s)) for s, t in zip(inf, trainer)],
           "is_masked": [False] * n, "is_masked_high": [False] * n, "is_masked_low": [False] * n,
           "rl_weights": [None] * n, "ce_weights": [None] * n, "ref_kl_weights": [None] * n,
           "future_key_nobody_knows": {"x": 1}}
    if old_keys:  # e971d90-era records: training_mode and rewards, no weight streams
        for key in ("rl_weights", "ce_weights", "ref_kl_weights"):
            del rec[key]
        rec["training_mode"] = "rl"
        rec["rewards"] = 1.0
    trained = [(i, token_ids[i], inf[i], trainer[i]) for i in range(n) if loss_mask[i]]
    return rec, trained


def _dump_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n" for r in records))


def write_primerl(root: Path, run: str = "primerl-run", steps=(1, 2), ranks: int = 2, per_rank: int = 3,
                  stable: bool | tuple = True, seed: int = 0, zero_trained: bool = True) -> tuple[Path, Expected]:
    """`<root>/<run>/token_exports/step_<n>/rank_<r>.jsonl` (+ STABLE). `stable`: True (every step),
    False (pre-June export, no marker anywhere) or the steps that have one. Returns (token_exports, expected)."""
    rng = np.random.default_rng(seed)
    export = root / run / "token_exports"
    exp = Expected()
    for step in steps:
        d = export / f"step_{step}"
        d.mkdir(parents=True)
        for rank in range(ranks):
            records = []
            for idx in range(per_rank):
                rec, trained = primerl_record(rng, step, rank, idx, micro_step=idx // 2, micro_idx=idx % 2,
                                              zero_trained=zero_trained and idx == 0)
                records.append(rec)
                for pos, (_, tok, s, t) in enumerate(trained):
                    exp.tokens.append({"run": run, "step": step, "sample": rank * 1_000_000 + idx, "pos": pos,
                                       "token_id": tok, "sampler_logprob": s, "trainer_logprob": t})
            _dump_jsonl(d / f"rank_{rank}.jsonl", records)
        if stable is True or (isinstance(stable, tuple) and step in stable):
            (d / "STABLE").touch()
    return export, exp


def write_primerl_single_file(root: Path, run: str = "old-run", steps=(1, 2, 3), seed: int = 1) -> tuple[Path, Expected]:
    """Exports before 2026-05-21: one `token_exports/rank_<r>.jsonl` holding every step."""
    rng = np.random.default_rng(seed)
    export = root / run / "token_exports"
    export.mkdir(parents=True)
    exp = Expected()
    records = []
    for step in steps:
        for idx in range(2):
            rec, trained = primerl_record(rng, step, 0, idx, 0, idx, old_keys=True)
            records.append(rec)
            for pos, (_, tok, s, t) in enumerate(trained):
                exp.tokens.append({"run": run, "step": step, "sample": idx, "pos": pos, "token_id": tok,
                                   "sampler_logprob": s, "trainer_logprob": t})
    _dump_jsonl(export / "rank_0.jsonl", records)
    return export, exp


# ---------------------------------------------------------------------------------------------------
# prime-rl traces with the trainer's annotations (2026-H2)
# ---------------------------------------------------------------------------------------------------
def _node(parent, role: str, text: str, n_scaffold: int, n_sampled: int, rng, *, kl_decimals=6,
          lp_decimals=None, annotate=True, noise=0.02) -> tuple[dict, list[dict]]:
    """A verifiers MessageNode record (verifiers/v1/graph.py:64-133 at a60a606): its scaffold tokens, then, for an
    assistant turn, its sampled tokens with the sampler's `logprobs` and the trainer's annotations in the same
    compact layout (one value per sampled token). Returns the node and its sampled tokens' values."""
    ids = [int(rng.integers(0, VOCAB)) for _ in range(n_scaffold + n_sampled)]
    node = {"parent": parent, "message": {"role": role, "content": text}, "sampled": n_sampled > 0,
            "timestamp": 1.7e9, "token_ids": ids, "mask": [False] * n_scaffold + [True] * n_sampled,
            "is_content": [], "logprobs": []}
    toks = []
    for k in range(n_sampled):
        s = f32(-rng.exponential(0.7))
        t = s + rng.normal(0, noise) if s < -0.1 else s
        t = round(t, lp_decimals) if lp_decimals is not None else f32(t)
        t = min(t, 0.0)
        d = t - s
        toks.append({"token_id": ids[n_scaffold + k], "sampler_logprob": s, "trainer_logprob": t,
                     "trainer_entropy": f32(rng.uniform(0, 3)), "mismatch_kl": round(math.expm1(d) - d, kl_decimals),
                     "advantage": float(rng.normal())})
    if n_sampled:
        node["logprobs"] = [x["sampler_logprob"] for x in toks]
        node["advantages"] = [x["advantage"] for x in toks]
        if annotate:
            node["trainer_logprobs"] = [x["trainer_logprob"] for x in toks]
            node["entropies"] = [x["trainer_entropy"] for x in toks]
            node["mismatch_kl"] = [x["mismatch_kl"] for x in toks]
            node["is_masked"] = [abs(x["trainer_logprob"] - x["sampler_logprob"]) > 0.03 for x in toks]
    return node, toks


def traces_episode(rng, step: int, e: int, *, branching=False, annotate=True, lp_decimals=None,
                   policy=(0, 1), noise=0.02) -> tuple[dict, list[dict]]:
    """One verifiers Episode record (verifiers/v1/episode.py:86-155: `model_dump(mode="json", exclude_none=True)`)
    with a two-turn trainable trace (system, user, assistant, tool, assistant; `branching`: a second assistant
    answer to the user, a second leaf), a trace of a non-trainable agent and a failed trace (neither trains).
    Returns the record and one dict per trained (trace, branch): its tokens, reward, advantage, prompt, response."""
    def node(*a, **k):
        return _node(*a, rng=rng, lp_decimals=lp_decimals, annotate=annotate, noise=noise, **k)
    n0, _ = node(None, "system", "You are terse.", 3, 0)
    n1, _ = node(0, "user", f"What is {e} + {step}?", 4, 0)
    n2, t2 = node(1, "assistant", "Let me compute.", 2, int(rng.integers(2, 6)))
    n3, _ = node(2, "tool", "calc: ok", 3, 0)
    n4, t4 = node(3, "assistant", f"It is {e + step}.", 2, int(rng.integers(2, 6)))
    nodes = [n0, n1, n2, n3, n4]
    score = float(rng.integers(0, 2))
    rewards = {"correct": {"score": score, "weight": 2.0}, "format": {"score": 0.5, "weight": 1.0}, "judge": None}
    reward = score * 2.0 + 0.5
    prompt = f"You are terse.\n\nWhat is {e} + {step}?"
    samples = [{"tokens": t2 + t4, "response": f"Let me compute.\n\nIt is {e + step}."}]
    if branching:
        n5, t5 = node(1, "assistant", "Four.", 2, int(rng.integers(2, 5)))
        nodes.append(n5)
        samples.append({"tokens": t5, "response": "Four."})
    for x in samples:
        x.update(reward=reward, prompt=prompt, advantage=float(np.mean([t["advantage"] for t in x["tokens"]])))

    def trace(nodes, trainable=True, ok=True):
        return {"version": 1, "id": f"t{e}", "verifiers": {"version": "0.1.15"},
                "task": {"type": "MathTask", "data": {"question": "q"}}, "agent": {"config": {}, "name": "solver",
                "trainable": trainable}, "tools": [], "nodes": nodes, "calls": [], "request_rewrites": [],
                "response_rewrites": [], "rewards": rewards, "metrics": {"correct": score}, "info": {},
                "extra_usage": [], "is_completed": True, "ok": ok, "errors": [],
                "timing": {"start": 1.7e9, "boot": {"start": 0.0, "end": 0.0}}}
    judge_nodes = [_node(None, "user", "judge this", 3, 0, rng)[0], _node(0, "assistant", "fine", 1, 3, rng)[0]]
    work = {"type": "train", "step": max(step - 1, 0)}
    if policy is not None:
        work["policy"] = {"start": policy[0], "end": policy[1]}
    rec = {"id": f"ep{e}", "env": {"id": "gsm8k"}, "task": {"type": "MathTask", "data": {"question": "q"}},
           "group": {"id": f"g{e // 2}"}, "run": {"type": "train", "id": "run-1", "name": "x", "work": work},
           "ok": True, "errors": [],
           "traces": [trace(nodes), trace(judge_nodes, trainable=False), trace(judge_nodes, ok=False)]}
    return rec, samples


def write_primerl_traces(root: Path, run: str = "traces-run", steps=(1, 2), episodes: int = 3, seed: int = 0,
                         lp_decimals=None, extra_files: bool = True, noise: float = 0.02) -> tuple[Path, Expected]:
    """`<root>/<run>/rollouts/step_<n>/train/effective/traces.jsonl` as prime-rl's file monitor writes it
    (src/prime_rl/monitors/file.py:48-55 at 559b447), with, when `extra_files`, the step's `train/all` cohort
    (the same episodes and a filtered one), an `eval/effective` file and the run's `metrics.jsonl`. `noise`: the
    standard deviation of t - s on tokens with s < -0.1 (the others have t = s).
    Returns (the run's output dir, expected rows: tokens with mismatch_kl, sequences)."""
    rng = np.random.default_rng(seed)
    out = root / run
    exp = Expected()
    for step in steps:
        d = out / "rollouts" / f"step_{step}"
        records = []
        for e in range(episodes):
            policy = (max(step - 2, 0), max(step - 1, 0))
            rec, samples = traces_episode(rng, step, e, branching=e == 1, lp_decimals=lp_decimals, policy=policy,
                                          noise=noise)
            records.append(rec)
            for k, x in enumerate(samples):
                sample = e * 1000 + k
                for pos, t in enumerate(x["tokens"]):
                    exp.tokens.append({"run": run, "step": step, "sample": sample, "pos": pos, **t,
                                       "sampler_version": policy[0], "trainer_version": step - 1})
                exp.sequences.append({"run": run, "step": step, "sample": sample, "reward": x["reward"],
                                      "advantage": x["advantage"], "prompt": x["prompt"], "response": x["response"],
                                      "response_length": len(x["tokens"])})
        (d / "train" / "effective").mkdir(parents=True)
        _dump_jsonl(d / "train" / "effective" / "traces.jsonl", records)
        if extra_files:
            (d / "train" / "all").mkdir(parents=True)
            _dump_jsonl(d / "train" / "all" / "traces.jsonl", records + [traces_episode(rng, step, 9)[0]])
            (d / "eval" / "effective").mkdir(parents=True)
            _dump_jsonl(d / "eval" / "effective" / "traces.jsonl",
                        [traces_episode(rng, step, 0, annotate=False)[0]])
    if extra_files:
        _dump_jsonl(out / "metrics.jsonl", [{"step": s, "time": 1.7e9, "mismatch_kl/all/mean": 1e-4} for s in steps])
    return out, exp


# ---------------------------------------------------------------------------------------------------
# slime
# ---------------------------------------------------------------------------------------------------
def write_slime(root: Path, name: str = "slime-dump", rollout_ids=(0, 1), n_samples: int = 4, n_layers: int = 3,
                dense=(1,), n_experts: int = 4, k: int = 2, removed=(2,), eval_ids=(0,), seed: int = 0,
                numpy_routing: bool = False, routing: bool = True, with_train=True) -> tuple[Path, Expected]:
    """`<root>/<name>/{rollout_data,train_data}/{id}.pt` (+ eval_{id}.pt, tokenizer/) as `--dump-details`
    writes them. Each sample: prompt, completion, a tool turn (loss mask 0, rollout log-prob 0.0),
    completion. Returns (dump folder, expected rows)."""
    rng = np.random.default_rng(seed)
    dump = root / name
    (dump / "rollout_data").mkdir(parents=True)
    (dump / "train_data").mkdir()
    (dump / "tokenizer").mkdir()
    (dump / "tokenizer" / "tokenizer.json").write_text('{\n  "version": "1.0",\n  "model": {}\n}\n')
    (dump / "tokenizer" / "tokenizer_config.json").write_text('{"pad_token": "<|endoftext|>"}')
    moe = [l for l in range(n_layers) if l not in dense]
    exp = Expected()
    for rid in rollout_ids:
        r_samples, t_samples = [], []
        for pos_r in range(n_samples):
            P = int(rng.integers(3, 7))
            segs = [(1, int(rng.integers(2, 5))), (0, int(rng.integers(1, 3))), (1, int(rng.integers(2, 5)))]
            mask = [m for m, n in segs for _ in range(n)]
            R = len(mask)
            tokens = [int(t) for t in rng.integers(0, 5000, P + R)]
            s = [f32(-rng.exponential(0.6)) if m else 0.0 for m in mask]  # 0.0 on tool tokens
            t = [f32(x + rng.normal(0, 0.03)) if m and x < -0.2 else (f32(-rng.exponential(1.0)) if not m else x)
                 for x, m in zip(s, mask)]  # trainer: real values on tool tokens too
            # engine routing: one row per input position (P + R - 1 rows); dense layers all-zero
            rows = np.zeros((P + R - 1, n_layers, k), dtype=np.int32)
            for r in range(P + R - 1):
                for l in moe:
                    rows[r, l] = _topk_row(rng, n_experts, k)
            rs = {"group_index": pos_r // 2, "index": rid * 100 + pos_r, "rollout_id": None,
                  "prompt": f"<|im_start|>user\nquestion {pos_r}<|im_end|>", "tokens": tokens,
                  "multimodal_inputs": None, "response": "answer", "response_length": R, "label": "42",
                  "reward": float(pos_r % 2), "loss_mask": mask, "weight_versions": [str(rid), str(rid)],
                  "rollout_log_probs": s,
                  "rollout_routed_experts": (rows if numpy_routing else torch.from_numpy(rows)) if routing else None,
                  "remove_sample": pos_r in removed, "teacher_log_probs": None, "status": "completed",
                  "metadata": {"temperature": 0.8, "top_p": 0.95, "source": "gsm8k"},
                  "generate_function_path": None, "train_metadata": None, "session_id": None,
                  "non_generation_time": 0.0,
                  "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                                "completion_token_num": R},
                  "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": P},
                  "trace": {"spans": []}}
            r_samples.append(rs)
            train_mask = [0] * R if pos_r in removed else mask
            t_samples.append({
                "data_parallel_rank": pos_r % 2, "sample_index": rid * 100 + pos_r, "rollout_position": pos_r,
                "tokens": torch.tensor(tokens, dtype=torch.int64), "response_lengths": R, "total_lengths": P + R,
                "rewards": float(pos_r % 2) - 0.5, "truncated": 0, "rollout_ids": None, "source_names": "gsm8k",
                "local_raw_reward": float(pos_r % 2), "rollout_mask_sums": torch.tensor(float(sum(train_mask))),
                "loss_masks": torch.tensor(train_mask, dtype=torch.int32),
                "rollout_log_probs": torch.tensor(s, dtype=torch.float32),
                "log_probs": torch.tensor(t, dtype=torch.float32),
                "advantages": torch.full((R,), 0.25, dtype=torch.float32),
                "returns": torch.full((R,), 0.25, dtype=torch.float32),
                "kl": torch.zeros(R, dtype=torch.float32)})
            for j in range(R):
                if not train_mask[j]:
                    continue
                exp.tokens.append({"run": name, "step": rid, "sample": pos_r, "pos": j, "token_id": tokens[P + j],
                                   "sampler_logprob": s[j], "trainer_logprob": t[j], "sampler_version": rid})
                if routing:
                    for new_l, l in enumerate(moe):
                        exp.routing.append({"run": name, "step": rid, "sample": pos_r, "pos": j, "layer": new_l,
                                            "sampler_experts": rows[P + j - 1, l].tolist()})
            if pos_r not in removed:
                exp.sequences.append({"run": name, "step": rid, "sample": pos_r, "reward": float(pos_r % 2),
                                      "response_length": R})
        torch.save({"rollout_id": rid, "samples": r_samples}, dump / "rollout_data" / f"{rid}.pt")
        if with_train:
            # dp ranks gathered, then sorted by rollout_position (as slime's _build_dump_payload does)
            torch.save({"format_version": 2, "rollout_id": rid, "rank": 0, "samples": t_samples,
                        "dp_shards": [{"rank": 0, "data_parallel_rank": 0, "sample_indices": None,
                                       "partition": list(range(0, n_samples, 2)), "global_batch_sizes": [n_samples],
                                       "num_microbatches": [1], "micro_batch_indices": [[0]]}],
                        "raw_reward": [float(i % 2) for i in range(n_samples)]},
                       dump / "train_data" / f"{rid}.pt")
    for rid in eval_ids:  # evaluation rollouts: same dict shape, no trainer side
        torch.save({"rollout_id": rid, "samples": [{"tokens": [1, 2, 3], "response_length": 1, "loss_mask": [1],
                                                     "rollout_log_probs": [-0.5], "status": "completed"}]},
                   dump / "rollout_data" / f"eval_{rid}.pt")
    return dump, exp


# ---------------------------------------------------------------------------------------------------
# verl
# ---------------------------------------------------------------------------------------------------
def write_verl(folder: Path, step: int = 3, B: int = 4, P: int = 6, R: int = 8, n_layers: int = 3, dense=(2,),
               n_experts: int = 4, k: int = 2, dtype=torch.int16, seed: int = 0, run: str | None = None,
               fmt: str = "pt", extra: dict | None = None) -> tuple[Path, Expected]:
    """One verl step dump `<folder>/step_<step>.pt`: left-padded prompts, right-padded responses (pad id
    151643), a tool turn inside each response (response_mask 0), routed_experts [B, P+R, L, K] with engine
    row i at column P - prompt_len + i. Returns (file, expected rows); run defaults to the folder's name."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    run = run or folder.name
    moe = [l for l in range(n_layers) if l not in dense]
    prompts = torch.full((B, P), PAD_ID, dtype=torch.int64)
    responses = torch.full((B, R), PAD_ID, dtype=torch.int64)
    attn = torch.zeros((B, P + R), dtype=torch.int64)
    rmask = torch.zeros((B, R), dtype=torch.int64)
    slp = torch.zeros((B, R), dtype=torch.float32)
    olp = torch.zeros((B, R), dtype=torch.float32)
    routed = torch.zeros((B, P + R, n_layers, k), dtype=dtype)
    exp = Expected()
    for b in range(B):
        pl = int(rng.integers(2, P + 1))
        rl = int(rng.integers(4, R + 1))
        prompt = [int(x) for x in rng.integers(0, 5000, pl)]
        resp = [int(x) for x in rng.integers(0, 5000, rl)]
        if b == 0:
            resp[1] = 0  # token id 0 is a real token, not padding
        tool = set(range(2, 3)) if rl > 4 else set()  # a tool token inside the response: mask 0
        prompts[b, P - pl:] = torch.tensor(prompt)
        responses[b, :rl] = torch.tensor(resp)
        attn[b, P - pl:P + rl] = 1
        engine = np.zeros((pl + rl - 1, n_layers, k), dtype=np.int64)  # engine row i = absolute position i
        for i in range(pl + rl - 1):
            for l in moe:
                engine[i, l] = _topk_row(rng, n_experts, k)
        routed[b, P - pl:P - pl + pl + rl - 1] = torch.from_numpy(engine).to(dtype)
        for j in range(R):
            if j >= rl:  # right pad: old FSDP actors wrote the pad tokens' own log-probs here
                olp[b, j] = f32(-rng.exponential(5.0))
                continue
            if j in tool:
                olp[b, j] = f32(-rng.exponential(1.0))  # trainer has real values on tool tokens
                continue                                # sampler: 0.0, mask 0
            rmask[b, j] = 1
            s = 0.0 if (b == 1 and j == 0) else f32(-rng.exponential(0.6))
            slp[b, j] = s
            olp[b, j] = f32(s + rng.normal(0, 0.03)) if s < -0.2 else s
            exp.tokens.append({"run": run, "step": step, "sample": b, "pos": j, "token_id": resp[j],
                               "sampler_logprob": float(slp[b, j]), "trainer_logprob": float(olp[b, j])})
            for new_l, l in enumerate(moe):
                exp.routing.append({"run": run, "step": step, "sample": b, "pos": j, "layer": new_l,
                                    "sampler_experts": engine[pl + j - 1, l].tolist()})
        exp.sequences.append({"run": run, "step": step, "sample": b, "response_length": rl})
    d = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
         "attention_mask": attn, "position_ids": torch.clamp(attn.cumsum(1) - 1, min=0),
         "response_mask": rmask, "rollout_log_probs": slp, "old_log_probs": olp, "routed_experts": routed,
         "advantages": torch.where(rmask.bool(), 0.3, 0.0).float(), "global_steps": step, **(extra or {})}
    if fmt == "safetensors":
        from safetensors.torch import save_file
        path = folder / f"step_{step}.safetensors"
        save_file({k: (v if isinstance(v, torch.Tensor) else torch.tensor(v)) for k, v in d.items()
                   if isinstance(v, (torch.Tensor, int, float))}, str(path))
    else:
        path = folder / f"step_{step}.pt"
        torch.save(d, path)
    return path, exp


# ---------------------------------------------------------------------------------------------------
# reading back
# ---------------------------------------------------------------------------------------------------
TOKEN_COLS = ("run", "step", "sample", "pos", "token_id", "sampler_logprob", "trainer_logprob")
ROUTING_COLS = ("run", "step", "sample", "pos", "layer", "sampler_experts")


def zip_folder(folder: Path):
    """The folder as a zip archive in memory (an upload), its members named from the folder itself down."""
    import io
    import zipfile
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                zf.write(f, str(f.relative_to(folder.parent)))
    buf.seek(0)
    return buf


def stored(store, table: str, cols: tuple[str, ...]) -> list[dict]:
    """Rows of `table` as dicts with `cols`, sorted by the table's key (run, step, sample, pos[, layer])."""
    key = "run, step, sample" + (", pos" if table != "sequences" else "") + (", layer" if table == "routing" else "")
    return store.sql(f"SELECT {', '.join(cols)} FROM {table} ORDER BY {key}").to_dicts()


def expected(rows: list[dict], cols: tuple[str, ...], table: str = "tokens") -> list[dict]:
    key = ("run", "step", "sample") + (("pos",) if table != "sequences" else ()) + (("layer",) if table == "routing" else ())
    return sorted(({c: r[c] for c in cols} for r in rows), key=lambda r: tuple(r[c] for c in key))
