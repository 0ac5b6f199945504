"""Benchmark the residual signatures the findings read (first_token, lattice, retokenization): from the summaries
(findings.residual.signature_table) against the token-row query it replaced (residual.token_signatures).

    python benchmarks/bench_signatures.py [--tokens 1000000] [--repeat 5] [--no-write]

One run of --tokens tokens (sequences of 500 in 5 turns of 100, 20 steps; Δ ~ N(0, 0.05)) written as a Parquet
file under benchmarks/work/ (git-ignored) and loaded by ingest, so the summaries hold the residual counts as any
load makes them; both sides are timed in the same process, alternating, best of --repeat; both must agree on the
counts. Results are appended to benchmarks/RESULTS-findings.md.
"""
from __future__ import annotations

import argparse

import numpy as np
import polars as pl

from harness import ROOT, WORK, best_of_pairs, fresh_db, record

from analysis.findings import residual
from analysis.ingest import ingest_paths
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-findings.md"
INTRO = """# Findings benchmarks

What the Findings page's rules read, timed against what they read before; best of N, sides alternating in one
process (benchmarks/harness.py). A ratio below 1 means the first side is faster.
"""
LEN, TURN, STEPS = 500, 100, 20


def build(n: int) -> Store:
    rng = np.random.default_rng(0)
    n = max(LEN * STEPS, n // (LEN * STEPS) * LEN * STEPS)
    pos = np.tile(np.arange(LEN, dtype=np.int32), n // LEN)
    s = -rng.exponential(1.5, n) - 0.5
    df = pl.DataFrame({"run": "bench", "step": np.repeat(np.arange(STEPS), n // STEPS),
                       "sample": np.repeat(np.arange(n // LEN), LEN) % (n // LEN // STEPS), "pos": pos,
                       "segment": (pos // TURN).astype(np.int32), "sampler_logprob": s,
                       "trainer_logprob": s + rng.normal(0.0, 0.05, n)})
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / "bench_signatures.parquet"
    df.write_parquet(path)
    store = Store(fresh_db(WORK / "bench_signatures.duckdb"))
    assert {o.status for o in ingest_paths(store, [path])} == {"loaded"}
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    store = build(args.tokens)
    n = store.scalar("SELECT count(*) FROM tokens")
    new, old, ratio = best_of_pairs(lambda: residual.signature_table(store, ["bench"]),
                                    lambda: residual.token_signatures(store, ["bench"]), args.repeat)
    a, b = new.out.row(0, named=True), old.out.row(0, named=True)
    assert a["lattice_from"] == "summaries" and a["segments_from"] == "summaries", a
    for col in ("n_tokens", "n_first", "n_nonzero", "n_seg_first", "n_seg_first_low", "n_seg_rest_low"):
        assert a[col] == b[col], (col, a[col], b[col])
    body = (f"- {n:,} tokens, one run: signature_table (summaries) best {new.best:.4f} s (median {new.median:.4f}), "
            f"token_signatures (token rows) best {old.best:.4f} s (median {old.median:.4f}): ratio {ratio:.3f}; "
            "the same counts")
    record(RESULTS, body, INTRO, write=not args.no_write)
    store.close()


if __name__ == "__main__":
    main()
