"""Which tokens of a logged step DriftLogger also writes as token rows when `token_sample < 1`.

Summaries always cover every token; token rows feed only the drill-down views (Sequences, Extreme tokens, top
token ids, the 2-D density). A sample for those views keeps

- a uniform share: each trained token independently with probability `rate` (a seeded draw),
- every token of the `worst_sequences` sequences with the largest |Σ Δ| (what the Sequences page opens first),
- the `top_tokens` tokens with the largest |Δ| of the step (what Extreme tokens lists first),

and counts each part, so a page can say what its rows are a sample of. Everything runs on the device the tensors
are on (torch; on the CPU the per-sequence sums and the top |Δ| come from one numba pass, `_cpu_parts`); only the
kept positions leave it. The draw is a function of (seed, run, step) only, so logging the same step twice keeps the
same tokens.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

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


def select(delta: torch.Tensor | None, mask: torch.Tensor, plan: SamplePlan,
           generator: torch.Generator, engine: str = "auto") -> tuple[torch.Tensor, Kept]:
    """keep [B, T] bool (a subset of `mask`) and its counts, for Δ [B, T] (any value where mask is False; not
    read, and may be None, when plan.rate is 0 or 1).
    engine: "auto" takes the numba pass on the CPU and torch ops elsewhere; "torch" forces the torch ops (for
    tests: both keep the same tokens)."""
    if engine not in ("auto", "torch"):
        raise ValueError(f"engine: expected 'auto' or 'torch', got {engine!r}")
    n_tokens = int(mask.sum())
    if plan.rate >= 1.0:
        return mask, Kept(n_tokens, n_tokens, n_tokens, 0, 0)
    if plan.rate <= 0.0:
        return torch.zeros_like(mask), Kept(n_tokens, 0, 0, 0, 0)
    B, T = mask.shape
    draw = torch.rand(B, T, generator=generator, device=mask.device)
    n_top = min(plan.top_tokens, n_tokens)
    if delta.device.type == "cpu" and engine == "auto":
        # the rate as float32, as torch compares a float32 tensor with a Python float: the same draw as below
        uniform, n_uniform, seq_abs, lengths, top_index = _cpu_parts(
            delta.detach().to(torch.float64).contiguous().numpy(), mask.contiguous().numpy(), n_top,
            draw.numpy(), np.float32(plan.rate))
        uniform, seq_abs, lengths, top_index = map(torch.from_numpy, (uniform, seq_abs, lengths, top_index))
    else:
        uniform = (draw < plan.rate) & mask
        n_uniform = int(uniform.sum())
        zero = torch.zeros((), dtype=delta.dtype, device=delta.device)
        seq_abs = torch.where(mask, delta, zero).sum(1).abs()
        lengths = mask.sum(1)
        ranked = torch.where(mask, delta.abs(), torch.full((), -1.0, dtype=delta.dtype, device=delta.device))
        top_index = ranked.reshape(-1).topk(n_top).indices if n_top else None

    keep = uniform  # then the worst sequences' and the top tokens' positions, each counted on its own
    n_worst = 0
    n_seq = min(plan.worst_sequences, int((lengths > 0).sum()))
    if n_seq:
        seq_abs = torch.where(lengths > 0, seq_abs, torch.full_like(seq_abs, -1.0))  # empty rows never chosen
        rows = seq_abs.topk(n_seq).indices.to(mask.device)
        keep[rows] |= mask[rows]
        n_worst = int(lengths[rows.to(lengths.device)].sum())
    if n_top:
        keep.view(-1)[top_index.to(mask.device)] = True  # trained tokens, distinct
    return keep, Kept(n_tokens, int(keep.sum()), n_uniform, n_worst, n_top)


@njit(cache=True, nogil=True)
def _cpu_parts(delta, mask, k, draw, rate):
    """One pass over a CPU step for `select`: the uniform part (trained tokens whose draw is below `rate`) and
    its count, |Σ Δ| and the trained tokens of each sequence (row), and the flat indices of the k trained tokens
    of largest |Δ| (a min-heap of k: most tokens cost one compare against its root; ties keep the earlier
    token). torch's where / sum / topk over the same [B, T] took ~40 ms a step of 1M positions (fresh blocks
    and a full top-k), this ~3 ms (benchmarks/RESULTS-logger.md)."""
    B, T = delta.shape
    uniform = np.zeros((B, T), np.bool_)
    n_uniform = 0
    seq_abs = np.zeros(B)
    lengths = np.zeros(B, np.int64)
    heap_v = np.empty(k)
    heap_i = np.empty(k, np.int64)
    n = 0
    for b in range(B):
        total = 0.0
        count = 0
        for p in range(T):
            if not mask[b, p]:
                continue
            if draw[b, p] < rate:
                uniform[b, p] = True
                n_uniform += 1
            d = delta[b, p]
            total += d
            count += 1
            if k == 0:
                continue
            v = abs(d)
            if n < k:  # fill the heap: sift the new leaf up
                j = n
                n += 1
                while j > 0:
                    parent = (j - 1) // 2
                    if heap_v[parent] <= v:
                        break
                    heap_v[j], heap_i[j] = heap_v[parent], heap_i[parent]
                    j = parent
                heap_v[j], heap_i[j] = v, b * T + p
            elif v > heap_v[0]:  # replace the smallest: sift the root down
                j = 0
                while True:
                    c = 2 * j + 1
                    if c >= k:
                        break
                    if c + 1 < k and heap_v[c + 1] < heap_v[c]:
                        c += 1
                    if heap_v[c] >= v:
                        break
                    heap_v[j], heap_i[j] = heap_v[c], heap_i[c]
                    j = c
                heap_v[j], heap_i[j] = v, b * T + p
        seq_abs[b] = abs(total)
        lengths[b] = count
    return uniform, n_uniform, seq_abs, lengths, heap_i[:n].copy()


__all__ = ["SamplePlan", "Kept", "select", "step_generator", "WORST_SEQUENCES", "TOP_TOKENS"]
