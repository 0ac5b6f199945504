"""What bounds DriftLogger's summaries on CPU: the same per-token terms and per-sequence reductions, eager
(analysis/record/summaries.py, one memory pass per torch op) against one fused kernel (torch.compile, inductor's
C++ backend, which needs a C++ compiler at run time).

    python benchmarks/bench_logger_fused.py [--rows 262] [--threads 1] [--no-write]

Times, on one chunk of rows × 1000 positions (no padding) drawn as bench_logger draws them: the module's
`token_terms` plus the row reductions `summarise` takes of them (sums and maxima per sequence), against a
compiled function computing the same 23 sums and 7 extremes per row. Reports CPU time per chunk (best of 7), the
compile time, and the largest relative differences between the two sets of row sums and maxima. Not wired into the logger:
the compile takes minutes on this machine and needs a compiler on the trainer's host.
Results are appended to benchmarks/RESULTS-logger.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_logger import record  # noqa: E402  (benchmarks/ is the script's folder)

from analysis.record import summaries as L  # noqa: E402
from analysis.summaries import schema as S  # noqa: E402


def fused(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of logger_summaries.WIDE[1:] (same order) and row maxima of EXTREMES, written for a compiler."""
    d = t - s
    cd = d.clamp(-S.CLAMP, S.CLAMP)
    rm1, em = torch.expm1(cd), torch.expm1(-cd)
    d2, ad = d * d, d.abs()
    even = d2 * (0.5 + d2 * (1 / 24 + d2 * (1 / 720 + d2 / 40320)))
    odd = d * d2 * (1 / 6 + d2 * (1 / 120 + d2 / 5040))
    small = ad < S.SERIES_BELOW
    k3 = torch.where(small, even + odd, (rm1 - d).clamp(min=0))
    k3r = torch.where(small, even - odd, (em + d).clamp(min=0))
    ps, pt = torch.exp(s), torch.exp(t)
    dp = torch.where(d == cd, ps * rm1, pt - ps)
    qs = -torch.expm1(s)
    qt = qs - dp
    terms = {"sum_rm1": rm1, "sum_rm1_sq": rm1 * rm1, "sum_d": d, "sum_d2": d2, "sum_abs_d": ad, "sum_k3": k3,
             "sum_k3r": k3r, "sum_mpe": torch.maximum(rm1, em), "sum_adp": dp.abs(), "sum_qs": qs, "sum_qt": qt,
             "sum_qs2": qs * qs, "sum_qt2": qt * qt, "sum_qsqt": qs * qt, "sum_ps": ps, "sum_pt": pt,
             "sum_ps2": ps * ps, "sum_pt2": pt * pt, "sum_pspt": ps * pt}
    sums = torch.stack([terms[c].sum(-1) for c in L.WIDE[1:]])
    tops = torch.stack([d.amax(-1), (-d).amax(-1), dp.abs().amax(-1), s.amax(-1), (-s).amax(-1), t.amax(-1),
                        (-t).amax(-1)])
    return sums, tops


def eager(s: torch.Tensor, t: torch.Tensor, work: L.Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    terms = L.token_terms(s, t, None, work)
    return terms.V[1:].sum(-1), terms.X.amax(-1)


def best_cpu(fn, repeat: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=262, help="sequences of 1000 positions in the chunk")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    s = -torch.empty(args.rows, 1000, dtype=torch.float64).exponential_(1.5, generator=g)
    d = torch.randn(args.rows, 1000, generator=g, dtype=torch.float64) * 0.05
    t = (s + torch.where(torch.rand(s.shape, generator=g) < 0.005, d * 20, d)).clamp(max=0.0)
    work = L.Workspace()
    t0 = time.perf_counter()
    compiled = torch.compile(fused, dynamic=False)
    got = compiled(s, t)
    compile_s = time.perf_counter() - t0
    want = eager(s, t, work)
    rel, rel_top = (float(((a - b).abs() / b.abs().clamp(min=1e-300)).max()) for a, b in zip(got, want))
    n = s.numel()
    e, c = best_cpu(lambda: eager(s, t, work)), best_cpu(lambda: compiled(s, t))
    text = (f"## {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%S')}Z — eager against fused\n\n"
            f"Command: `python benchmarks/bench_logger_fused.py --rows {args.rows} --threads {args.threads}`\n\n"
            f"- per-token terms + per-sequence sums and maxima of {n:,} positions: eager (token_terms) "
            f"{e * 1e3:.1f} ms CPU ({n / e / 1e6:.1f}M positions per CPU-second), torch.compile {c * 1e3:.1f} ms "
            f"({n / c / 1e6:.1f}M per CPU-second), {e / c:.1f}x; compile {compile_s:.0f} s; row sums max rel diff "
            f"{rel:.1e}, extremes {rel_top:.1e} (expm1 and exp of the two differ in the last bit)\n")
    record(text, write=not args.no_write)


if __name__ == "__main__":
    main()
