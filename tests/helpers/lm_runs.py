"""Runs for the logging-check acceptance tests, made with a small transformers model (random weights, CPU, fixed
seed): a bf16 sampler that samples through transformers' warpers and logs either its raw log-probs or the
processed ones (after temperature / top-k / top-p, what vLLM returns with --logprobs-mode processed_logprobs), and
an fp32 trainer that recomputes the tokens with one teacher-forced forward, without those steps."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import polars as pl
import torch

VOCAB, PROMPT, RESPONSE, BATCH, STEPS = 256, 4, 32, 32, 2
TARGET_ENTROPY = 1.5  # nats: the LM head is scaled so that next-token entropy is LLM-like, not ~ln(256)

# name -> (sampling parameters, logged sampler log-probs: "processed" or "raw", trainer log-probs shifted)
RUNS = {
    "control": ({}, "raw", False),
    "top-k": ({"top_k": 20}, "processed", False),
    "top-p": ({"top_p": 0.9}, "processed", False),
    "temperature": ({"temperature": 0.7}, "processed", False),
    "combination": ({"temperature": 0.7, "top_p": 0.8, "top_k": 20}, "processed", False),
    "shifted": ({}, "raw", True),
}


@dataclass
class Run:
    s: torch.Tensor  # [B, T] float64 sampler log-probs
    t: torch.Tensor  # [B, T] float64 trainer log-probs
    tokens: torch.Tensor  # [B, T]

    def frame(self, name: str) -> pl.DataFrame:
        """Long token rows, BATCH // STEPS sequences per step."""
        B, T = self.s.shape
        per = B // STEPS
        return pl.DataFrame({"run": [name] * (B * T), "step": np.repeat(np.arange(B) // per, T),
                             "sample": np.repeat(np.arange(B), T), "pos": np.tile(np.arange(T), B),
                             "token_id": self.tokens.reshape(-1).numpy(),
                             "sampler_logprob": self.s.reshape(-1).numpy(),
                             "trainer_logprob": self.t.reshape(-1).numpy()})


def model(seed: int = 0):
    """A 2-layer Llama, its LM head scaled to TARGET_ENTROPY (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    m = LlamaForCausalLM(cfg).eval()
    probe = torch.randint(1, VOCAB, (16, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        base = m(probe).logits.float()
        lo, hi = 1.0, 200.0  # entropy falls as the head's scale grows: bisect on it
        for _ in range(30):
            mid = (lo * hi) ** 0.5
            lp = torch.log_softmax(base * mid, -1)
            h = float(-(lp.exp() * lp).sum(-1).mean())
            lo, hi = (mid, hi) if h > TARGET_ENTROPY else (lo, mid)
        m.lm_head.weight.mul_(lo)
    return m


def warpers(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """transformers' own sampling steps, in the order `generate` applies them."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    steps = LogitsProcessorList()
    if temperature != 1.0:
        steps.append(TemperatureLogitsWarper(temperature))
    if top_k:
        steps.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        steps.append(TopPLogitsWarper(top_p))
    return steps


def make_runs(seed: int = 0) -> dict[str, Run]:
    """Every run's sequences decoded at once (one batch of len(RUNS) · BATCH rows, each run's rows sampled from its
    own processed distribution by transformers' warpers, as `generate` does, with a KV cache): a generate call per
    run cost ~7 s of CPU here."""
    trainer = model(seed)
    sampler = copy.deepcopy(trainer).to(torch.bfloat16)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = torch.randint(1, VOCAB, (BATCH, PROMPT), generator=g)
    decoded = [name for name, (_, _, shift) in RUNS.items() if not shift]  # the shifted run reuses the control's
    procs = [warpers(**RUNS[name][0]) for name in decoded]
    seqs = prompts.repeat(len(decoded), 1)  # [R·B, P]
    raw, done, cache, step_in = [], [], None, seqs
    with torch.no_grad():
        for _ in range(RESPONSE):
            out = sampler(step_in, cache=cache, use_cache=True)
            cache = out.cache
            logits = out.logits[:, -1].float()  # [R·B, V]
            scores = torch.cat([p(seqs[i * BATCH:(i + 1) * BATCH], logits[i * BATCH:(i + 1) * BATCH])
                                for i, p in enumerate(procs)])
            nxt = torch.multinomial(torch.softmax(scores, -1), 1, generator=g)  # [R·B, 1]
            raw.append(logits.double())
            done.append(scores.double())
            seqs = torch.cat([seqs, nxt], 1)
            step_in = nxt
        tokens = seqs[:, PROMPT:]
        logits = trainer(seqs).logits.double()[:, PROMPT - 1:-1]  # position i scores token i + 1
        t_all = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]

    def logged(steps: list[torch.Tensor]) -> torch.Tensor:
        lp = torch.log_softmax(torch.stack(steps, 1), -1)  # [R·B, T, V]
        return lp.gather(-1, tokens[..., None])[..., 0]
    s_raw, s_processed = logged(raw), logged(done)
    out = {}
    for name, (_, mode, shift) in RUNS.items():
        i = decoded.index("control" if shift else name)
        rows = slice(i * BATCH, (i + 1) * BATCH)
        s, t, tok = (s_processed if mode == "processed" else s_raw)[rows], t_all[rows], tokens[rows]
        if shift:  # an off-by-one: the trainer's log-prob of token i + 1 logged at position i
            s, t, tok = s[:, :-1], t[:, 1:], tok[:, :-1]
        out[name] = Run(s.contiguous(), t.contiguous(), tok.contiguous())
    return out
