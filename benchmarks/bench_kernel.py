"""The summary kernel alone (analysis/summaries/kernel.py), on one thread: this checkout against another commit's
kernel, in one process, alternating.

    python benchmarks/bench_kernel.py [--against 60a0fdc] [--rounds 15] [--no-write]

Two inputs, each summed into fresh accumulators per call (`Accumulators.add`, numpy's exp/expm1 included):

- grid: DriftLogger's form, a [1000, 1000] step with lengths uniform in [500, 1000] (~25% padding) and one lag
  per sequence; s ~ −Exp(1.5), Δ ~ N(0, 0.05) with a 0.5% heavy tail, as bench_logger.py's step;
- long: ingest's form (an Arrow batch: sequence and position columns), 400 sequences of 250–750 tokens in
  order, a per-token lag that is constant within each sequence (as ingest passes it);
- long, flat probabilities: the same tokens with bench_scale.py's values (s uniform in [−5, 0], so no
  probability bucket holds more than ~1/4 of them; Δ uniform in ±0.01) and no lag.

The other commit's kernel.py is loaded from `git show` under another module name (harness.module_at; its
own numba cache, in a temporary folder), so both run in the same process on the same arrays; each is called once
before timing (a first call compiles or loads it). The rows of both are compared (max relative difference), and per input the
min and median of `--rounds` calls are reported, with the ratio of the mins. Results are appended to
benchmarks/RESULTS-kernel.md.
"""
from __future__ import annotations

import argparse

import numpy as np

from harness import ROOT, alternate, module_at, record

from analysis.summaries import kernel as current

RESULTS = ROOT / "benchmarks" / "RESULTS-kernel.md"
AGAINST = "60a0fdc"  # main before the vectorised terms and run reductions


def inputs(seed: int = 0) -> dict[str, tuple[int, int, dict]]:
    """name -> (sequences, lags, keyword arguments of Accumulators.add)."""
    rng = np.random.default_rng(seed)
    B, T = 1000, 1000
    lengths = rng.integers(500, 1001, B)
    valid = (np.arange(T)[None, :] < lengths[:, None]).reshape(-1)
    s = -rng.exponential(1 / 1.5, B * T)
    d = rng.normal(0, 0.05, B * T)
    d = np.where(rng.random(B * T) < 0.005, d * 20, d)
    t = np.minimum(s + d, 0.0)
    s[~valid], t[~valid] = np.nan, np.nan  # padding: never read
    grid = dict(s=s, t=t, valid=valid, T=T, seq_lag=rng.integers(0, 2, B))
    n_seq = 400
    lengths = rng.integers(250, 751, n_seq)
    seq = np.repeat(np.arange(n_seq), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    s = -rng.exponential(1 / 1.5, len(seq))
    t = np.minimum(s + rng.normal(0, 0.05, len(seq)), 0.0)
    long = dict(s=s, t=t, pos=pos, seq=seq, tok_lag=rng.integers(0, 2, n_seq)[seq])
    s = -rng.random(len(seq)) * 5  # bench_scale.py's tokens: probabilities spread evenly over e^−5 .. 1 in log
    t = np.minimum(s + (rng.random(len(seq)) - 0.5) * 0.02, 0.0)
    flat = dict(s=s, t=t, pos=pos, seq=seq)
    return {"grid": (B, 2, grid), "long": (n_seq, 2, long), "long, flat probabilities": (n_seq, 0, flat)}


def tokens(args: dict) -> int:
    return int(args["valid"].sum()) if "valid" in args else len(args["s"])


def max_rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for table, cols in a.items():
        for name, x in cols.items():
            x, y = np.asarray(x), np.asarray(b[table][name])
            if x.dtype.kind == "f" and x.size:
                same = x == y
                worst = max(worst, float(np.max(np.where(same, 0.0, np.abs(x - y) / np.maximum(np.abs(x), 1e-300)))))
            elif not np.array_equal(x, y):
                return float("inf")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=AGAINST, help="the commit whose kernel is timed beside this checkout's")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-kernel.md")
    args = ap.parse_args()
    kernels = {"this checkout": current,
               args.against: module_at(args.against, "analysis/summaries/kernel.py", f"kernel_{args.against}")}
    lines = []
    for name, (n_seq, n_lag, kw) in inputs().items():
        def run(k, n_seq=n_seq, n_lag=n_lag, kw=kw):
            return k.Accumulators.zeros(n_seq, n_lag).add(**kw)
        rows = {label: k.tables(run(k), np.arange(n_seq), 0, n_lag) for label, k in kernels.items()}  # warm
        diff = max_rel_diff(*rows.values())
        times = alternate({label: lambda k=k: run(k) for label, k in kernels.items()}, args.rounds)
        n = tokens(kw)
        for label, t in times.items():
            lines.append(f"- {name}, {label}: min {t.best * 1e3:.1f} ms, median {t.median * 1e3:.1f} ms "
                         f"for {n:,} tokens ({n / t.best / 1e6:.2f}M tokens/s)")
        lines.append(f"- {name}: {times[args.against].best / times['this checkout'].best:.2f}x the speed of "
                     f"{args.against} (ratio of the mins); rows differ by at most {diff:.1e} (relative)")
    record(RESULTS, "\n".join(lines), RESULTS_INTRO, note="One thread.", write=not args.no_write)


RESULTS_INTRO = """# The summary kernel alone (benchmarks/bench_kernel.py)

Each entry is one run of the command shown: `Accumulators.add` of analysis/summaries/kernel.py on one thread,
this checkout's kernel and another commit's in the same process, alternating, on DriftLogger's grid form and
ingest's long form. Min and median of the rounds; the ratio of the mins compares the two.
"""

if __name__ == "__main__":
    main()
