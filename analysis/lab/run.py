"""The drift lab's RL loop: a sampler decodes with a KV cache, a trainer recomputes with one forward, Adam updates.

All drift is real floating-point behaviour of torch (dtype, KV-cache vs teacher-forced order, batch size,
stale weights); nothing is injected. Each step is written with DriftLogger in the SCHEMA.md long format.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.func import functional_call

from analysis.lab.model import GPT, GPTConfig, KVCache
from analysis.lab.presets import DTYPE_NAMES, PRESETS, LabConfig
from analysis.record.logger import DriftLogger

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert set(DTYPES) == set(DTYPE_NAMES)


def model_config(cfg: LabConfig) -> GPTConfig:
    """The model's shape and precision switches for a lab configuration."""
    return GPTConfig(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                     n_experts=cfg.n_experts, top_k=cfg.top_k, max_len=cfg.prompt_len + cfg.response_len,
                     fp32_lm_head=cfg.fp32_head, fp32_router=cfg.fp32_router)


@torch.no_grad()
def sample(model: GPT, prompts: torch.Tensor, response_len: int, generator: torch.Generator):
    """Sampler path: prefill, then batched token-by-token decoding with a KV cache, temperature 1.

    Returns response tokens (B, R), their log-probs (B, R) fp32, and the experts of every input position
    (B, P + R - 1, L, k): routing replay needs the prompt's too.
    """
    cache = KVCache(model.cfg.n_layers)
    logprobs, experts = model(prompts, cache)
    all_experts, tokens, token_logprobs = [experts], [], []
    for j in range(response_len):
        last = logprobs[:, -1].float()  # (B, vocab): exact widening of the sampler's own numbers
        token = torch.multinomial(last.exp(), 1, generator=generator)  # (B, 1)
        tokens.append(token)
        token_logprobs.append(last.gather(-1, token))
        if j + 1 < response_len:
            logprobs, experts = model(token, cache)  # (B, 1, vocab)
            all_experts.append(experts)
    return torch.cat(tokens, 1), torch.cat(token_logprobs, 1), torch.cat(all_experts, 1)


def train_step(model: GPT, params: dict, seqs: torch.Tensor, prompt_len: int, micro_batch: int,
               advantages: torch.Tensor, forced: torch.Tensor | None = None):
    """Trainer path: teacher-forced forward per micro-batch; accumulates the REINFORCE gradient into `model`.

    `params` are the model's parameters cast to the trainer dtype (differentiable). The response token j is
    predicted at input position prompt_len + j - 1, so its log-prob and experts come from there.
    Returns the trainer's log-probs (B, R) and experts (B, R, L, k) of the response tokens.
    """
    B, S = seqs.shape
    n_tokens = B * (S - prompt_len)
    token_logprobs, token_experts = [], []
    for lo in range(0, B, micro_batch):
        chunk = seqs[lo:lo + micro_batch]
        inputs, targets = chunk[:, :-1], chunk[:, prompt_len:]  # (b, S-1), (b, R)
        forced_layers = None if forced is None else list(forced[lo:lo + micro_batch].unbind(2))
        logprobs, experts = functional_call(model, params, (inputs,), {"forced_experts": forced_layers})
        picked = logprobs[:, prompt_len - 1:].gather(-1, targets[..., None]).squeeze(-1).float()  # (b, R)
        loss = -(advantages[lo:lo + micro_batch, None] * picked).sum() / n_tokens
        loss.backward()
        token_logprobs.append(picked.detach())
        token_experts.append(experts[:, prompt_len - 1:])
    return torch.cat(token_logprobs), torch.cat(token_experts)


def reward_fn(tokens: torch.Tensor) -> torch.Tensor:
    """Toy reward: the fraction of even token ids in each response."""
    return (tokens % 2 == 0).double().mean(dim=1)


def _snapshot(model: GPT) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@torch.no_grad()
def _load_sampler(sampler: GPT, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> GPT:
    """The sampler engine's own copy of the weights, in its dtype (fp32 where a switch says so)."""
    keep = sampler.fp32_param_names()
    for n, p in sampler.named_parameters():
        p.data = weights[n].float() if n in keep else weights[n].to(dtype)
    return sampler


def _clear_previous(run_dir: Path) -> None:
    """A rerun replaces the lab's own earlier shards (a shorter rerun must not leave old steps behind)."""
    meta = run_dir / "run.json"
    if not meta.exists():
        return
    try:
        engine = (json.loads(meta.read_text(encoding="utf-8")).get("config") or {}).get("engine")
    except (ValueError, AttributeError):
        engine = None
    if engine != "driftscope-lab":
        raise ValueError(f"{run_dir} holds logs the lab did not write; choose another output folder or run name")
    for shard in [*run_dir.glob("tokens-step*.parquet"), *run_dir.glob("routing-step*.parquet"),
                  *run_dir.glob("summary-step*.parquet")]:
        shard.unlink()


def run_lab(preset: str = "bf16", out_dir: str | Path = "lab_runs", steps: int | None = None, seed: int = 0,
            device: str = "cpu", run: str | None = None, **overrides) -> dict:
    """Run one preset (with optional LabConfig overrides), write its logs to out_dir/run, return a summary."""
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    if steps is not None:
        overrides["steps"] = steps
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine; use device='cpu'")
    # One CPU thread: at these sizes threads only add overhead (10x slower on a busy 2-core machine), and
    # CPU kernels split work by thread count, so the demo's bytes would otherwise depend on the machine.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _run(cfg, preset, Path(out_dir), seed, device, run or preset)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: LabConfig, preset: str, out_dir: Path, seed: int, device: torch.device, run: str) -> dict:
    started = time.perf_counter()

    with torch.random.fork_rng(devices=[]):  # nn.Module constructors draw from the caller's global RNG
        model = GPT(model_config(cfg))
        sampler = GPT(model.cfg).to(device).requires_grad_(False)
    model.init_weights(torch.Generator().manual_seed(seed))  # on CPU: the same weights on every device
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    sampler_dtype, trainer_dtype = DTYPES[cfg.sampler_dtype], DTYPES[cfg.trainer_dtype]
    history = [(0, _snapshot(model))]  # (version, weights); the sampler reads the oldest

    config = dataclasses.asdict(cfg) | {"preset": preset, "seed": seed, "device": device.type,
                                        "engine": "driftscope-lab", "torch": torch.__version__.split("+")[0]}
    _clear_previous(out_dir / run)
    logger = DriftLogger(out_dir, run, config)
    s_all, t_all, flip_all, rewards = [], [], [], []
    for step in range(cfg.steps):
        sampler_version, weights = history[0]
        prompts = torch.randint(0, cfg.vocab, (cfg.batch, cfg.prompt_len), generator=generator, device=device)
        tokens, s_lp, s_route = sample(_load_sampler(sampler, weights, sampler_dtype), prompts,
                                       cfg.response_len, generator)
        seqs = torch.cat([prompts, tokens], 1)  # (B, P + R)
        reward = reward_fn(tokens)
        advantages = (reward - reward.mean()) / (reward.std(correction=0) + 1e-6)
        t_lp, t_experts = train_step(model, model.cast_params(trainer_dtype), seqs, cfg.prompt_len,
                                     cfg.trainer_micro_batch, advantages.float(),
                                     forced=s_route if cfg.replay else None)
        s_experts = s_route[:, cfg.prompt_len - 1:]  # (B, R, L, k)
        logger.log_step(step, s_lp, t_lp, torch.ones_like(tokens), token_ids=tokens,
                        sampler_experts=s_experts, trainer_experts=t_experts,
                        sampler_version=sampler_version, trainer_version=step,
                        rewards=reward, advantages=advantages, prompts=prompts)  # prompt ids: no tokenizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history = (history + [(step + 1, _snapshot(model))])[-(cfg.lag + 1):]

        s_all.append(s_lp.double().cpu().numpy().ravel())
        t_all.append(t_lp.double().cpu().numpy().ravel())
        same = torch.sort(s_experts, -1).values == torch.sort(t_experts, -1).values  # (B, R, L, k)
        flip_all.append((~same.all(-1)).any(-1).cpu().numpy().ravel())
        rewards.append(float(reward.mean()))

    d = np.concatenate(t_all) - np.concatenate(s_all)
    return {
        "preset": preset, "run": run, "steps": cfg.steps, "n_tokens": int(d.size),
        "kl_k3": float(np.mean(np.expm1(d) - d)),
        "token_any_flip_rate": float(np.mean(np.concatenate(flip_all))),
        "reward_first": rewards[0], "reward_last": rewards[-1],
        "seconds": time.perf_counter() - started, "out": str(logger.dir),
    }
