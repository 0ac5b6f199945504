"""What DriftLogger's context arguments cost: bytes per token of the per-token columns (advantage, segment,
sampling_support) in its token files and in the database after ingest, bytes per sequence of the `sequences` rows
in its summary files, and the time log_step takes with and without them (token_sample=1: every token row).

Data as a GRPO multi-turn trainer hands them over: an advantage per sequence broadcast over its tokens, turns of
64–512 tokens, a top-p support of 1–64 tokens (mostly small), a reward, a 200-character prompt and a 1,000-character
response per sequence, a tag of three.

    python benchmarks/bench_context_bytes.py [--steps 4] [--rows 64] [--positions 2048] [--no-write]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from harness import ROOT, record

RESULTS = ROOT / "benchmarks" / "RESULTS-logger.md"
INTRO = "# DriftLogger benchmarks (benchmarks/bench_logger.py, benchmarks/sim_1b.py, benchmarks/bench_context_bytes.py)"
CONTEXT = ("advantage", "segment", "sampling_support")


def step_data(step: int, B: int, T: int, context: bool) -> dict:
    g = torch.Generator().manual_seed(step)
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    t = (s + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.02).clamp(max=0.0)
    mask = torch.ones(B, T, dtype=torch.long)
    out = dict(sampler_logprobs=s.float(), trainer_logprobs=t.float(), mask=mask,
               token_ids=torch.randint(0, 150_000, (B, T), generator=g))
    if not context:
        return out
    turn_len = torch.randint(64, 513, (B, 1), generator=g)
    support = torch.minimum(torch.randint(1, 65, (B, T), generator=g), torch.randint(1, 9, (B, T), generator=g))
    out |= dict(rewards=torch.rand(B, generator=g), advantages=torch.randn(B, 1, generator=g).expand(B, T),
                prompts=["p" * 200] * B, responses=["r" * 1000] * B, tags=[("code", "math", "chat")[b % 3]
                                                                          for b in range(B)],
                segment_ids=torch.arange(T)[None, :] // turn_len, sampling_support=support)
    return out


def log(folder: Path, steps: int, B: int, T: int, context: bool) -> float:
    from analysis.record.logger import DriftLogger

    logger = DriftLogger(folder, "r", token_sample=1.0)
    data = [step_data(step, B, T, context) for step in range(steps)]
    t0 = time.perf_counter()
    for step, d in enumerate(data):
        logger.log_step(step, **d)
    return time.perf_counter() - t0


def column_bytes(files: list[Path]) -> dict[str, int]:
    """Compressed bytes of each column over the files' row groups."""
    out: dict[str, int] = {}
    for f in files:
        meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                col = meta.row_group(g).column(c)
                out[col.path_in_schema] = out.get(col.path_in_schema, 0) + col.total_compressed_size
    return out


def db_bytes(folder: Path, db: Path) -> int:
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    with Store(db) as store:
        assert {o.status for o in ingest_paths(store, [folder])} == {"loaded"}
    return db.stat().st_size  # closed: checkpointed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64, help="sequences per step")
    ap.add_argument("--positions", type=int, default=2048, help="positions per sequence (all trained)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    n = args.steps * args.rows * args.positions
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for context in (False, True):
            folder = Path(tmp) / ("with" if context else "without")
            log(folder, 1, args.rows, args.positions, context)  # compile and warm the kernels
            for f in folder.rglob("*"):
                if f.is_file():
                    f.unlink()
            seconds = min(log(folder, args.steps, args.rows, args.positions, context) for _ in range(2))
            tokens = column_bytes(sorted(folder.rglob("tokens-*.parquet")))
            summary = sum(f.stat().st_size for f in folder.rglob("summary-*.parquet"))
            found[context] = dict(seconds=seconds, tokens=tokens, summary=summary,
                                  db=db_bytes(folder, Path(tmp) / f"{folder.name}.duckdb"))
    without, with_ = found[False], found[True]
    lines = [f"Data: {args.steps} steps × {args.rows} sequences × {args.positions} positions = {n:,} tokens, "
             "token_sample=1, float32 log-probs", ""]
    lines += [f"- token files, `{c}`: {with_['tokens'][c] / n:.3f} bytes a token (zstd Parquet)" for c in CONTEXT]
    extra_summary = with_["summary"] - without["summary"]
    lines.append(f"- summary files: +{extra_summary / (args.steps * args.rows):.0f} bytes a sequence (its "
                 "`sequences` row: reward, advantage, a 200-character prompt, a 1,000-character response, tag)")
    lines.append(f"- database after ingest: {without['db'] / n:.2f} → {with_['db'] / n:.2f} bytes a token "
                 f"({(with_['db'] - without['db']) / n:+.2f}; DuckDB allocates in 256 KB blocks)")
    lines.append(f"- log_step, files included: {n / without['seconds'] / 1e6:.1f}M tokens/s without the context, "
                 f"{n / with_['seconds'] / 1e6:.1f}M/s with every argument (best of 2)")
    record(RESULTS, "\n".join(lines), INTRO, note="context arguments", write=not args.no_write)


if __name__ == "__main__":
    main()
