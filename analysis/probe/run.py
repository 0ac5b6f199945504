"""Run the probe: the same tokens through sampler numerics and trainer numerics, compared op by op.

Passes, all on one set of fp32 master weights cast to each dtype:
- sampler: prefill the prompt, then decode one token at a time on the KV cache in the sampler dtype, sampling
  each next token (temperature 1, seeded) from the fp32 softmax of its logits: these are the probe's tokens;
- trainer: one teacher-forced forward over prompt + response in the trainer dtype;
- floor: the same two computations with both sides in fp32 (decoding the sampler's tokens, not sampling): what
  KV-cache decoding against one forward costs when no precision differs. A side already in fp32 is reused.
Response token j is predicted from input position P + j - 1 (P = prompt length), so its row compares the
activations at that position. Log-probs are log_softmax in fp32 of each side's logits, as engines report them.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from analysis import schema
from analysis.probe.models import ModelError, Recorder, Target, load_target
from analysis.record.logger import DriftLogger
from analysis.run_names import run_name_slug, safe_run_name

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROBE_FILE = "probe.json"  # a JSON array (first line "["): ingest's folder walk passes over it as "not a log file"
ENGINE = "driftscope-probe"


def read_prompts(path: str | Path, tokenizer_dir: str | None) -> list[list[int]]:
    """One prompt per non-blank line: token ids separated by spaces, or text (then the model folder's tokenizer
    encodes it). Errors name the file and line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot be read ({e})") from None
    tokenizer, prompts = None, []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        if all(p.isdigit() for p in parts):
            prompts.append([int(p) for p in parts])
            continue
        if tokenizer is None:
            if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
                raise ValueError(f"--prompts {path}, line {no}: text needs the model folder's tokenizer; this model "
                                 "has none, so write the prompt as token ids separated by spaces")
            import transformers
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True,
                                                                       trust_remote_code=False)
            except (OSError, ValueError) as e:
                raise ValueError(f"--prompts {path}, line {no}: no tokenizer in {tokenizer_dir} ({e}); write token "
                                 "ids instead") from None
        prompts.append(list(tokenizer(line, add_special_tokens=False)["input_ids"]))
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompt (one per line)")
    return prompts


def _vocab(target: Target) -> int:
    cfg = getattr(target.model, "config", None) or target.model.cfg
    return int(getattr(cfg, "vocab_size", None) or getattr(cfg, "vocab"))


@torch.no_grad()
def decode(target: Target, prompt: torch.Tensor, n: int, generator: torch.Generator | None = None,
           tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KV-cache decoding of n tokens: sampled with `generator`, or the given `tokens` (teacher-forced).
    Returns the tokens (n,) and their log-probs (n,) float64."""
    logits, cache = target.prefill(prompt)
    out, lps = [], []
    for j in range(n):
        lp = torch.log_softmax(logits[-1].float(), dim=-1)
        tok = tokens[j:j + 1] if tokens is not None else torch.multinomial(lp.exp(), 1, generator=generator)
        out.append(tok)
        lps.append(lp[tok].double())
        if j + 1 < n:
            logits, cache = target.decode(tok, cache)
    return torch.cat(out), torch.cat(lps)


@torch.no_grad()
def teacher_forced(target: Target, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """One forward over prompt + tokens[:-1]; the log-prob (float64) of each response token."""
    seq = torch.cat([prompt, tokens[:-1]])
    lp = torch.log_softmax(target.forward(seq).float(), dim=-1)[len(prompt) - 1:]
    return lp.gather(-1, tokens[:, None]).squeeze(-1).double()


def _run_side(target: Target, prompt, n, perturb=None, generator=None, tokens=None, trainer=False):
    rec = Recorder(target, perturb)
    try:
        if trainer:
            lps = teacher_forced(target, prompt, tokens)
        else:
            tokens, lps = decode(target, prompt, n, generator, tokens)
        acts = {k: v[len(prompt) - 1:] for k, v in rec.take().items()}  # the n positions that predict tokens
    finally:
        rec.close()
    return tokens, lps, acts


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row: relative L2 ||a - b|| / ||b|| (0 where a == b, NaN where only b is 0) and max |a - b|, float64."""
    a, b = a.double(), b.double()
    d = a - b
    num, den = d.norm(dim=-1), b.norm(dim=-1)
    rel = torch.where(num == 0, torch.zeros_like(num), num / den)
    rel = torch.where((den == 0) & (num > 0), torch.full_like(num, float("nan")), rel)
    return rel.numpy(), d.abs().amax(dim=-1).numpy()


def router_view(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k ids (descending fp32 softmax, stable: ties go to the lower id) and the margin p_(k) - p_(k+1) as
    float64 (NaN with k experts or fewer)."""
    p = torch.softmax(logits.float(), dim=-1)
    vals, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    margin = (vals[:, k - 1] - vals[:, k]).double() if p.shape[-1] > k else torch.full((len(p),), float("nan"))
    return ids[:, :k].numpy().astype(np.int64), margin.double().numpy()


def probe_rows(run: str, sample: int, target: Target, s_acts, t_acts, fs_acts, ft_acts) -> dict[str, list]:
    """The probe table's columns (schema.PROBE) for one prompt's tokens."""
    cols: dict[str, list] = {c.name: [] for c in schema.PROBE}
    for layer in range(len(target.layers)):
        for op in schema.PROBE_OPS:
            if (layer, op) not in s_acts:
                continue
            s, t = s_acts[(layer, op)], t_acts[(layer, op)]
            rel, mx = compare(s, t)
            frel, fmx = compare(fs_acts[(layer, op)], ft_acts[(layer, op)])
            n = len(rel)
            cols["run"] += [run] * n
            cols["step"] += [0] * n
            cols["sample"] += [sample] * n
            cols["pos"] += list(range(n))
            cols["layer"] += [layer] * n
            cols["op"] += [op] * n
            for name, v in (("rel_l2", rel), ("max_abs", mx), ("floor_rel_l2", frel), ("floor_max_abs", fmx)):
                cols[name] += [None if np.isnan(x) else float(x) for x in v]
            if op == "router":
                if target.n_experts and s.shape[-1] != target.n_experts:
                    raise ModelError(f"{target.name}: layer {layer}'s router gives {s.shape[-1]} scores per token, "
                                     f"the config {target.n_experts} experts: not router logits")
                s_ids, s_m = router_view(s, target.top_k)
                t_ids, t_m = router_view(t, target.top_k)
                cols["sampler_topk"] += s_ids.tolist()
                cols["trainer_topk"] += t_ids.tolist()
                cols["sampler_margin"] += [None if np.isnan(x) else float(x) for x in s_m]
                cols["trainer_margin"] += [None if np.isnan(x) else float(x) for x in t_m]
                cols["flip"] += [set(a) != set(b) for a, b in zip(s_ids.tolist(), t_ids.tolist())]
            else:
                for name in ("sampler_topk", "trainer_topk", "sampler_margin", "trainer_margin", "flip"):
                    cols[name] += [None] * n
    return cols


def _experts(target: Target, acts) -> torch.Tensor | None:
    """(n, L_moe, k) router top-k of the MoE blocks, for the routing rows; None for a dense model."""
    moe = [i for i, layer in enumerate(target.layers) if layer.router is not None]
    if not moe:
        return None
    return torch.stack([torch.from_numpy(router_view(acts[(i, "router")], target.top_k)[0]) for i in moe], dim=1)


def write_probe_file(path: Path, cols: dict[str, list]) -> None:
    """A JSON array of row objects, one per line (floats as Python writes them: they read back exactly)."""
    names = list(cols)
    n = len(cols[names[0]]) if names else 0
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("[\n")
        for i in range(n):
            f.write(json.dumps({c: cols[c][i] for c in names}, allow_nan=False) + (",\n" if i + 1 < n else "\n"))
        f.write("]\n")
    os.replace(tmp, path)


def _clear_previous(run_dir: Path) -> None:
    """A rerun into the same folder replaces the probe's own earlier files (a dense rerun must not leave the old
    routing rows behind); a folder that holds other logs is refused."""
    meta = run_dir / "run.json"
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return
    try:
        engine = (json.loads(meta.read_text(encoding="utf-8")).get("config") or {}).get("engine")
    except (OSError, ValueError, AttributeError):
        engine = None
    if engine != ENGINE:
        raise ValueError(f"{run_dir} exists and holds no probe output; choose another --out or --run")
    for f in [*run_dir.glob("tokens-step*.parquet"), *run_dir.glob("routing-step*.parquet"),
              *run_dir.glob("summary-step*.parquet"), run_dir / PROBE_FILE]:
        f.unlink(missing_ok=True)


def run_probe(model: str | Target = "lab", out_dir: str | Path = "probe_runs", sampler_dtype: str = "bf16",
              trainer_dtype: str = "fp32", prompts: list[list[int]] | None = None, tokens: int = 64,
              device: str = "cpu", seed: int = 0, run: str | None = None, prompt_len: int = 8,
              perturb: tuple[int, str, float, int] | None = None) -> dict:
    """Probe `model` (a load_target spec, or a Target) on `prompts` (default: one random prompt of `prompt_len`
    ids, seeded) with `tokens` response tokens each; writes out_dir/run (DriftLogger's files + probe.json) and
    returns a summary. `perturb` (layer, op, scale, seed): noise on the sampler's measured pass only."""
    for name, value in (("sampler_dtype", sampler_dtype), ("trainer_dtype", trainer_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{name}: expected one of {sorted(DTYPES)}, got {value!r}")
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens: expected a positive int, got {tokens!r}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: CUDA is not available on this machine; use --device cpu")
    # One CPU thread, as in the lab (analysis/lab/run.py): at these sizes a second thread only waits, and on a busy
    # 2-core machine a decoding step took 20-50x longer with two (benchmarks/RESULTS-probe.md)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _probe(model, Path(out_dir), sampler_dtype, trainer_dtype, prompts, tokens, dev, seed, run, prompt_len,
                      perturb)
    finally:
        torch.set_num_threads(threads)


def _probe(model, out_dir, sampler_dtype, trainer_dtype, prompts, tokens, dev, seed, run, prompt_len, perturb) -> dict:
    started = time.perf_counter()
    longest = max((len(p) for p in prompts), default=prompt_len) if prompts else prompt_len
    master = model if isinstance(model, Target) else load_target(model, seed, dev, max_len=longest + tokens)
    vocab = _vocab(master)
    if prompts is None:
        gen = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()]
    for i, p in enumerate(prompts):
        if not p or not all(isinstance(t, int) and 0 <= t < vocab for t in p):
            raise ValueError(f"prompt {i}: token ids must lie in 0..{vocab - 1} (the model's vocabulary)")
    # the default name comes from the model's folder name: made safe; a given name must be safe as it is
    run = safe_run_name(run) if run else run_name_slug(f"probe-{master.name}-{sampler_dtype}-{trainer_dtype}")
    sides = {d: master if d == "fp32" else master.cast(DTYPES[d]) for d in {sampler_dtype, trainer_dtype, "fp32"}}
    generator = torch.Generator(device=dev).manual_seed(seed + 1)

    s_lp, t_lp, all_tokens, s_exp, t_exp, tables = [], [], [], [], [], []
    for sample, ids in enumerate(prompts):
        prompt = torch.tensor(ids, dtype=torch.long, device=dev)
        toks, slp, s_acts = _run_side(sides[sampler_dtype], prompt, tokens, perturb, generator=generator)
        _, tlp, t_acts = _run_side(sides[trainer_dtype], prompt, tokens, tokens=toks, trainer=True)
        fs_acts = s_acts if sampler_dtype == "fp32" and perturb is None else \
            _run_side(sides["fp32"], prompt, tokens, tokens=toks)[2]
        ft_acts = t_acts if trainer_dtype == "fp32" else \
            _run_side(sides["fp32"], prompt, tokens, tokens=toks, trainer=True)[2]
        tables.append(probe_rows(run, sample, master, s_acts, t_acts, fs_acts, ft_acts))
        s_lp.append(slp.cpu())
        t_lp.append(tlp.cpu())
        all_tokens.append(toks.cpu())
        s_exp.append(_experts(master, s_acts))
        t_exp.append(_experts(master, t_acts))

    config = {"engine": ENGINE, "model": master.name, "sampler_dtype": sampler_dtype, "trainer_dtype": trainer_dtype,
              "tokens": tokens, "prompts": len(prompts), "seed": seed, "device": dev.type,
              "torch": torch.__version__.split("+")[0], "top_k": master.top_k, "n_layers": len(master.layers)}
    _clear_previous(out_dir / run)
    logger = DriftLogger(out_dir, run, config)
    moe = s_exp[0] is not None
    logger.log_step(0, torch.stack(s_lp), torch.stack(t_lp), torch.ones(len(prompts), tokens, dtype=torch.bool),
                    token_ids=torch.stack(all_tokens),
                    sampler_experts=torch.stack(s_exp) if moe else None,
                    trainer_experts=torch.stack(t_exp) if moe else None)
    cols = {c.name: [v for table in tables for v in table[c.name]] for c in schema.PROBE}
    write_probe_file(logger.dir / PROBE_FILE, cols)
    d = (torch.stack(t_lp) - torch.stack(s_lp)).numpy().ravel()
    return {"run": logger.run, "out": str(logger.dir), "n_tokens": int(d.size), "n_rows": len(cols["run"]),
            "kl_k3": float(np.mean(np.expm1(d) - d)), "seconds": time.perf_counter() - started,
            "model": master.name, "layers": len(master.layers)}
