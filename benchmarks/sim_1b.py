"""A 1B-token run simulated through DriftLogger, then ingested: wall time of ingest, bytes on disk, exact curves.

    python benchmarks/sim_1b.py [--steps 1000] [--tokens 1000000] [--seq-len 4096] [--token-sample 0.001]
                                [--log-only | --ingest-only] [--no-write]

Logging: `steps` steps of `tokens` trained tokens each (sequences of `seq-len`, no padding), fp32 log-probs drawn
cheaply with torch (s ~ −Exp(1.5), Δ ~ N(0, 0.02) with a 0.5% tail ×20, staleness 0 or 1 per sequence), written
by DriftLogger(token_sample=...) into benchmarks/work/sim1b/ (git-ignored). Logging resumes where a previous
call stopped (a step whose summary file exists is skipped). While logging, the exact per-step Σ Δ and Σ k3 are
computed independently (float64 torch sums over every token) and kept in truth.json.

Ingest: `python -m analysis ingest` as a whole process into a fresh database, timed; then the per-step curves
the app draws (summaries.read.token_table by step) are compared with truth.json at rel 1e-9.
Results are appended to benchmarks/RESULTS-logger.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from bench_logger import record  # noqa: E402  (benchmarks/ is the script's folder)

from analysis.record.logger import DriftLogger  # noqa: E402
from analysis.record.logger import _write as write_parquet  # noqa: E402  (the logger's encoding)
from analysis.record.token_sample import WORST_SEQUENCES  # noqa: E402  (the product default)

WORK = ROOT / "benchmarks" / "work" / "sim1b"
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


def log(args) -> float:
    WORK.mkdir(parents=True, exist_ok=True)
    truth_file = WORK / "truth.json"
    known = json.loads(truth_file.read_text()) if truth_file.exists() else {}
    logger = DriftLogger(WORK, RUN, {"simulated": True, "tokens_per_step": args.tokens},
                         token_sample=args.token_sample, worst_sequences=args.worst_sequences,
                         top_tokens=args.top_tokens)
    spent = 0.0
    for step in range(args.steps):
        if (logger.dir / f"summary-step{step:06d}.parquet").exists() and str(step) in known:
            continue
        data = step_data(step, args.tokens, args.seq_len)
        t0 = time.perf_counter()
        logger.log_step(step, **data)
        spent += time.perf_counter() - t0
        known[str(step)] = truth(data)
        if step % 10 == 0 or step == args.steps - 1:
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


def ingest_and_check(args) -> tuple[float, int, float]:
    db = WORK / "sim.duckdb"
    for f in (db, db.with_name(db.name + ".wal")):
        f.unlink(missing_ok=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "analysis", "ingest", str(WORK / RUN), "--db", str(db)], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
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
    print(f"ingest {wall:.1f} s; curves for {len(curves)} steps in {curve_time:.2f} s, max rel diff {worst:.1e}; "
          f"coverage {cov}")
    return wall, db.stat().st_size, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--token-sample", type=float, default=0.001)
    ap.add_argument("--worst-sequences", type=int, default=WORST_SEQUENCES)
    ap.add_argument("--top-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-only", action="store_true")
    ap.add_argument("--ingest-only", action="store_true")
    ap.add_argument("--replicate", action="store_true",
                    help="with --ingest-only: complete the run to --steps with copies of the steps logged so far")
    ap.add_argument("--work", type=Path, default=WORK, help="folder of the logs and the database (git-ignored)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    set_work(args.work)
    args.tokens = args.tokens // args.seq_len * args.seq_len
    torch.set_num_threads(args.threads)
    spent = None if args.ingest_only else log(args)
    if args.log_only:
        return
    logged = replicate(args.steps) if args.replicate else args.steps
    size = sizes()
    step_parts, kept = parts()
    wall, db_size, worst = ingest_and_check(args)
    total = args.steps * args.tokens
    lines = [f"## {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%dT%H:%M:%S')}Z — simulated run\n",
             f"Command: `python benchmarks/sim_1b.py --steps {args.steps} --tokens {args.tokens} --seq-len "
             f"{args.seq_len} --token-sample {args.token_sample} --worst-sequences {args.worst_sequences} "
             f"--top-tokens {args.top_tokens}`  ",
             f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch threads={args.threads}, load average "
             f"at the end {os.getloadavg()[0]:.1f}  ",
             f"Data: {total:,} tokens ({args.steps} steps × {args.tokens:,}, sequences of {args.seq_len})"
             + (f"; steps {logged}..{args.steps - 1} are copies of steps 0..{logged - 1} (step column rewritten)"
                if logged < args.steps else "") + "\n"]
    if spent is not None:
        lines.append(f"- logging: {spent:.1f} s in log_step ({total / spent / 1e6:.1f}M tokens/s)")
    lines += [f"- files: {sum(size.values()) / 1e6:.1f} MB in all ("
              + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sorted(size.items())) + ")",
              "- step 0's summary tables written alone: " + ", ".join(f"{k} {v / 1e3:.1f} KB"
                                                                  for k, v in step_parts.items()),
              "- step 0's token rows: " + ", ".join(f"{k} {v:,}" for k, v in kept.items())
              + " (n_kept counts each token once)",
              f"- `python -m analysis ingest` (whole process, fresh database): {wall:.1f} s; database "
              f"{db_size / 1e6:.1f} MB",
              f"- per-step curves (summaries.read.token_table by step) against every token's exact sums: "
              f"max rel diff {worst:.1e} over {args.steps} steps (n_tokens equal)"]
    record("\n".join(lines) + "\n", write=not args.no_write)


if __name__ == "__main__":
    main()
