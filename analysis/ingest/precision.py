"""A log's precision floor: the smallest difference its numbers resolve, found at ingest and kept per file
(`files.precision_floor`), so that a metric below it is shown as "below the log's precision", not as a measurement.

Two sources, the coarser of which is the file's floor:
- a framework that documents its rounding sets it on the load unit (prime-rl writes `mismatch_kl` rounded to
  6 decimals: floor 1e-6, `frameworks/primerl_traces.py`);
- any token file: a log-prob column whose values (a sample of the file's first batch) are all whole multiples of
  10^-d for some d <= MAX_DECIMALS was written with d decimals; its floor is 10^-d / 2, the rounding error of
  one value. Values stored as float32 after the rounding are not whole multiples in double and are not detected.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

MAX_DECIMALS = 6  # beyond this, text written with d decimals and full float32 values can no longer be told apart
SAMPLE = 4096  # rows looked at per column: the check runs once per file, on its first token batch
MIN_VALUES = 16  # fewer non-zero values say nothing
TOLERANCE = 1e-6  # in units of 10^-d: text parsed to double is within ~1e-8 of the multiple for |value| <= 100

LOGPROB_COLUMNS = ("sampler_logprob", "trainer_logprob")


def decimals(values: np.ndarray) -> int | None:
    """The fewest decimals d (0..MAX_DECIMALS) such that every finite non-zero value of `values` (up to SAMPLE of
    them) is a whole multiple of 10^-d; None when there is no such d or too few values to tell."""
    v = np.asarray(values, dtype=np.float64)[:SAMPLE]
    head = _usable(v[:4 * MIN_VALUES])[:MIN_VALUES]  # full-precision values fail on these: a few microseconds
    if len(head) < MIN_VALUES:
        head = _usable(v)
        if len(head) < MIN_VALUES:
            return None
    rest = None
    for d in np.flatnonzero(_multiples(head)):  # the candidates, all d at once, then each on every value
        rest = _usable(v) if rest is None else rest
        if _multiples(rest, int(d)).all():
            return int(d)
    return None


def _usable(v: np.ndarray) -> np.ndarray:
    return v[np.isfinite(v) & (v != 0)]


_SCALES = 10.0 ** np.arange(MAX_DECIMALS + 1)


def _multiples(v: np.ndarray, d: int | None = None) -> np.ndarray:
    """Per d (all of 0..MAX_DECIMALS, or the one given): whether every value is a whole multiple of 10^-d."""
    scaled = v[:, None] * (_SCALES if d is None else _SCALES[d:d + 1])
    return np.all(np.abs(scaled - np.rint(scaled)) <= TOLERANCE, axis=0)


def rounding_floor(d: int) -> float:
    """The floor of values written with d decimals: half a unit of the last decimal."""
    return 0.5 * 10.0 ** -d


def logprob_floor(data: pa.Table) -> float | None:
    """The floor of a token batch's log-prob columns (the coarsest of the two), None where neither is rounded."""
    floors = []
    for name in LOGPROB_COLUMNS:
        if name in data.column_names:
            d = decimals(data.column(name).slice(0, SAMPLE).to_numpy(zero_copy_only=False))
            if d is not None:
                floors.append(rounding_floor(d))
    return max(floors) if floors else None


def coarsest(*floors: float | None) -> float | None:
    """The largest of the given floors (None ignored); None if none is given."""
    known = [f for f in floors if f is not None]
    return max(known) if known else None
