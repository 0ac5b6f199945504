"""Token-level drill-down: the worst sequences of a step, one sequence token by token with its context and
its flip grid."""
from __future__ import annotations

import json

import polars as pl

from analysis.metrics import quantiles
from analysis.store import Store
from analysis.summaries.sql import ratio_sql

ORDERS = ("seq_log_ratio_abs", "max_log_ratio_abs")


def worst_sequences(store: Store, run: str, step: int, order: str = "seq_log_ratio_abs", n: int = 20,
                    reward_min: float | None = None, reward_max: float | None = None) -> pl.DataFrame:
    """The `n` sequences of (run, step) with the largest mismatch, worst first, from the per-sequence summaries:
    every sequence with all its tokens, even where the token rows are a sample (DriftLogger token_sample < 1).

    Per sequence, with Δ = t − s over its tokens: seq_log_ratio = ΣΔ = log(π_trainer(y)/π_sampler(y)) of the
    whole response, seq_log_ratio_abs = |ΣΔ|, max_log_ratio_abs = max |Δ|, kl_k3 = mean(r − 1 − Δ)
    (estimates KL(π_sampler ‖ π_trainer), r = exp(clamp(Δ, −20, 20))), n_flips = number of stored (token, layer)
    routing rows whose expert sets differ (null when the sequence has no trainer routing rows); reward and advantage
    from the sequences table (null when the file carried none), response_length = the recorded length, else the
    number of tokens.
    order: "seq_log_ratio_abs" or "max_log_ratio_abs". reward_min / reward_max keep only sequences whose
    reward lies in [reward_min, reward_max] (either bound may be None; with a bound, sequences without a
    reward are left out), e.g. reward_min=1 for the correct responses of a 0/1 reward.
    Returns [sample, n_tokens, seq_log_ratio, seq_log_ratio_abs, max_log_ratio_abs, kl_k3, n_flips, reward,
    advantage, response_length].
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    params = {"run": run, "step": int(step), "n": int(n),
              "lo": None if reward_min is None else float(reward_min),
              "hi": None if reward_max is None else float(reward_max)}
    return store.sql(f"""
        WITH s AS (SELECT sample, sum(n_tokens)::BIGINT AS n_tokens, fsum(sum_d) AS seq_log_ratio,
                          abs(fsum(sum_d)) AS seq_log_ratio_abs, max(max_abs_d) AS max_log_ratio_abs,
                          fsum(sum_k3) / sum(n_tokens) AS kl_k3
                   FROM summary_seq WHERE run = $run AND step = $step
                   GROUP BY sample HAVING sum(n_tokens) > 0),
             f AS (SELECT sample, count_if(flip)::BIGINT AS n_flips FROM routing
                   WHERE run = $run AND step = $step AND flip IS NOT NULL GROUP BY sample),
             q AS (SELECT sample, reward, advantage, response_length FROM sequences
                   WHERE run = $run AND step = $step)
        SELECT s.*, f.n_flips, q.reward, q.advantage,
               coalesce(q.response_length, s.n_tokens)::BIGINT AS response_length
        FROM s LEFT JOIN f USING (sample) LEFT JOIN q USING (sample)
        WHERE ($lo IS NULL OR q.reward >= $lo) AND ($hi IS NULL OR q.reward <= $hi)
        ORDER BY {order} DESC, sample LIMIT $n""", params)


def sequence_context(store: Store, run: str, step: int, sample: int) -> dict | None:
    """What the trainer knew about one sequence besides its log-probs, or None if no summary holds it.

    {n_tokens, seq_log_ratio (ΣΔ), kl_k3 (mean r − 1 − Δ), n_token_rows, reward, advantage, prompt, response,
    tag, response_length, response_from_tokens}: n_tokens, ΣΔ and kl_k3 over every token of the sequence (its
    summary rows, so also where DriftLogger kept a sample of the token rows; n_token_rows says how many rows were
    kept, 0 for none); reward/advantage/prompt/tag are null when the logs carried none; response is the stored
    response text, else the tokens' text joined in position order (then response_from_tokens is True; null when
    no token has text); response_length is the recorded length, else the number of tokens.
    """
    # a database made before sequences had `response` or `tag`, opened read-only (a viewer), was never migrated
    stored = ", ".join(c if store.has_columns("sequences", [c]) else f"NULL::VARCHAR AS {c}"
                       for c in ("response", "tag"))
    rows = store.sql(f"""
        WITH s AS (SELECT sum(n_tokens)::BIGINT AS n_tokens, fsum(sum_d) AS seq_log_ratio,
                          fsum(sum_k3) / sum(n_tokens) AS kl_k3
                   FROM summary_seq WHERE run = $run AND step = $step AND sample = $sample),
             t AS (SELECT count(*) AS n_token_rows, string_agg(token, '' ORDER BY pos) AS joined
                   FROM tokens WHERE run = $run AND step = $step AND sample = $sample),
             q AS (SELECT reward, advantage, prompt, {stored}, response_length FROM sequences
                   WHERE run = $run AND step = $step AND sample = $sample LIMIT 1)
        SELECT s.n_tokens, s.seq_log_ratio, s.kl_k3, t.n_token_rows, q.reward, q.advantage, q.prompt,
               coalesce(q.response, t.joined) AS response, q.response IS NULL AS response_from_tokens, q.tag,
               coalesce(q.response_length, s.n_tokens)::BIGINT AS response_length
        FROM s CROSS JOIN t LEFT JOIN q ON true WHERE s.n_tokens > 0""",
                     {"run": run, "step": int(step), "sample": int(sample)})
    return rows.row(0, named=True) if rows.height else None


def step_samples(store: Store, run: str, step: int) -> list[int]:
    """The sample ids of (run, step) that hold tokens, ascending."""
    return [r[0] for r in store.rows("SELECT DISTINCT sample FROM tokens WHERE run = ? AND step = ? ORDER BY sample",
                                     [run, int(step)])]


def sequence_tokens(store: Store, run: str, step: int, sample: int) -> pl.DataFrame:
    """One sequence token by token: delta = Δ = t − s, ratio = r = exp(clamp(Δ, −20, 20)) = π_trainer/π_sampler,
    n_flipped_layers = layers whose expert sets differ at this token (null without trainer routing).

    Returns [pos, token_id, token, sampler_logprob, trainer_logprob, delta, ratio, n_flipped_layers] by pos.
    """
    return store.sql(f"""
        SELECT t.pos, t.token_id, t.token, t.sampler_logprob, t.trainer_logprob,
               t.trainer_logprob - t.sampler_logprob AS delta,
               {ratio_sql('t.trainer_logprob - t.sampler_logprob')} AS ratio, f.n_flipped_layers
        FROM tokens t
        LEFT JOIN (SELECT pos, count_if(flip)::BIGINT AS n_flipped_layers FROM routing
                   WHERE run = $run AND step = $step AND sample = $sample AND flip IS NOT NULL GROUP BY pos) f
          ON f.pos = t.pos
        WHERE t.run = $run AND t.step = $step AND t.sample = $sample
        ORDER BY t.pos""", {"run": run, "step": int(step), "sample": int(sample)})


def sequence_flip_grid(store: Store, run: str, step: int, sample: int) -> pl.DataFrame:
    """Position × layer grid of routing flips (E_s ≠ E_t as sets) for one sequence.

    Returns [pos, layer, flip] for rows with both sides recorded; empty without trainer routing.
    """
    return store.sql("""
        SELECT pos, layer, flip FROM routing
        WHERE run = $run AND step = $step AND sample = $sample AND flip IS NOT NULL
        ORDER BY pos, layer""", {"run": run, "step": int(step), "sample": int(sample)})


def run_steps(store: Store, run: str) -> list[int]:
    """The steps of a run that hold tokens, ascending (from the summaries: their token rows may be a sample)."""
    return [r[0] for r in store.rows("SELECT step FROM summary_step WHERE run = ? GROUP BY step "
                                     "HAVING sum(n_tokens) > 0 ORDER BY step", [run])]


def summarised(store: Store, run: str, step: int, sample: int) -> bool:
    """Whether the summaries hold the sequence: with no token row of it (sequence_context's n_token_rows 0), its
    token rows were not kept (DriftLogger token_sample < 1) rather than never logged."""
    return bool(store.rows("SELECT 1 FROM summary_seq WHERE run = ? AND step = ? AND sample = ? AND n_tokens > 0 "
                           "LIMIT 1", [run, int(step), int(sample)]))


def delta_scale(store: Store, run: str, p: float = 0.99) -> float | None:
    """The run's own spread of |Δ|: its p-quantile over every token (0.99: the p99 |Δ|), from the summaries
    (quantiles.token_abs_quantiles: exact where the token rows allow, else within one histogram bin). The Sequences
    page shades a token fully from this |Δ| on, so a block of tokens far above the run's usual noise stands out
    and noise does not. None when the run has no tokens."""
    q = quantiles.token_abs_quantiles(store, [run], ("run",), None, (p,))
    return float(q[0, 1]) if q.height else None


def sample_group(store: Store, run: str, step: int, sample: int) -> list[int]:
    """The sample ids of (run, step) that answer the same prompt as `sample` (a GRPO group: one prompt, several
    responses), ascending, `sample` included; only samples with tokens in the summaries. The logs carry no group
    id (the `sequences` table has none), so a group is the samples whose stored prompt text is equal. Empty when
    the sample has no prompt logged."""
    return [r[0] for r in store.rows("""
        WITH me AS (SELECT prompt FROM sequences WHERE run = $run AND step = $step AND sample = $sample
                    AND prompt IS NOT NULL LIMIT 1)
        SELECT q.sample FROM sequences q JOIN me ON q.prompt = me.prompt
        WHERE q.run = $run AND q.step = $step
          AND q.sample IN (SELECT sample FROM summary_seq WHERE run = $run AND step = $step AND n_tokens > 0)
        GROUP BY q.sample ORDER BY q.sample""", {"run": run, "step": int(step), "sample": int(sample)})]


def prompt_token_count(prompt: str | None) -> int | None:
    """How many tokens the prompt has where the logs kept its token ids (stored as JSON text, `[151644, 872]`:
    docs/SCHEMA.md, table sequences), else None: a prompt logged as text has no token count without the
    tokenizer."""
    if not prompt or not prompt.startswith("["):
        return None
    try:
        ids = json.loads(prompt)
    except ValueError:
        return None
    return len(ids) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None
