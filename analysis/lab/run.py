"""The drift lab's RL loop: a sampler decodes with a KV cache, a trainer recomputes with one forward, Adam updates.

The policy first learns the task (analysis/lab/task.py) a little by supervised training in fp32, the same for
every preset of a seed; then each RL step samples `group` answers per prompt, rewards them, and takes one
policy-gradient step with group-normalised advantages (GRPO-style), optionally through an off-policy correction
(METRICS.md "Corrections": tis, icepop, geo_rs, seq_rs, veto) applied to the ratio r = exp(t − s) of the
trainer's log-prob over the sampler's.

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

from analysis.lab import task
from analysis.lab.model import GPT, GPTConfig, KVCache
from analysis.lab.presets import DTYPE_NAMES, GROUP, PRESETS, LabConfig
from analysis.record.logger import DriftLogger
from analysis.run_names import safe_run_name

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
assert set(DTYPE_NAMES) == set(DTYPES)
SFT_BATCH = 64   # sequences per warm-start step
CLAMP = 20.0     # Δ is clamped to ±20 before exp, as METRICS.md's r


def model_config(cfg: LabConfig) -> GPTConfig:
    """The model's shape and precision switches for a lab configuration."""
    return GPTConfig(vocab=len(task.VOCAB), d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers,
                     n_experts=cfg.n_experts, top_k=cfg.top_k, d_ff=cfg.d_ff,
                     max_len=task.PROMPT_LEN + task.RESPONSE_LEN, fp32_lm_head=cfg.fp32_head,
                     fp32_router=cfg.fp32_router)


@torch.no_grad()
def sample(model: GPT, prompts: torch.Tensor, response_len: int, generator: torch.Generator):
    """Sampler path: prefill, then batched token-by-token decoding with a KV cache, temperature 1.

    Returns response tokens (B, R), their log-probs (B, R) fp32, and the experts and combine weights of every
    input position (B, P + R - 1, L, k): routing replay needs the prompt's too. Every response is decoded to R
    tokens; what follows its end token is masked out of training and logging.
    """
    cache = KVCache(model.cfg.n_layers)
    logprobs, experts, weights = model(prompts, cache, with_weights=True)
    all_experts, all_weights, tokens, token_logprobs = [experts], [weights], [], []
    for j in range(response_len):
        last = logprobs[:, -1].float()  # (B, vocab): exact widening of the sampler's own numbers
        token = torch.multinomial(last.exp(), 1, generator=generator)  # (B, 1)
        tokens.append(token)
        token_logprobs.append(last.gather(-1, token))
        if j + 1 < response_len:
            logprobs, experts, weights = model(token, cache, with_weights=True)  # (B, 1, vocab)
            all_experts.append(experts)
            all_weights.append(weights)
    return (torch.cat(tokens, 1), torch.cat(token_logprobs, 1), torch.cat(all_experts, 1),
            torch.cat(all_weights, 1))


def correction_weights(delta: torch.Tensor, mask: torch.Tensor, method: str, params: dict) -> torch.Tensor:
    """Per-token loss weights (B, R) of an off-policy correction, from Δ = t − s (detached) of the trained tokens.

    The rules of METRICS.md "Corrections" (parameters as analysis.metrics.corrections.METHODS names them), with
    r = exp(clamp(Δ, −20, 20)): tis weighs a token by min(r, C); icepop keeps a token with alpha ≤ r ≤ beta;
    geo_rs keeps a sequence with exp(mean Δ) in [lo, hi]; seq_rs one with exp(clamp(Σ Δ, −20, 20)) in [lo, hi];
    veto drops a sequence with some token r < tau. A dropped token or sequence gets weight 0; "none" weighs 1.
    """
    d = torch.where(mask, delta, torch.zeros_like(delta)).double()
    r = torch.exp(d.clamp(-CLAMP, CLAMP))
    if method == "none":
        w = torch.ones_like(r)
    elif method == "tis":
        w = torch.clamp(r, max=params["C"])
    elif method == "icepop":
        w = ((r >= params["alpha"]) & (r <= params["beta"])).double()
    elif method in ("geo_rs", "seq_rs"):
        total = d.sum(1)
        n = mask.sum(1).clamp(min=1)
        g = torch.exp(total / n) if method == "geo_rs" else torch.exp(total.clamp(-CLAMP, CLAMP))
        w = ((g >= params["lo"]) & (g <= params["hi"])).double()[:, None].expand_as(r)
    elif method == "veto":
        low = torch.where(mask, r < params["tau"], torch.zeros_like(mask)).any(1)
        w = (~low).double()[:, None].expand_as(r)
    else:
        raise ValueError(f"correction: unknown method {method!r}")
    return (w * mask).float()


def train_step(model: GPT, params: dict, seqs: torch.Tensor, mask: torch.Tensor, prompt_len: int,
               micro_batch: int, advantages: torch.Tensor, sampler_logprobs: torch.Tensor,
               correction: tuple[str, dict] = ("none", {}), forced: torch.Tensor | None = None,
               forced_weights: torch.Tensor | None = None):
    """Trainer path: teacher-forced forward per micro-batch; accumulates the policy gradient into `model`.

    `params` are the model's parameters cast to the trainer dtype (differentiable). The response token j is
    predicted at input position prompt_len + j - 1, so its log-prob and experts come from there. The loss is
    −Σ A_b · w_bj · log π(token) over the trained tokens / their count, w from `correction_weights`.
    Returns the trainer's log-probs (B, R), experts (B, R, L, k) and correction weights (B, R).
    """
    n_tokens = int(mask.sum())
    token_logprobs, token_experts, token_weights = [], [], []
    for lo in range(0, seqs.size(0), micro_batch):
        part = slice(lo, lo + micro_batch)
        chunk = seqs[part]
        inputs, targets = chunk[:, :-1], chunk[:, prompt_len:]  # (b, S-1), (b, R)
        kwargs = {"forced_experts": None if forced is None else list(forced[part].unbind(2)),
                  "forced_weights": None if forced_weights is None else list(forced_weights[part].unbind(2))}
        logprobs, experts = functional_call(model, params, (inputs,), kwargs)
        picked = logprobs[:, prompt_len - 1:].gather(-1, targets[..., None]).squeeze(-1).float()  # (b, R)
        w = correction_weights(picked.detach() - sampler_logprobs[part], mask[part], *correction)
        loss = -(advantages[part, None] * w * picked).sum() / max(n_tokens, 1)
        loss.backward()
        token_logprobs.append(picked.detach())
        token_experts.append(experts[:, prompt_len - 1:])
        token_weights.append(w)
    return torch.cat(token_logprobs), torch.cat(token_experts), torch.cat(token_weights)


_SFT_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def warm_start(model: GPT, cfg: LabConfig, seed: int) -> None:
    """Supervised fp32 training on the task's answers (`sft_steps` Adam steps on fresh prompts), so RL starts from
    a policy that is right sometimes. The same for every preset of a seed (precision switches do not touch it),
    so it runs once per process and shape; weights land in `model`."""
    key = (dataclasses.astuple(model_config(dataclasses.replace(cfg, fp32_head=False, fp32_router=False))),
           cfg.sft_steps, cfg.sft_lr, seed)
    if key not in _SFT_CACHE:
        rng = np.random.default_rng([seed, 7])
        optimizer = torch.optim.Adam(model.parameters(), lr=cfg.sft_lr)
        for _ in range(cfg.sft_steps):
            prompts, answers, _ = task.make_prompts(rng, SFT_BATCH)
            target = np.full((SFT_BATCH, task.RESPONSE_LEN), task.END_ID, dtype=np.int64)
            weight = np.zeros((SFT_BATCH, task.RESPONSE_LEN))
            for i, answer in enumerate(answers):
                target[i, :len(answer)] = task.encode(answer)
                weight[i, :len(answer)] = 1.0
            seqs = torch.from_numpy(np.concatenate([prompts, target], 1)).to(model.lm_head.weight.device)
            logprobs, _ = model(seqs[:, :-1])
            picked = logprobs[:, task.PROMPT_LEN - 1:].gather(-1, seqs[:, task.PROMPT_LEN:, None]).squeeze(-1)
            w = torch.from_numpy(weight).to(picked)
            loss = -(w * picked).sum() / w.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        _SFT_CACHE[key] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_SFT_CACHE[key][n])
    model.zero_grad(set_to_none=True)  # no gradient of the warm start may leak into the first RL step


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
    for shard in [*run_dir.glob("tokens-*.parquet"), *run_dir.glob("routing-*.parquet"),
                  *run_dir.glob("summary-*.parquet")]:
        shard.unlink()


def run_lab(preset: str = "bf16", out_dir: str | Path = "lab_runs", steps: int | None = None, seed: int = 0,
            device: str = "cpu", run: str | None = None, token_sample: float = 1.0, pack: bool = False,
            **overrides) -> dict:
    """Run one preset (with optional LabConfig overrides), write its logs to out_dir/run, return a summary.

    token_sample: DriftLogger's share of tokens written as token rows (summaries cover every token).
    pack: after the run, merge the per-step files of each kind into one (analysis/lab/pack.py).
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    if steps is not None:
        overrides["steps"] = steps
    if isinstance(overrides.get("correction_params"), dict):
        overrides["correction_params"] = tuple(sorted(overrides["correction_params"].items()))
    cfg = dataclasses.replace(PRESETS[preset], **overrides)
    run = safe_run_name(run or preset)  # refused before the warm start's seconds, not after
    from analysis.metrics.corrections import resolve_params  # the METRICS.md defaults and checks
    correction = (cfg.correction, {} if cfg.correction == "none"
                  else resolve_params(cfg.correction, dict(cfg.correction_params)))
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine; use device='cpu'")
    # One CPU thread: at these sizes threads only add overhead (10x slower on a busy 2-core machine), and
    # CPU kernels split work by thread count, so the demo's bytes would otherwise depend on the machine.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        summary = _run(cfg, correction, preset, Path(out_dir), seed, device, run, token_sample)
    finally:
        torch.set_num_threads(threads)
    if pack:
        from analysis.lab.pack import pack_run
        pack_run(Path(summary["out"]))
    return summary


def _run(cfg: LabConfig, correction: tuple[str, dict], preset: str, out_dir: Path, seed: int,
         device: torch.device, run: str, token_sample: float) -> dict:
    started = time.perf_counter()

    with torch.random.fork_rng(devices=[]):  # nn.Module constructors draw from the caller's global RNG
        model = GPT(model_config(cfg))
        sampler = GPT(model.cfg).requires_grad_(False)
    model.init_weights(torch.Generator().manual_seed(seed))  # on CPU: the same weights on every device
    warm_start(model, cfg, seed)
    model.to(device)
    sampler.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    prompt_rng = np.random.default_rng([seed, 1])
    sampler_dtype, trainer_dtype = DTYPES[cfg.sampler_dtype], DTYPES[cfg.trainer_dtype]
    history = [(0, _snapshot(model))]  # (version, weights); the sampler reads the oldest

    config = dataclasses.asdict(cfg) | {
        "preset": preset, "seed": seed, "device": device.type, "engine": "driftscope-lab",
        "torch": torch.__version__.split("+")[0], "task": "sort or reverse a word (analysis/lab/task.py)",
        "group": GROUP, "correction_params": correction[1], "token_sample": token_sample}
    _clear_previous(out_dir / run)
    logger = DriftLogger(out_dir, run, config, token_sample=token_sample)
    n_prompts = cfg.batch // GROUP
    s_all, t_all, flip_all, rewards, weights_all = [], [], [], [], []
    for step in range(cfg.steps):
        sampler_version, weights = history[0]
        prompt_ids, answers, tags = task.make_prompts(prompt_rng, n_prompts)
        prompt_ids, answers, tags = (np.repeat(prompt_ids, GROUP, 0), np.repeat(answers, GROUP).tolist(),
                                     np.repeat(tags, GROUP).tolist())
        prompts = torch.from_numpy(prompt_ids).to(device)
        tokens, s_lp, s_route, s_comb = sample(_load_sampler(sampler, weights, sampler_dtype), prompts,
                                               task.RESPONSE_LEN, generator)
        host_tokens = tokens.cpu().numpy()
        lengths = task.response_lengths(host_tokens)
        mask = torch.from_numpy(np.arange(task.RESPONSE_LEN)[None, :] < lengths[:, None]).to(device)
        reward = task.rewards(host_tokens, answers)
        grouped = reward.reshape(n_prompts, GROUP)
        adv = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-6)).ravel()
        seqs = torch.cat([prompts, tokens], 1)  # (B, P + R)
        t_lp, t_experts, w = train_step(
            model, model.cast_params(trainer_dtype), seqs, mask, task.PROMPT_LEN, cfg.trainer_micro_batch,
            torch.from_numpy(adv).float().to(device), s_lp, correction,
            forced=s_route if cfg.replay != "none" else None,
            forced_weights=s_comb if cfg.replay == "ids+weights" else None)
        s_experts = s_route[:, task.PROMPT_LEN - 1:]  # (B, R, L, k)
        logger.log_step(step, s_lp, t_lp, mask, token_ids=tokens,
                        sampler_experts=s_experts, trainer_experts=t_experts,
                        sampler_version=sampler_version, trainer_version=step,
                        rewards=reward, advantages=adv, tags=tags,
                        prompts=[task.prompt_text(p) for p in prompt_ids],
                        responses=[task.decode(t[:n]) for t, n in zip(host_tokens, lengths)])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history = (history + [(step + 1, _snapshot(model))])[-(cfg.lag + 1):]

        keep = mask.cpu().numpy()
        s_all.append(s_lp.double().cpu().numpy()[keep])
        t_all.append(t_lp.double().cpu().numpy()[keep])
        same = torch.sort(s_experts, -1).values == torch.sort(t_experts, -1).values  # (B, R, L, k)
        flip_all.append((~same.all(-1)).any(-1).cpu().numpy()[keep])
        weights_all.append(w.cpu().numpy()[keep])
        rewards.append(float(reward.mean()))

    d = np.concatenate(t_all) - np.concatenate(s_all)
    k3 = [float(np.mean(np.expm1(tt - ss) - (tt - ss))) for ss, tt in zip(s_all, t_all)]
    w = np.concatenate(weights_all)
    return {
        "preset": preset, "run": run, "steps": cfg.steps, "n_tokens": int(d.size),
        "kl_k3": float(np.mean(np.expm1(d) - d)),
        "token_any_flip_rate": float(np.mean(np.concatenate(flip_all))),
        "reward_first": rewards[0], "reward_last": rewards[-1], "rewards": rewards, "kl_k3_by_step": k3,
        "correction": correction[0], "weight_mean": float(w.mean()), "zero_weight_frac": float(np.mean(w == 0)),
        "seconds": time.perf_counter() - started, "out": str(logger.dir),
    }
