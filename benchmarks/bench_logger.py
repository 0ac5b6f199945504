"""Benchmark DriftLogger.log_step on CPU: summaries alone and with token samples, against writing every token row.

    python benchmarks/bench_logger.py [--tokens 4000000] [--steps 5] [--repeat 3] [--threads 2] [--no-write]

One synthetic step of B × T fp32 log-probs (B = tokens / 1000 sequences of 1000 positions, lengths uniform in
[500, 1000], so ~25% padding) is logged repeatedly; the best of `repeat` rounds counts (each round logs `steps`
steps), because other processes share these CPUs. Each configuration is timed alternately with the baseline in
the same run:

- baseline: the logger of main before trainer-side summaries (b7f1e2a), which writes every token row;
- token_sample = 0 (summaries only), 0.001, 0.01 and 1.0.

- token_sample = 0 with the torch engine on the CPU (the summaries before the numba kernel).

Then the summary writer alone (`logger_summaries.summarise` on the same checked step, no files): the torch
engine and the numba kernel (analysis/summaries/kernel.py), alternating, so the two are compared side by side.
The kernel splits the rows among torch.get_num_threads() threads (--threads).

Reported: tokens/s (trained tokens logged per second of log_step, files included) and the ratio to the baseline.
Results are appended to benchmarks/RESULTS-logger.md.
"""
from __future__ import annotations

import argparse
import functools
import shutil
import tempfile
import time
from pathlib import Path

import torch

from harness import ROOT, alternate, module_at, record

from analysis.record.logger import DriftLogger

RESULTS = ROOT / "benchmarks" / "RESULTS-logger.md"
BASELINE_COMMIT = "b7f1e2a"  # main before this change: DriftLogger writes all token rows, no summaries
ENGINES = ("torch", "kernel")
SAMPLES = (0.0, 0.001, 0.01, 1.0)


def baseline_logger():
    """DriftLogger as it was at BASELINE_COMMIT."""
    return module_at(BASELINE_COMMIT, "analysis/logger.py", "baseline_logger").DriftLogger  # its path then


def time_summarise(repeat: int, steps: int, data: dict) -> dict[str, tuple[float, float]]:
    """Best (wall, CPU) seconds of `steps` calls of each summary engine on one checked step, alternating:
    the torch ops (the path of non-CPU devices) and the one-pass numba kernel (the CPU path)."""
    from analysis.record import summaries as logger_summaries
    from analysis.record.token_sample import Kept
    logger = DriftLogger(tempfile.mkdtemp(), "bench", token_sample=0.0)
    x = logger._checked(0, **{"sampler_experts": None, "trainer_experts": None, "sample_ids": None} | data)
    kept = Kept(int(x.mask.sum()), 0, 0, 0, 0)
    work = logger_summaries.Workspace()
    writers = {engine: lambda engine=engine: logger_summaries.summarise(x, kept, logger.plan, work, engine=engine)
               for engine in ENGINES}
    for run in writers.values():  # warm: the kernel's first call loads (or compiles) it
        run()

    def rounds(run) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            run()
        return time.perf_counter() - t0, time.process_time() - c0
    runs = alternate({name: lambda run=run: rounds(run) for name, run in writers.items()}, repeat)
    return {name: min(r.outs) for name, r in runs.items()}


def torch_engine_logger(out: Path, rate: float) -> DriftLogger:
    """A DriftLogger whose summaries take the torch ops on the CPU (the path before the kernel)."""
    from analysis.record import logger as logger_module
    logger = DriftLogger(out, "bench", token_sample=rate)
    summarise = logger_module.summarise

    def log_step(*args, **kwargs):
        logger_module.summarise = functools.partial(summarise, engine="torch")
        try:
            return DriftLogger.log_step(logger, *args, **kwargs)
        finally:
            logger_module.summarise = summarise
    logger.log_step = log_step
    return logger


def make_step(n_tokens: int, seed: int = 0) -> dict:
    """fp32 log-probs as a trainer holds them: s ~ −Exp(1.5), Δ ~ N(0, 0.05) with a 0.5% heavy tail."""
    g = torch.Generator().manual_seed(seed)
    T = 1000
    B = n_tokens // T
    s = -torch.empty(B, T).exponential_(1.5, generator=g)
    d = torch.randn(B, T, generator=g) * 0.05
    d = torch.where(torch.rand(B, T, generator=g) < 0.005, d * 20, d)
    t = (s + d).clamp(max=0.0)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return dict(sampler_logprobs=s, trainer_logprobs=t, mask=mask,
                token_ids=torch.randint(0, 150_000, (B, T), generator=g),
                sampler_version=torch.full((B,), 6), trainer_version=7)


def time_round(make_logger, step_data: dict, steps: int, out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of logging `steps` steps."""
    shutil.rmtree(out, ignore_errors=True)
    logger = make_logger(out)
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(steps):
        logger.log_step(step, **step_data)
    return time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4_000_000, help="positions per step (B × T, before padding)")
    ap.add_argument("--steps", type=int, default=5, help="steps logged per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration; the best counts")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-logger.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = make_step(args.tokens)
    n = int(data["mask"].sum()) * args.steps
    Baseline = baseline_logger()
    configs = {"baseline (every token row, no summaries)": lambda out: Baseline(out, "bench")}
    configs["token_sample=0, torch engine (the CPU path before the kernel)"] = lambda out: torch_engine_logger(out, 0.0)
    for rate in SAMPLES:
        configs[f"token_sample={rate:g}"] = lambda out, rate=rate: DriftLogger(out, "bench", token_sample=rate)
    t0 = time.perf_counter()
    DriftLogger(tempfile.mkdtemp(), "warm", token_sample=0.0).log_step(0, **make_step(2000))  # loads the kernel
    first_call = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        runs = alternate({name: lambda make=make: time_round(make, data, args.steps, Path(tmp) / "out")
                          for name, make in configs.items()}, args.repeat)  # a busy moment hits every one alike
        best = {name: min(r.outs) for name, r in runs.items()}
        sizes = {}
        for name, make in configs.items():
            out = Path(tmp) / "size"
            time_round(make, data, 1, out)
            sizes[name] = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    base = best[next(iter(configs))][0]
    lines = []
    for name, (secs, cpu) in best.items():
        lines.append(f"- {name}: {secs:.3f} s for {n:,} tokens -> {n / secs / 1e6:.2f}M tokens/s "
                     f"({n / cpu / 1e6:.2f}M tokens per CPU-second), {base / secs:.2f}x the baseline's rate; "
                     f"files {sizes[name] / 1e6:.2f} MB per step")
    alone = time_summarise(args.repeat, args.steps, data)
    first = alone["torch"]
    lines.append("\nThe summary writer alone (summarise, no files), alternating:\n")
    for name, (secs, cpu) in alone.items():
        lines.append(f"- engine={name}: {secs:.3f} s -> {n / secs / 1e6:.2f}M tokens/s ({n / cpu / 1e6:.2f}M tokens "
                     f"per CPU-second), {first[0] / secs:.2f}x the torch engine's rate (CPU: {first[1] / cpu:.2f}x)")
    lines.append(f"\nFirst kernel use in this process (import + load from numba's cache, or compile): "
                 f"{first_call:.1f} s")
    record(RESULTS, "\n".join(lines), RESULTS_INTRO, {"torch": torch.__version__}, write=not args.no_write,
           note=f"torch threads={args.threads}; data: {args.steps} steps × {n // args.steps:,} trained tokens "
                f"(fp32 log-probs, no routing), best of {args.repeat} rounds, alternating")


RESULTS_INTRO = """# DriftLogger benchmarks (benchmarks/bench_logger.py, benchmarks/sim_1b.py)

Each entry is one run of the command shown. `bench_logger` times `DriftLogger.log_step` on CPU per configuration,
alternating with the baseline (the logger before trainer-side summaries, which writes every token row); the best
round of each counts, because other processes share these CPUs. tokens/s counts trained (mask = 1) tokens; tokens
per CPU-second divides by the CPU time of the benchmark process (both torch threads together), which a busy
machine inflates less than wall time.
"""

if __name__ == "__main__":
    main()
