"""Benchmark DriftLogger.log_step on CPU: summaries alone and with token samples, against writing every token row.

    python benchmarks/bench_logger.py [--tokens 4000000] [--steps 5] [--repeat 3] [--threads 2] [--no-write]
    python benchmarks/bench_logger.py --fulldist [--tokens 2000000] [--layers 2] [--k 8] ...
    python benchmarks/bench_logger.py --fulldist --code OTHER_CHECKOUT [--tokens 1000000] [--repeat 2]
    python benchmarks/bench_logger.py --fulldist --passes COMMIT [--tokens 1000000] [--repeat 5]

--fulldist times instead the METRICS.md v3 inputs (`fulldist_main`): log_step with top-k log-probs (J = 20, and 8)
and router weights beside the same steps without them, and measures the bytes per token each adds to a DuckDB
database (a seeded run logged with token_sample = 1 and ingested). With --code (another checkout, e.g. a
`git archive main` copy), instead the full configuration (top-k J = 20, routing of both sides with weights) and
the step without them, each side's logger in a child process of its own (`fulldist_child`; the same seeded step,
built by this script), the sides alternating: wall and CPU seconds (all threads of the child) of the logging alone.
With --passes, the CPU passes alone (`fulldist_passes`): summaries/fulldist.py at COMMIT against this checkout's,
in this process, alternating, their sums required equal to the bit.

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
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import ROOT, alternate, module_at, record, timed

if "--child-code" in sys.argv:  # fulldist_child: the logger of another checkout
    sys.path.insert(0, sys.argv[sys.argv.index("--child-code") + 1])
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
    ap.add_argument("--fulldist", action="store_true", help="time top-k log-probs and router weights instead")
    ap.add_argument("--layers", type=int, default=2, help="--fulldist: MoE layers of the routing")
    ap.add_argument("--k", type=int, default=8, help="--fulldist: experts per token and layer")
    ap.add_argument("--db-tokens", type=int, default=200_000, help="--fulldist: positions per step of the bytes run")
    ap.add_argument("--code", type=Path, help="--fulldist: another checkout, timed side by side (see above)")
    ap.add_argument("--passes", help="--fulldist: a commit whose top-k and routing passes to time beside these")
    ap.add_argument("--child-code", type=Path, help=argparse.SUPPRESS)  # fulldist_child, run by fulldist_compare
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_code:
        return fulldist_child(args)
    if args.fulldist and args.code:
        return fulldist_compare(args)
    if args.fulldist and args.passes:
        return fulldist_passes(args)
    if args.fulldist:
        return fulldist_main(args)
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


J_SIZES = (8, 20)


def fulldist_inputs(data: dict, J: int, layers: int, k: int, experts: int = 64, seed: int = 1) -> dict[str, dict]:
    """The extra log_step arguments of the --fulldist configurations for `data`'s [B, T] step: top-J lists (fp32
    log-probs of a softmax, distinct ids; the trainer keeps the sampler's first J − 3 ids with perturbed log-probs)
    and routing of both sides ([B, T, layers, k] ids, fp32 weights; the trainer's sets equal, ranks reversed)."""
    g = torch.Generator().manual_seed(seed)
    B, T = data["mask"].shape
    ids = torch.randint(0, 150_000 // J, (B, T, 1), generator=g, dtype=torch.int32) + \
        torch.arange(J, dtype=torch.int32) * (150_000 // J)
    lp = torch.log_softmax(torch.randn(B, T, J, generator=g) * 2, -1)
    t_ids = ids.clone()
    t_ids[..., J - 3:] += 1
    t_lp = (lp + 0.01 * torch.randn(B, T, J, generator=g)).clamp(max=0.0)
    topk = dict(sampler_topk_ids=ids, sampler_topk_logprobs=lp, trainer_topk_ids=t_ids, trainer_topk_logprobs=t_lp)
    se = torch.argsort(torch.rand(B, T, layers, experts, generator=g), -1)[..., :k].to(torch.int32)
    sw = torch.softmax(torch.randn(B, T, layers, k, generator=g), -1)
    tw = (sw + 1e-3 * torch.rand(B, T, layers, k, generator=g)).flip(-1)
    routing = dict(sampler_experts=se, trainer_experts=se.flip(-1))
    return {"topk": topk, "routing": routing, "weights": routing | dict(sampler_weights=sw, trainer_weights=tw)}


def db_bytes(step_data: dict, steps: int) -> tuple[int, int]:
    """(bytes of the database's used blocks, trained tokens) of `steps` seeded steps logged with token_sample=1 and
    ingested: used blocks (PRAGMA database_size) rather than the file's size, which keeps the blocks a load's
    transaction freed."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store
    with tempfile.TemporaryDirectory() as tmp:
        log = DriftLogger(Path(tmp) / "logs", "bench", token_sample=1.0)
        for step in range(steps):
            log.log_step(step, **step_data)
        store = Store(Path(tmp) / "db.duckdb")
        outcomes = ingest_paths(store, [Path(tmp) / "logs"])
        assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
        store.close()
        import duckdb
        con = duckdb.connect(str(Path(tmp) / "db.duckdb"))
        con.execute("CHECKPOINT")
        block, used = con.execute("SELECT block_size, used_blocks FROM pragma_database_size()").fetchone()
        con.close()
        return block * used, int(step_data["mask"].sum()) * steps


def fulldist_configs(args, data: dict) -> tuple[dict[str, dict], dict[str, float]]:
    """--code's configurations: (name -> extra log_step arguments, name -> token_sample)."""
    full = fulldist_inputs(data, 20, args.layers, args.k)
    every = full["topk"] | full["weights"]
    configs = {"token_sample=0, no top-k or routing": {},
               f"token_sample=0, top-k J=20 + routing L={args.layers} K={args.k} + weights": every,
               f"token_sample=0.001, top-k J=20 + routing L={args.layers} K={args.k} + weights": every}
    return configs, {name: 0.001 if "0.001" in name else 0.0 for name in configs}


def fulldist_child(args) -> None:
    """One side of --code: every configuration timed once (after a warm step), printed as JSON."""
    data = make_step(args.tokens)
    configs, rate = fulldist_configs(args, data)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in configs.items():
            time_round(lambda o: DriftLogger(o, "bench", token_sample=rate[name]), data | extra, 1, Path(tmp) / "o")
            out[name] = time_round(lambda o: DriftLogger(o, "bench", token_sample=rate[name]), data | extra,
                                   args.steps, Path(tmp) / "o")
    print(json.dumps({"trained": int(data["mask"].sum()) * args.steps, "runs": out}))


def fulldist_compare(args) -> None:
    """--fulldist --code: this checkout's logger against another's, each round one child per side, alternating."""
    sides = {"this checkout": ROOT, f"--code {args.code}": args.code.resolve()}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--tokens", str(args.tokens), "--steps", str(args.steps),
           "--threads", str(args.threads), "--layers", str(args.layers), "--k", str(args.k)]
    best: dict[str, dict[str, tuple[float, float]]] = {side: {} for side in sides}
    trained = 0
    for r in range(args.repeat):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            child = timed(cmd + ["--child-code", str(sides[side])], cwd=sides[side],
                          env={"PYTHONPATH": str(sides[side])})
            res = json.loads(child["stdout"].strip().splitlines()[-1])
            trained = res["trained"]
            for name, (wall, cpu) in res["runs"].items():
                old = best[side].get(name)
                best[side][name] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
    this, other = sides
    lines = []
    for name in best[this]:
        lines.append(f"- {name}:")
        for side in sides:
            wall, cpu = best[side][name]
            lines.append(f"  - {side}: {trained / wall / 1e6:.2f}M tokens/s wall, {trained / cpu / 1e6:.2f}M tokens "
                         f"per CPU-second ({cpu / trained * 1e9:.0f} ns of CPU a token)")
        ratio = best[other][name][1] / best[this][name][1]
        lines.append(f"  - this checkout takes {1 / ratio:.2f}x the other's CPU a token")
    record(RESULTS, "\n".join(lines), RESULTS_INTRO, {"torch": torch.__version__}, write=not args.no_write,
           note=f"--fulldist --code: torch threads={args.threads}; data: {args.steps} steps × {trained // args.steps:,} "
                f"trained tokens (fp32 log-probs), best of {args.repeat} rounds per side (a child process per side and "
                f"round, alternating; numba's cache warm on both sides)")


def fulldist_passes(args) -> None:
    """--fulldist --passes COMMIT: the top-k pass (with torch's exponentials of each chunk, as
    record/fulldist.topk_sums runs it) and the routing pass (with weights, and ids only) over one seeded step, of
    summaries/fulldist.py at COMMIT and of this checkout, alternating in this process: CPU seconds of one call,
    the best of --repeat, per trained token. The two sides' outputs must be equal to the bit."""
    import numpy as np
    from analysis.record.fulldist import CPU_CHUNK
    from analysis.summaries import fulldist as mine
    sides = {args.passes: module_at(args.passes, "analysis/summaries/fulldist.py", "fulldist_then"),
             "this checkout": mine}
    data = make_step(args.tokens)
    extra = fulldist_inputs(data, 20, args.layers, args.k)
    mask = data["mask"].reshape(-1)
    N, n = mask.numel(), int(mask.sum())
    keys = ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids", "trainer_topk_logprobs")
    topk = [extra["topk"][k].reshape(N, -1) for k in keys]
    groups = mask.to(torch.int64).sub_(1).numpy()
    ps, pt = (torch.empty(CPU_CHUNK, topk[0].shape[1], dtype=torch.float64) for _ in range(2))
    routing = [extra["weights"][k].reshape(N, args.layers, args.k).numpy()
               for k in ("sampler_experts", "trainer_experts", "sampler_weights", "trainer_weights")]

    def topk_pass(module) -> np.ndarray:
        out = np.zeros((1, module.N_SUMS))
        for lo in range(0, N, CPU_CHUNK):
            hi = min(N, lo + CPU_CHUNK)
            a_id, a, b_id, b = (v[lo:hi] for v in topk)
            if hasattr(module, "trained_floats"):  # exponentials of the trained rows only, one after another
                k = module.trained_floats(a.numpy(), b.numpy(), groups[lo:hi], ps.numpy(), pt.numpy())
                e_s, e_t = ps[:k].exp_(), pt[:k].exp_()
            else:  # before it (commits up to 06a9f79): every row's, in place
                e_s, e_t = ps[:hi - lo].copy_(a).exp_(), pt[:hi - lo].copy_(b).exp_()
            assert module.group_sums(a_id.numpy(), a.numpy(), b_id.numpy(), b.numpy(), e_s.numpy(), e_t.numpy(),
                                     groups[lo:hi], out) < 0
        return out

    def routing_pass(module, weights: bool) -> list:
        cap, L = 1024, args.layers
        state = [np.zeros(L * cap, np.int64), np.zeros(L * cap, np.int64), np.zeros((5, L), np.int64),
                 np.zeros(L), np.full(L, -np.inf), np.zeros(N, np.int64)]
        assert module.routing_pass(*routing, mask.numpy(), 0, N, True, weights, *state) == (0, 0)
        return state

    passes = {"top-k pass J=20 (torch's exponentials of each chunk included)": topk_pass,
              f"routing pass L={args.layers} K={args.k} + weights": lambda m: routing_pass(m, True),
              f"routing pass L={args.layers} K={args.k} (ids)": lambda m: routing_pass(m, False)}
    lines = []
    for name, run in passes.items():
        outs = {side: run(module) for side, module in sides.items()}  # also loads (or compiles) the kernels
        first, other = outs.values()
        assert all(np.array_equal(x, y) for x, y in zip(first if isinstance(first, list) else [first],
                                                         other if isinstance(other, list) else [other])), name

        def cpu(module, run=run) -> float:
            c0 = time.process_time()
            run(module)
            return time.process_time() - c0
        runs = alternate({side: lambda module=module: cpu(module) for side, module in sides.items()}, args.repeat)
        ns = {side: min(r.outs) / n * 1e9 for side, r in runs.items()}
        then, now = ns.values()
        lines.append(f"- {name}: {then:.1f} ns of CPU a trained token at {args.passes}, {now:.1f} ns in this "
                     f"checkout ({now / then:.2f}x), the same sums to the bit")
    record(RESULTS, "\n".join(lines), RESULTS_INTRO, {"torch": torch.__version__}, write=not args.no_write,
           note=f"--fulldist --passes: torch threads={args.threads}; data: one step × {n:,} trained tokens of "
                f"{N:,} positions (fp32 log-probs, int32 ids), best of {args.repeat} calls per side, alternating")


def fulldist_main(args) -> None:
    data = make_step(args.tokens)
    n = int(data["mask"].sum()) * args.steps
    extra = {J: fulldist_inputs(data, J, args.layers, args.k) for J in J_SIZES}
    configs = {"token_sample=0, no top-k or routing": {},
               "token_sample=0, top-k J=20": extra[20]["topk"],
               f"token_sample=0, routing L={args.layers} K={args.k} (ids)": extra[20]["routing"],
               f"token_sample=0, routing L={args.layers} K={args.k} + weights": extra[20]["weights"],
               f"token_sample=0, top-k J=20 + routing L={args.layers} K={args.k} + weights":
                   extra[20]["topk"] | extra[20]["weights"],
               f"token_sample=0.001, top-k J=20 + routing L={args.layers} K={args.k} + weights":
                   extra[20]["topk"] | extra[20]["weights"]}
    rate = {name: 0.001 if "0.001" in name else 0.0 for name in configs}
    DriftLogger(tempfile.mkdtemp(), "warm", token_sample=0.0).log_step(
        0, **make_step(2000), **fulldist_inputs(make_step(2000), 20, args.layers, args.k)["topk"])  # loads kernels
    with tempfile.TemporaryDirectory() as tmp:
        runs = alternate({name: lambda name=name: time_round(
            lambda out: DriftLogger(out, "bench", token_sample=rate[name]), data | configs[name], args.steps,
            Path(tmp) / "out") for name in configs}, args.repeat)
    best = {name: min(r.outs) for name, r in runs.items()}
    base = best[next(iter(configs))][0]
    lines = [f"- {name}: {secs:.3f} s for {n:,} tokens -> {n / secs / 1e6:.2f}M tokens/s ({n / cpu / 1e6:.2f}M "
             f"tokens per CPU-second), {secs / base:.2f}x the time without" for name, (secs, cpu) in best.items()]
    small = make_step(args.db_tokens, seed=2)
    small_extra = {J: fulldist_inputs(small, J, args.layers, args.k) for J in J_SIZES}
    plain, tokens = db_bytes(small, 2)
    lines.append(f"\nDuckDB bytes per trained token (token_sample=1, {tokens:,} tokens over 2 steps, ingested; "
                 f"the growth of the database's used blocks over the same steps without the column):\n")
    routed, _ = db_bytes(small | small_extra[20]["routing"], 2)
    for label, extra_data, against, base_bytes in (
            [(f"top-k J={J}", small_extra[J]["topk"], "tokens only", plain) for J in J_SIZES]
            + [(f"weights of both sides, L={args.layers} K={args.k}", small_extra[20]["weights"],
                "the same routing ids without weights", routed)]):
        size, _ = db_bytes(small | extra_data, 2)
        lines.append(f"- {label}: {(size - base_bytes) / tokens:.1f} bytes per token beyond {against} "
                     f"({size / 1e6:.2f} MB against {base_bytes / 1e6:.2f} MB)")
    record(RESULTS, "\n".join(lines), RESULTS_INTRO, {"torch": torch.__version__}, write=not args.no_write,
           note=f"--fulldist: torch threads={args.threads}; data: {args.steps} steps × {n // args.steps:,} trained "
                f"tokens (fp32 log-probs), best of {args.repeat} rounds, alternating")


RESULTS_INTRO = """# DriftLogger benchmarks (benchmarks/bench_logger.py, benchmarks/sim_1b.py)

Each entry is one run of the command shown. `bench_logger` times `DriftLogger.log_step` on CPU per configuration,
alternating with the baseline (the logger before trainer-side summaries, which writes every token row); the best
round of each counts, because other processes share these CPUs. tokens/s counts trained (mask = 1) tokens; tokens
per CPU-second divides by the CPU time of the benchmark process (both torch threads together), which a busy
machine inflates less than wall time.
"""

if __name__ == "__main__":
    main()
