"""Seeded sequences with prompts, responses and rewards, in two layouts: Driftscope's sequence JSON Lines, and an
OpenRLHF-style board dump (`prompt`, `response`, `response_tokens`, `logprobs`, `ref_logprobs`, `reward`,
`step`, plus the sampler's `rollout_logprobs`) whose keys match no format and need a field mapping."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = [" the", " cat", " sat", " on", " a", " mat", "<b>x</b>", " 4", "\n", " so"]


def make_sequences(seed: int, steps: int = 4, per_step: int = 5, max_len: int = 12) -> list[dict]:
    """One dict per sequence: step, sample, prompt, tokens (text), response (their join), s and t log-probs
    (t = s + Δ, both ≤ 0), reward in {0, 1} and an advantage (reward minus the step's mean)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        rows = []
        for sample in range(per_step):
            n = int(rng.integers(2, max_len + 1))
            tokens = [WORDS[i] for i in rng.integers(0, len(WORDS), n)]
            s = -0.05 - rng.exponential(1.0, n)
            t = np.minimum(s + rng.normal(0, 0.05 * (1 + step), n), 0.0)
            rows.append({"step": step, "sample": sample, "prompt": f"Problem {step}.{sample}: what is 2 + {sample}?",
                         "tokens": tokens, "response": "".join(tokens), "s": s.round(6).tolist(),
                         "t": t.round(6).tolist(), "reward": float(rng.integers(0, 2))})
        mean = float(np.mean([r["reward"] for r in rows]))
        for r in rows:
            r["advantage"] = r["reward"] - mean
        out += rows
    return out


def write_sequence_jsonl(path: Path, seqs: list[dict], run: str) -> Path:
    with open(path, "w") as f:
        for q in seqs:
            f.write(json.dumps({"run": run, "step": q["step"], "sample": q["sample"], "prompt": q["prompt"],
                                "response": q["response"], "tokens": q["tokens"], "sampler_logprobs": q["s"],
                                "trainer_logprobs": q["t"], "reward": q["reward"],
                                "advantage": q["advantage"]}) + "\n")
    return path


def openrlhf_record(q: dict) -> dict:
    """The board's record: its `ref_logprobs` belong to a reference model (here: t shifted), not the sampler."""
    return {"prompt": q["prompt"], "response": q["response"], "response_tokens": q["tokens"], "logprobs": q["t"],
            "ref_logprobs": [x - 0.3 for x in q["t"]], "rollout_logprobs": q["s"], "reward": q["reward"],
            "step": q["step"]}


def write_openrlhf_jsonl(path: Path, seqs: list[dict]) -> Path:
    with open(path, "w") as f:
        for q in seqs:
            f.write(json.dumps(openrlhf_record(q)) + "\n")
    return path


OPENRLHF_MAP = ["sampler_logprob=rollout_logprobs", "trainer_logprob=logprobs", "tokens=response_tokens"]
