"""A 1B-token run simulated through DriftLogger, then ingested: wall time of ingest, bytes on disk, exact curves.

    python benchmarks/sim_1b.py [--steps 1000] [--tokens 1000000] [--seq-len 4096] [--token-sample 0.001]
                                [--logged N] [--log-only | --ingest-only] [--no-write]

Logging: `steps` steps of `tokens` trained tokens each (sequences of `seq-len`, no padding), fp32 log-probs drawn
cheaply with torch (s ~ −Exp(1.5), Δ ~ N(0, 0.02) with a 0.5% tail ×20, staleness 0 or 1 per sequence), written
by DriftLogger(token_sample=...) into benchmarks/work/sim1b/ (git-ignored). Logging resumes where a previous
call stopped (a step whose summary file exists is skipped). While logging, the exact per-step Σ Δ and Σ k3 are
computed independently (float64 torch sums over every token) and kept in truth.json. With `--logged N` only the
first N steps are logged and the others are copies of their files (step column rewritten), for a run longer
than the machine can log in the time it has.

Ingest: `python -m analysis ingest` as a whole process into a fresh database, timed; then the per-step curves
the app draws (summaries.read.token_table by step) are compared with truth.json at rel 1e-9.
Results are appended to benchmarks/RESULTS-logger.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

import harness
from harness import ROOT, fresh_db, record, timed

from analysis.record.logger import DriftLogger
from analysis.record.logger import _write as write_parquet  # (the logger's encoding)
from analysis.record.token_sample import WORST_SEQUENCES  # (the product default)

WORK = harness.WORK / "sim1b"
RESULTS = ROOT / "benchmarks" / "RESULTS-logger.md"
RUN = "sim-1b"


def set_work(path: Path) -> None:
    global WORK
    WORK = path


def step_data(step: int, n_tokens: int, seq_len: int) -> dict:
    g = torch.Generator().manual_seed(1000 + step)
    B = n_tokens // seq_len
    s = -torch.empty(B, seq_len).exponential_(1.5, generator=g)
    d = torch.randn(B, seq_len, generator=g) * 0.02
    d = torch.where(torch.rand(B, seq_len, generator=g) < 0.005, d * 20, d)
    t = (s + d).clamp(max=0.0)
    return dict(sampler_logprobs=s, trainer_logprobs=t, mask=torch.ones(B, seq_len, dtype=torch.bool),
                token_ids=torch.randint(0, 150_000, (B, seq_len), generator=g),
                sampler_version=step - torch.randint(0, 2, (B,), generator=g), trainer_version=step)


def truth(data: dict) -> dict:
    """Exact reference of one step, from every token: n, Σ Δ, and Σ k3 with k3 = expm1(Δ) − Δ (|Δ| < 20 here)."""
    s, t = data["sampler_logprobs"].double(), data["trainer_logprobs"].double()
    d = t - s
    return {"n_tokens": d.numel(), "kl_k1": float(-d.sum()) / d.numel(),
            "log_ratio_abs_mean": float(d.abs().sum()) / d.numel()}


def log(args, steps: int) -> float:
    """Log steps 0 .. steps-1 (those not logged yet); returns the seconds spent in log_step."""
    WORK.mkdir(parents=True, exist_ok=True)
    truth_file = WORK / "truth.json"
    known = json.loads(truth_file.read_text()) if truth_file.exists() else {}
    logger = DriftLogger(WORK, RUN, {"simulated": True, "tokens_per_step": args.tokens},
                         token_sample=args.token_sample, worst_sequences=args.worst_sequences,
                         top_tokens=args.top_tokens)
    spent = 0.0
    for step in range(steps):
        if (logger.dir / f"summary-step{step:06d}.parquet").exists() and str(step) in known:
            continue
        data = step_data(step, args.tokens, args.seq_len)
        t0 = time.perf_counter()
        logger.log_step(step, **data)
        spent += time.perf_counter() - t0
        known[str(step)] = truth(data)
        if step % 10 == 0 or step == steps - 1:
            truth_file.write_text(json.dumps(known))
            print(f"step {step}: {spent:.1f} s in log_step so far", flush=True)
    truth_file.write_text(json.dumps(known))
    return spent


def replicate(target: int) -> int:
    """Complete the run to `target` steps with copies of the logged steps' files (step k copies step k mod n,
    its step column rewritten, same encoding), for when logging every step takes longer than the machine allows.
    Returns n, the number of steps really logged."""
    known = json.loads((WORK / "truth.json").read_text())
    run_dir = WORK / RUN
    logged = sorted(int(k) for k in known if (run_dir / f"summary-step{int(k):06d}.parquet").exists()
                    and int(k) < target)
    n = len(logged)
    assert logged == list(range(n)), "replicate needs steps 0 .. n-1 logged"
    for step in range(n, target):
        src = step % n
        for kind in ("summary", "tokens", "routing"):
            f = run_dir / f"{kind}-step{src:06d}.parquet"
            if f.exists():
                table = pq.read_table(f)
                table = table.set_column(table.column_names.index("step"), "step",
                                         pa.array([step] * table.num_rows, pa.int64()))
                write_parquet(table, run_dir / f"{kind}-step{step:06d}.parquet")
        known[str(step)] = known[str(src)]
    (WORK / "truth.json").write_text(json.dumps(known))
    return n


def sizes() -> dict[str, int]:
    out: dict[str, int] = {}
    for f in (WORK / RUN).glob("*.parquet"):
        kind = f.name.split("-step")[0]
        out[kind] = out.get(kind, 0) + f.stat().st_size
    return out


def parts(step: int = 0) -> tuple[dict[str, int], dict[str, int]]:
    """What one step's files are made of: the bytes of each summary table's rows written alone with the
    logger's encoding (their sum is close to, not equal to, the one file's size), and the step's token rows by
    why they were kept (summary_sample: uniform draw, worst sequences, top |Δ|; the parts overlap)."""
    import tempfile

    import pyarrow.compute as pc
    table = pq.read_table(WORK / RUN / f"summary-step{step:06d}.parquet")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(set(table["summary"].to_pylist())):
            rows = table.filter(pc.equal(table["summary"], name))
            rows = rows.select([c for c in rows.column_names if rows[c].null_count < rows.num_rows])
            path = Path(tmp) / f"{name}.parquet"
            write_parquet(rows, path)
            out[f"{name} ({rows.num_rows} rows)"] = path.stat().st_size
    sample = table.filter(pc.equal(table["summary"], "summary_sample")).to_pylist()[0]
    kept = {k: sample[k] for k in ("n_kept", "n_uniform", "n_worst_seq_tokens", "n_top_tokens")}
    return out, kept


def ingest_and_check(args) -> tuple[dict, int, float]:
    db = fresh_db(WORK / "sim.duckdb")
    ingest = timed([sys.executable, "-m", "analysis", "ingest", str(WORK / RUN), "--db", str(db)])
    from analysis.metrics import read
    from analysis.store import Store
    known = json.loads((WORK / "truth.json").read_text())
    store = Store(db, read_only=True)
    t0 = time.perf_counter()
    curves = read.token_table(store, [RUN], by="step")
    curve_time = time.perf_counter() - t0
    worst = 0.0
    for row in curves.iter_rows(named=True):
        want = known[str(row["step"])]
        assert row["n_tokens"] == want["n_tokens"], (row["step"], row["n_tokens"], want["n_tokens"])
        for col in ("kl_k1", "log_ratio_abs_mean"):
            worst = max(worst, abs(row[col] - want[col]) / abs(want[col]))
    assert len(curves) == args.steps and worst < 1e-9, (len(curves), worst)
    cov = read.coverage(store, [RUN]).row(0, named=True)
    store.close()
    print(f"ingest {ingest['seconds']:.1f} s; curves for {len(curves)} steps in {curve_time:.2f} s, max rel diff "
          f"{worst:.1e}; coverage {cov}")
    return ingest, db.stat().st_size, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000, help="steps of the run")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="trained tokens per step (whole sequences)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--token-sample", type=float, default=0.001, help="DriftLogger's token_sample")
    ap.add_argument("--worst-sequences", type=int, default=WORST_SEQUENCES)
    ap.add_argument("--top-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--logged", type=int, default=None,
                    help="log only the first LOGGED steps and complete the run to --steps with copies of them")
    ap.add_argument("--log-only", action="store_true", help="write the logs, do not ingest them")
    ap.add_argument("--ingest-only", action="store_true", help="ingest the logs written before")
    ap.add_argument("--replicate", action="store_true",
                    help="with --ingest-only: complete the run to --steps with copies of the steps logged so far")
    ap.add_argument("--work", type=Path, default=WORK, help="folder of the logs and the database (git-ignored)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not append to RESULTS-logger.md")
    args = ap.parse_args()
    set_work(args.work)
    args.tokens = args.tokens // args.seq_len * args.seq_len
    torch.set_num_threads(args.threads)
    to_log = min(args.logged or args.steps, args.steps)
    spent = None if args.ingest_only else log(args, to_log)
    logged = replicate(args.steps) if args.replicate or to_log < args.steps else args.steps
    if args.log_only:
        return
    size = sizes()
    step_parts, kept = parts()
    ingest, db_size, worst = ingest_and_check(args)
    total = args.steps * args.tokens
    lines = []
    if spent is not None:
        lines.append(f"- logging: {spent:.1f} s in log_step ({to_log * args.tokens / spent / 1e6:.1f}M tokens/s)")
    lines += [f"- files: {sum(size.values()) / 1e6:.1f} MB in all ("
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(size.items())) + ")",
              "- step 0's summary tables written alone: " + ", ".join(f"{k} {v / 1e3:.1f} KB"
                                                                  for k, v in step_parts.items()),
              "- step 0's token rows: " + ", ".join(f"{k} {v:,}" for k, v in kept.items())
              + " (n_kept counts each token once)",
              f"- `python -m analysis ingest` (whole process, fresh database): {ingest['seconds']:.1f} s, "
              f"{ingest['cpu_seconds']:.1f} s CPU, peak RSS {ingest['peak_rss_mb']:.0f} MB; database "
              f"{db_size / 1e6:.1f} MB",
              f"- per-step curves (summaries.read.token_table by step) against every token's exact sums: "
              f"max rel diff {worst:.1e} over {args.steps} steps (n_tokens equal)"]
    note = (f"torch threads={args.threads}; data: {total:,} tokens ({args.steps} steps × {args.tokens:,}, sequences "
            f"of {args.seq_len})" + (f"; steps {logged}..{args.steps - 1} are copies of steps 0..{logged - 1} (step "
                                     "column rewritten)" if logged < args.steps else ""))
    record(RESULTS, "\n".join(lines), "# DriftLogger benchmarks (benchmarks/bench_logger.py, benchmarks/sim_1b.py)",
           {"torch": torch.__version__}, note=note, write=not args.no_write)


if __name__ == "__main__":
    main()
