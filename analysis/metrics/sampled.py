"""Say when a token-level view reads a sample: the label pages put over Sequences, the top token ids and the
2-D density when a run's token rows are fewer than the tokens its summaries cover (DriftLogger token_sample < 1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from analysis.metrics import read
from analysis.store import Store
from analysis.summaries.sql import check_runs, run_filter


def count_text(n: int) -> str:
    """1234 -> '1.2k', 1_000_000_000 -> '1.0B' (three significant figures at most)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def share_text(share: float) -> str:
    """0.00105 -> '0.1%', 0.25 -> '25%': two significant figures, no trailing zeros."""
    return f"{float(f'{share * 100:.2g}'):g}%"


def sample_label(store: Store, runs: Sequence[str]) -> str | None:
    """'tokens: 0.1% sample (1.0M of 1.0B); curves are exact' when the selected runs' token rows are a sample of
    the tokens their summaries cover; None when every token has its row (nothing to say)."""
    runs = check_runs(runs)
    cov = read.coverage(store, runs)
    if cov.is_empty() or cov["complete"].all():
        return None
    n, kept = int(cov["n_tokens"].sum()), int(cov["n_token_rows"].sum())
    label = f"tokens: {share_text(kept / n)} sample ({count_text(kept)} of {count_text(n)}); curves are exact"
    parts = sample_parts(store, runs)
    return label + (f" — {parts}" if parts else "")


def sample_parts(store: Store, runs: Sequence[str]) -> str:
    """What DriftLogger kept per step (summary_sample), e.g. 'a uniform 0.1% draw, plus per step the worst
    sequence by |ΣΔ| and the 256 tokens of largest |Δ|'; '' when no run logged a sample record."""
    where, params = run_filter(check_runs(runs))
    rows = store.rows(f"SELECT DISTINCT token_sample, worst_sequences, top_tokens FROM summary_sample "
                      f"WHERE {where} AND token_sample < 1 ORDER BY ALL", params)
    if len(rows) != 1:  # none, or runs logged with different settings: the counts above say enough
        return ""
    rate, worst, top = rows[0]
    if rate == 0:
        return "these runs logged summaries only"
    seqs = "the worst sequence" if worst == 1 else f"the {worst} worst sequences"
    return f"a uniform {share_text(rate)} draw, plus per step {seqs} by |ΣΔ| and the {top} tokens of largest |Δ|"


# -- thinning: token-level what-ifs on large selections read every k-th step -----------------------------------

THIN_TOKENS = 4_000_000  # a token-level what-if (decomposition, correction simulator) reads about this many tokens


@dataclass(frozen=True)
class StepThinning:
    """Which steps a token-level what-if reads: all (stride 1, steps None) or every stride-th step of each range."""
    stride: int
    steps: tuple[int, ...] | None
    n_total: int  # tokens the summaries count in the selection
    n_read: int  # of those, tokens of the steps read

    def label(self) -> str | None:
        """'estimated from every 10th step (4.0M of 40.0M tokens)'; None when every step is read."""
        if self.steps is None:
            return None
        return (f"estimated from every {_ordinal(self.stride)} step ({count_text(self.n_read)} of "
                f"{count_text(self.n_total)} tokens)")


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def thin_steps(store: Store, runs: Sequence[str], ranges: Sequence[tuple[int, int] | None],
               budget: int | None = None) -> StepThinning:
    """Steps of `runs` to read so that a token-level what-if over the step `ranges` (inclusive; None = all steps)
    reads about `budget` tokens (default THIN_TOKENS): every step when the selection holds no more, else every k-th step of each range
    from its first step, k = ⌈tokens / budget⌉ (each range keeps at least one step; the token count per step comes
    from the summaries, so choosing costs nothing)."""
    budget = THIN_TOKENS if budget is None else budget
    where, params = run_filter(check_runs(runs))
    per_step = dict(store.rows(f"SELECT step, sum(n_tokens)::BIGINT FROM summary_step WHERE {where} "
                               f"GROUP BY step HAVING sum(n_tokens) > 0 ORDER BY step", params))
    chosen = [[st for st in per_step if r is None or ((r[0] is None or st >= r[0]) and (r[1] is None or st <= r[1]))]
              for r in ranges]
    union = sorted({st for c in chosen for st in c})
    total = sum(per_step[st] for st in union)
    stride = max(1, math.ceil(total / budget)) if budget > 0 else 1
    if stride == 1:
        return StepThinning(1, None, total, total)
    kept = sorted({st for c in chosen for st in c[::stride]})
    return StepThinning(stride, tuple(kept), total, sum(per_step[st] for st in kept))


__all__ = ["sample_label", "sample_parts", "count_text", "share_text", "thin_steps", "StepThinning", "THIN_TOKENS"]
