"""Benchmark the metric queries on a synthetic DuckDB with 5M tokens and 8M routing rows.

    python benchmarks/bench_metrics.py [--repeat 5] [--naive-budget 100] [--rebuild] [--threads N] [--no-write]

On the metrics database (benchmarks/inputs/metrics_db.py: written straight with DuckDB SQL, once, under
benchmarks/work/, git-ignored), times in the same run, best of N (library and reference alternating):
  (a) metrics.token_metrics(by="step") against one hand-written DuckDB query computing the same aggregates;
  (b) routing.routing_metrics(by="layer") against the naive query that compares top-k sets at query time
      (list_sort(...) <> list_sort(...), len(list_intersect(...))) per (step, layer).
Results are appended to benchmarks/RESULTS-metrics.md.
"""
from __future__ import annotations

import argparse
import sys

import polars as pl

from harness import ROOT, best_of_pairs, record
from inputs import metrics_db as M

from analysis.metrics import routing
from analysis.metrics import token as metrics
from analysis.store import Store

RESULTS = ROOT / "benchmarks" / "RESULTS-metrics.md"

HAND_TOKEN_QUERY = """
WITH x AS (SELECT step, sample, sampler_logprob AS s, trainer_logprob AS t, trainer_logprob - sampler_logprob AS d,
                  exp(least(greatest(trainer_logprob - sampler_logprob, -20), 20)) AS r
           FROM tokens WHERE run = $run),
tok AS (SELECT step, count(*) AS n_tokens, avg(s - t) AS kl_k1, avg(0.5 * d * d) AS kl_k2, avg(r - 1 - d) AS kl_k3,
               avg(abs(d)) AS log_ratio_abs_mean, max(abs(d)) AS log_ratio_abs_max,
               avg(abs(exp(t) - exp(s))) AS prob_abs_diff_mean, max(abs(exp(t) - exp(s))) AS prob_abs_diff_max,
               corr(exp(t), exp(s)) AS prob_pearson, avg(r) AS ratio_mean, stddev_pop(r) AS ratio_std,
               min(r) AS ratio_min, max(r) AS ratio_max, avg(r * r) - 1 AS chi2_token,
               avg((r > $cap)::INT) AS ratio_frac_high, avg((r < 1 / $cap)::INT) AS ratio_frac_low,
               avg((abs(r - 1) > $clip)::INT) AS clip_frac,
               avg(least(greatest(r, 1 / $cap), $cap)) ^ 2 / avg(least(greatest(r, 1 / $cap), $cap) ^ 2) AS ess
        FROM x GROUP BY step),
seq AS (SELECT step, count(*) AS n_sequences, avg(exp(m)) AS ppl_ratio,
               avg(exp(2 * least(greatest(sd, -20), 20)) - 1) AS chi2_seq, max(abs(sd)) AS seq_log_ratio_abs_max
        FROM (SELECT step, sample, avg(s - t) AS m, sum(d) AS sd FROM x GROUP BY step, sample) GROUP BY step)
SELECT * FROM tok JOIN seq USING (step) ORDER BY step"""

NAIVE_ROUTING_QUERY = """
SELECT step, layer, count(*) AS n_tokens,
       avg((list_sort(sampler_experts) <> list_sort(trainer_experts))::INT) AS flip_rate,
       avg((sampler_experts[1] <> trainer_experts[1])::INT) AS top1_flip_rate,
       avg(len(list_intersect(sampler_experts, trainer_experts)) / len(sampler_experts)) AS overlap
FROM routing WHERE run = $run AND trainer_experts IS NOT NULL
GROUP BY step, layer ORDER BY step, layer"""


def check_same(lib: pl.DataFrame, ref: pl.DataFrame, cols: list[str], key: list[str]) -> float:
    """Largest relative difference between the library's and the reference's columns (sanity check)."""
    joined = lib.join(ref, on=key, suffix="_ref")
    assert joined.height == lib.height == ref.height, (lib.height, ref.height)
    worst = 0.0
    for c in cols:
        a, b = joined[c].cast(pl.Float64).to_numpy(), joined[f"{c}_ref"].cast(pl.Float64).to_numpy()
        worst = max(worst, float(abs(a - b).max() / max(abs(b).max(), 1e-300)))
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per query; the best counts (default 5)")
    ap.add_argument("--rebuild", action="store_true", help="build the database again even if it exists")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--naive-budget", type=float, default=100.0,
                    help="seconds of naive routing runs after which it is not repeated (default 100)")
    ap.add_argument("--no-write", action="store_true", help="do not append to RESULTS-metrics.md")
    args = ap.parse_args()
    store = Store(M.ensure(args.rebuild), read_only=True, threads=args.threads)
    n_tok = store.scalar("SELECT count(*) FROM tokens")
    n_rt = store.scalar("SELECT count(*) FROM routing")
    flips = store.scalar("SELECT avg(flip::INT) FROM routing")
    threads = store.scalar("SELECT current_setting('threads')")
    print(f"{n_tok:,} tokens, {n_rt:,} routing rows ({flips:.1%} flips), DuckDB threads={threads}")
    params = {"run": M.RUN, "cap": 2.0, "clip": 0.2}

    lib_tok, hand_tok, tok_ratio = best_of_pairs(
        lambda: metrics.token_metrics(store, [M.RUN], by="step"), lambda: store.sql(HAND_TOKEN_QUERY, params),
        args.repeat)
    diff_tok = check_same(lib_tok.out, hand_tok.out, ["kl_k1", "kl_k3", "ess", "ppl_ratio", "chi2_seq", "ratio_std"],
                          ["step"])
    # the naive query takes about a minute here: repeated only while within --naive-budget seconds
    lib_rt, naive_rt, rt_ratio = best_of_pairs(
        lambda: routing.routing_metrics(store, [M.RUN], by="layer"),
        lambda: store.sql(NAIVE_ROUTING_QUERY, {"run": M.RUN}), args.repeat, args.naive_budget)
    diff_rt = check_same(lib_rt.out, naive_rt.out, ["n_tokens", "flip_rate", "top1_flip_rate", "overlap"],
                         ["step", "layer"])
    store.close()

    lines = [
        f"(a) token_metrics(by='step'): {lib_tok.best:.3f}s vs hand-written query {hand_tok.best:.3f}s "
        f"(best of {args.repeat} each, alternating) "
        f"-> ratio {tok_ratio:.2f}x (target <= 2x, goal 1.3x); max rel diff {diff_tok:.1e}",
        f"(b) routing_metrics(by='layer'): {lib_rt.best:.3f}s (best of {len(lib_rt.seconds)}) vs naive set "
        f"comparison {naive_rt.best:.3f}s (best of {len(naive_rt.seconds)}) -> {1 / rt_ratio:.1f}x faster (target "
        f">= 5x, goal 100x); max rel diff {diff_rt:.1e}",
    ]
    intro = ("# Metric query benchmarks (benchmarks/bench_metrics.py)\n\n"
             "Each entry is one run of the command shown. The library call and its reference query are timed\n"
             "alternately and the best run of each counts, because other processes share these CPUs; the slow\n"
             "naive routing query is repeated only within `--naive-budget` seconds. `max rel diff` checks that\n"
             "both sides computed the same numbers.")
    record(RESULTS, "\n".join(f"- {line}" for line in lines), intro, {"polars": pl.__version__},
           write=not args.no_write,
           note=f"DuckDB threads={threads}; data: {n_tok:,} tokens, {n_rt:,} routing rows ({M.LAYERS} layers, "
                f"top-{M.K} of {M.EXPERTS}, {flips:.1%} flips), best of {args.repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
