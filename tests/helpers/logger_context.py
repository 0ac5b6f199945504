"""Multi-turn steps with every context argument of DriftLogger.log_step (rewards, advantages, prompts, responses,
tags, segment_ids, sampling_support), the same steps as sequence JSON Lines, and the numpy reference of their
residual signatures (reference.ref_residual over the trained tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from helpers.reference import ref_residual

TAGS = ("code", "math", "chat")


def context_step(step: int, B: int = 10, T: int = 28) -> dict:
    """log_step keyword arguments of one seeded step. Each row: turns of response tokens (trained) separated by
    environment tokens (mask 0, same segment id as the turn before them), then padding (NaN log-probs). Δ mixes
    noise, exact zeros, multiples of 1/8 (lattice), values 5e-7 and 5e-6 off 1/8 (on and off the lattice's
    1e-6), Δ < −10 at many segment starts and a few other tokens, and one |Δ| > 20 (the clamp)."""
    rng = np.random.default_rng(1000 + step)
    mask = np.zeros((B, T), np.int64)
    seg = np.zeros((B, T), np.int64)
    for b in range(B):
        p, turn = int(b == 3), 0  # row 3: position 0 untrained
        while p < T - 2:
            n = int(rng.integers(2, 7))
            mask[b, p:p + n] = 1
            seg[b, p:] = turn
            p += n + int(rng.integers(1, 4))  # environment tokens
            turn += 1
        mask[b, T - int(rng.integers(0, 4)):] = 0  # padding
    s = -rng.uniform(1.0, 8.0, (B, T))
    d = np.minimum(rng.normal(0.02, 0.3, (B, T)), 0.9)
    u = rng.random((B, T))
    d[u < 0.1] = 0.0
    lattice = (u >= 0.1) & (u < 0.2)
    d[lattice] = rng.choice([k / 8 for k in range(-8, 8) if k], lattice.sum())
    d[(u >= 0.2) & (u < 0.22)] = 0.125 + 5e-7
    d[(u >= 0.22) & (u < 0.24)] = 0.125 + 5e-6
    d[(u >= 0.24) & (u < 0.27)] = -11.0
    starts = np.zeros((B, T), bool)
    starts[:, 0] = True
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    d[starts & (rng.random((B, T)) < 0.4)] = -12.5
    t = s + d
    s[0, 0], t[0, 0] = -30.0, -1.0
    s[mask == 0] = np.nan  # padding and environment tokens are never read
    adv = np.repeat(rng.normal(0, 1, (B, 1)), T, axis=1)
    adv[1] += np.linspace(0, 1, T)  # one row whose per-token advantages differ
    return dict(sampler_logprobs=torch.from_numpy(s), trainer_logprobs=torch.from_numpy(t),
                mask=torch.from_numpy(mask), token_ids=torch.from_numpy(rng.integers(0, 500, (B, T))),
                sample_ids=torch.arange(B) * 2 + 7, rewards=torch.from_numpy(rng.normal(0.5, 0.3, B)),
                advantages=torch.from_numpy(adv), prompts=[f"Prompt {step}.{b}: ¿2 + {b}?" for b in range(B)],
                responses=[f"answer «{b}»\nline two" for b in range(B)], tags=[TAGS[b % 3] for b in range(B)],
                segment_ids=torch.from_numpy(seg), sampling_support=torch.from_numpy(rng.integers(1, 60, (B, T))))


def trained(step: int, data: dict) -> dict[str, np.ndarray]:
    """The step's trained tokens (mask 1), row-major: step, sample, pos, s, t, segment, support, advantage."""
    m = data["mask"].numpy().astype(bool)
    b, p = np.nonzero(m)
    return {"step": np.full(len(b), step), "sample": data["sample_ids"].numpy()[b], "pos": p,
            "s": data["sampler_logprobs"].numpy()[m], "t": data["trainer_logprobs"].numpy()[m],
            "segment": data["segment_ids"].numpy()[m], "support": data["sampling_support"].numpy()[m],
            "advantage": data["advantages"].numpy()[m]}


def reference(steps: dict[int, dict], by: str) -> dict[tuple, dict]:
    """ref_residual per (run "r", step) or per run over the trained tokens of `steps` {step: log_step kwargs}."""
    groups: dict[tuple, list] = {}
    for step, data in steps.items():
        groups.setdefault(("r", step) if by == "step" else ("r",), []).append(trained(step, data))
    out = {}
    for key, parts in groups.items():
        x = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        label = list(zip(x["step"].tolist(), x["sample"].tolist()))
        out[key] = ref_residual(x["t"] - x["s"], x["pos"].tolist(), label, x["segment"].tolist())
    return out


def write_jsonl(path: Path, run: str, steps: dict[int, dict]) -> Path:
    """The steps as sequence JSON Lines: one line per row, every position with `loss_mask`, the per-token
    `segment_ids`, `sampling_support` and `advantage` lists, and the sequence's reward, prompt, response and tag
    (padding written as log-prob 0, masked out)."""
    with open(path, "w", encoding="utf-8") as f:
        for step, data in steps.items():
            m = data["mask"].numpy()
            for b in range(m.shape[0]):
                clean = lambda x: np.where(m[b] == 1, x, 0.0).tolist()  # noqa: E731
                f.write(json.dumps({
                    "run": run, "step": step, "sample": int(data["sample_ids"][b]),
                    "sampler_logprobs": clean(data["sampler_logprobs"][b].numpy()),
                    "trainer_logprobs": clean(data["trainer_logprobs"][b].numpy()),
                    "loss_mask": m[b].tolist(), "token_ids": data["token_ids"][b].tolist(),
                    "segment_ids": data["segment_ids"][b].tolist(),
                    "sampling_support": data["sampling_support"][b].tolist(),
                    "advantage": data["advantages"][b].tolist(), "reward": float(data["rewards"][b]),
                    "prompt": data["prompts"][b], "response": data["responses"][b], "tag": data["tags"][b]},
                    ensure_ascii=False) + "\n")
    return path
