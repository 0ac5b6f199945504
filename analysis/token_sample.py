"""Which tokens of a logged step DriftLogger also writes as token rows when `token_sample < 1`.

Summaries always cover every token; token rows feed only the drill-down views (Sequences, Extreme tokens, top
token ids, the 2-D density). A sample for those views keeps

- a uniform share: each trained token independently with probability `rate` (a seeded draw),
- every token of the `worst_sequences` sequences with the largest |Σ Δ| (what the Sequences page opens first),
- the `top_tokens` tokens with the largest |Δ| of the step (what Extreme tokens lists first),

and counts each part, so a page can say what its rows are a sample of. Everything runs in torch on the device the
tensors are on; only the kept positions leave it. The draw is a function of (seed, run, step) only, so logging the
same step twice keeps the same tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Default whole sequences kept per step, by |Σ Δ|. One: a run of N steps then keeps N worst sequences whole,
# more than anyone opens, while a long response is thousands of tokens: with 4 per step, 4,096-token sequences
# made a 1B-token run's token rows ~180 MB next to ~112 MB of summaries (benchmarks/sim_1b.py), against 57 MB.
WORST_SEQUENCES = 1
TOP_TOKENS = 256  # default: single tokens kept per step, by |Δ|


@dataclass(frozen=True)
class SamplePlan:
    """How many token rows to keep. rate 1 keeps every token; rate 0 keeps none (summaries only)."""
    rate: float = 1.0
    worst_sequences: int = WORST_SEQUENCES
    top_tokens: int = TOP_TOKENS
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"token_sample: expected a share of tokens in [0, 1], got {self.rate!r}")
        for name in ("worst_sequences", "top_tokens", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True)
class Kept:
    """What one step's sample holds; parts overlap, so `n_kept` ≤ the sum of the three parts."""
    n_tokens: int  # trained tokens of the step (what the summaries cover)
    n_kept: int  # tokens written as token rows
    n_uniform: int  # of which drawn uniformly at `rate`
    n_worst_sequence_tokens: int  # of which in the worst sequences
    n_top_tokens: int  # of which among the top |Δ|


def step_generator(seed: int, run: str, step: int, device: torch.device) -> torch.Generator:
    """A generator seeded by (seed, run, step) alone: a stable hash, not Python's salted hash()."""
    key = hashlib.sha256(f"{seed}\0{run}\0{step}".encode()).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return g


def select(delta: torch.Tensor, mask: torch.Tensor, plan: SamplePlan,
           generator: torch.Generator) -> tuple[torch.Tensor, Kept]:
    """keep [B, T] bool (a subset of `mask`) and its counts, for Δ [B, T] (any value where mask is False)."""
    n_tokens = int(mask.sum())
    if plan.rate >= 1.0:
        return mask, Kept(n_tokens, n_tokens, n_tokens, 0, 0)
    if plan.rate <= 0.0:
        return torch.zeros_like(mask), Kept(n_tokens, 0, 0, 0, 0)
    B, T = mask.shape
    uniform = (torch.rand(B, T, generator=generator, device=mask.device) < plan.rate) & mask
    abs_delta = torch.where(mask, delta.abs(), torch.zeros((), dtype=delta.dtype, device=delta.device))

    worst = torch.zeros_like(mask)
    lengths = mask.sum(1)
    n_seq = min(plan.worst_sequences, int((lengths > 0).sum()))
    if n_seq:
        seq_abs = torch.where(mask, delta, torch.zeros((), dtype=delta.dtype, device=delta.device)).sum(1).abs()
        seq_abs = torch.where(lengths > 0, seq_abs, torch.full_like(seq_abs, -1.0))  # empty rows never chosen
        worst[seq_abs.topk(n_seq).indices] = True
        worst &= mask

    top = torch.zeros_like(mask)
    n_top = min(plan.top_tokens, n_tokens)
    if n_top:
        ranked = torch.where(mask, abs_delta, torch.full_like(abs_delta, -1.0)).reshape(-1)
        top.view(-1)[ranked.topk(n_top).indices] = True

    keep = uniform | worst | top
    return keep, Kept(n_tokens, int(keep.sum()), int(uniform.sum()), int(worst.sum()), int(top.sum()))


__all__ = ["SamplePlan", "Kept", "select", "step_generator", "WORST_SEQUENCES", "TOP_TOKENS"]
