"""Context over steps: what the trainer saw per step besides the log-probs (reward, response length, number of
sequences), to read a drift rise against a change in reward or length."""
from __future__ import annotations

from typing import Sequence

import polars as pl

from analysis.store import Store
from analysis.summaries.finalise import sequences_sql
from analysis.summaries.sql import run_filter

CONTEXT_COLUMNS = ("n_sequences", "reward_mean", "n_rewarded", "response_length_mean", "response_length_std",
                   "response_length_min", "response_length_max", "advantage_mean", "advantage_min", "advantage_max",
                   "n_advantaged")


def step_context(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """One row per (run, step) with tokens, read from the per-sequence summaries (one row per sequence and file,
    so the cost does not grow with the tokens, and a run logged with a token sample still counts every token).

    n_sequences = sequences with at least one token; response length L of a sequence = its recorded
    `response_length`, else its number of tokens; response_length_mean / _std (sample standard deviation, null
    for one sequence) / _min / _max over the step's sequences; reward_mean = mean reward over the sequences
    that have one, n_rewarded = how many have one (0 and a null mean when the files carried no reward);
    advantage_mean / _min / _max over the sequences with a (per-sequence) advantage, n_advantaged how many.
    Returns [run, step, n_sequences, reward_mean, n_rewarded, response_length_mean, response_length_std,
    response_length_min, response_length_max, advantage_mean, advantage_min, advantage_max, n_advantaged],
    ordered by run and step.
    """
    if not runs:
        return pl.DataFrame(schema={"run": pl.String, "step": pl.Int64, **{c: pl.Float64 for c in CONTEXT_COLUMNS}})
    where_t, params = run_filter(runs, steps)
    where_q, params_q = run_filter(runs, steps, prefix="q_")
    return store.sql(f"""
        WITH t AS (SELECT run, step, sample, n_tokens::BIGINT AS n_tokens FROM ({sequences_sql(where_t)})),
             q AS (SELECT run, step, sample, reward, advantage, response_length FROM sequences WHERE {where_q})
        SELECT run, step, count(*) AS n_sequences, avg(q.reward) AS reward_mean,
               count(q.reward) AS n_rewarded,
               avg(coalesce(q.response_length, t.n_tokens)) AS response_length_mean,
               stddev_samp(coalesce(q.response_length, t.n_tokens)) AS response_length_std,
               min(coalesce(q.response_length, t.n_tokens)) AS response_length_min,
               max(coalesce(q.response_length, t.n_tokens)) AS response_length_max,
               avg(q.advantage) AS advantage_mean, min(q.advantage) AS advantage_min,
               max(q.advantage) AS advantage_max, count(q.advantage) AS n_advantaged
        FROM t LEFT JOIN q USING (run, step, sample)
        GROUP BY run, step ORDER BY run, step""", {**params, **params_q})
