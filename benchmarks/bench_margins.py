"""What router margins and the per-sequence top-k sums cost DriftLogger (issue 42 items 2 and 5), on CPU.

    python benchmarks/bench_margins.py [--tokens 1000000] [--steps 3] [--repeat 3] [--no-write]

Times, alternating (harness.alternate; the best round counts), `log_step` at token_sample=0 with routing of both
sides (L layers, k experts) against the same with the router margins of both sides ([B, T, L] fp32: the
margin checks, the per-layer sums and the per-bin cells of record/margins.py); and the top-k pass
(record/fulldist.topk_sums, J = 20) with and without the per-row sums that summary_seq now carries. Appends to
benchmarks/RESULTS-margins.md.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from harness import ROOT, alternate, record

RESULTS = ROOT / "benchmarks" / "RESULTS-margins.md"
INTRO = """# Router margins and per-sequence top-k sums in DriftLogger (benchmarks/bench_margins.py)

Each entry is one run of the command shown: `log_step` on CPU with and without router margins, and the top-k pass
with and without its per-row sums, alternating; the best round of each counts (other processes share these CPUs).
"""


def make_step(n_tokens: int, layers: int, k: int, experts: int = 64, J: int = 20, seed: int = 0) -> dict:
    """fp32 log-probs (s ~ −Exp(1.5), Δ ~ N(0, 0.05)), rows of 1000 positions with padding, routing of both sides
    (20 % of the trainer's rows moved), log-uniform margins in [1e-6, 1], and top-J lists of both sides."""
    g = torch.Generator().manual_seed(seed)
    T = 1000
    B = n_tokens // T
    s = -torch.empty(B, T).exponential_(1.5, generator=g)
    t = (s + torch.randn(B, T, generator=g) * 0.05).clamp(max=0.0)
    mask = torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B,), generator=g)[:, None]
    se = torch.argsort(torch.rand(B, T, layers, experts, generator=g), -1)[..., :k].to(torch.int32)
    te = torch.where(torch.rand(B, T, layers, 1, generator=g) < 0.2, (se + 1) % experts, se.flip(-1))
    margins = {f"{side}_margins": (10.0 ** (-6.0 * torch.rand(B, T, layers, generator=g))).float()
               for side in ("sampler", "trainer")}
    ids = torch.randint(0, 150_000 // J, (B, T, 1), generator=g, dtype=torch.int32) + \
        torch.arange(J, dtype=torch.int32) * (150_000 // J)
    lp = torch.log_softmax(torch.randn(B, T, J, generator=g) * 2, -1)
    t_ids = ids.clone()
    t_ids[..., J - 3:] += 1
    topk = (ids, lp.double(), t_ids, (lp + 0.01 * torch.randn(B, T, J, generator=g)).clamp(max=0.0).double())
    return dict(base=dict(sampler_logprobs=s, trainer_logprobs=t, mask=mask, sampler_experts=se,
                          trainer_experts=te), margins=margins, topk=topk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="positions per step (B × T, before padding)")
    ap.add_argument("--steps", type=int, default=3, help="steps logged per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration; the best counts")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-margins.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from analysis.record.fulldist import topk_sums
    from analysis.record.logger import DriftLogger
    from analysis.record.summaries import _pool
    from analysis.summaries import fulldist

    data = make_step(args.tokens, args.layers, args.k)
    n = int(data["base"]["mask"].sum())
    tmp = Path(tempfile.mkdtemp())

    def log(extra: dict):
        def run():
            shutil.rmtree(tmp / "out", ignore_errors=True)
            logger = DriftLogger(tmp / "out", "bench", token_sample=0.0)
            c0 = time.process_time()
            for step in range(args.steps):
                logger.log_step(step, **data["base"], **extra)
            return time.process_time() - c0
        return run
    B = data["base"]["mask"].shape[0]
    mask = data["base"]["mask"]

    def topk(per_row: bool):
        def run():
            c0 = time.process_time()
            rows = np.zeros((B, fulldist.N_SUMS)) if per_row else None
            topk_sums(*data["topk"], mask, pool=_pool(), per_row=rows)
            return time.process_time() - c0
        return run
    log({})()  # compile the kernels once
    topk(True)()
    sides = {f"log_step, routing L={args.layers} K={args.k}": log({}),
             f"log_step, routing L={args.layers} K={args.k} + margins of both sides": log(data["margins"]),
             "top-k pass J=20, step sums only": topk(False),
             "top-k pass J=20, step and per-row sums": topk(True)}
    runs = alternate(sides, args.repeat)
    names = list(sides)
    lines = []
    for i, name in enumerate(names):
        r = runs[name]
        count = n * (args.steps if name.startswith("log_step") else 1)
        base = runs[names[i - i % 2]].best
        lines.append(f"- {name}: {r.best:.3f} s for {count:,} tokens -> {count / r.best / 1e6:.2f}M tokens/s, "
                     f"{r.best / base:.2f}x the first of its pair (CPU {min(r.outs):.3f} s)")
    shutil.rmtree(tmp, ignore_errors=True)
    record(RESULTS, "\n".join(lines), INTRO, {"torch": torch.__version__}, write=not args.no_write,
           note=f"torch threads={args.threads}; {args.steps} steps × {n:,} trained tokens, best of {args.repeat}")


if __name__ == "__main__":
    main()
