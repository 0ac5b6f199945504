"""Framework views (`metrics --as FRAMEWORK`): the numbers a framework's dashboard would show for the same
tokens, one column per metric it logs, named as it logs them, computed by its conventions at a cited commit.

Our own columns (METRICS.md) stay ours; these are not columns of ours. Each module cites the framework's
file:line@commit beside every definition. Group = a step (`by="step"`: one batch, one logged value) or a run
(`by="run"`: the framework's function applied to all the run's sequences as one batch; verl-actor reduces all
the run's micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import polars as pl

from analysis.metrics.frameworks import inputs, nemo, primerl, slime, verl
from analysis.store import Store
from analysis.summaries.sql import check_runs


@dataclass(frozen=True)
class View:
    name: str
    source: str                      # repository @ commit the definitions were read at
    defaults: dict
    check: Callable[[dict], dict]
    view: Callable[..., dict] | None  # one group's sequences -> {column: value}; None: a token-row table
    logprobs: bool                   # whether the view reads Σ s, Σ t, ... from the token rows
    cap: Callable[[dict], float] = lambda p: 2.0


VIEWS: dict[str, View] = {v.name: v for v in (
    View("verl", "volcengine/verl@b178a3cd", verl.DEFAULTS, verl.check, verl.trainer_view, True,
         lambda p: float(p["rollout_is_threshold"])),
    View("verl-actor", "volcengine/verl@b178a3cd", verl.DEFAULTS, verl.check, verl.actor_view, True),
    View("nemo", "NVIDIA-NeMo/RL@7ea279ab", nemo.DEFAULTS, nemo.check, nemo.view, True),
    View("prime-rl", "PrimeIntellect-ai/prime-rl@559b4477", primerl.DEFAULTS, primerl.check, None, False),
    View("slime", "THUDM/slime@624b824a", slime.DEFAULTS, slime.check, slime.view, False,
         lambda p: float(p["tis_clip"])),
)}
FRAMEWORKS = tuple(VIEWS)


def _value(text: str, default):
    if isinstance(default, bool):
        low = str(text).strip().lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true or false, got {text!r}")
        return low in ("true", "1", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    return str(text).strip()


def resolve_params(name: str, params: Mapping[str, object] | None = None) -> dict:
    """The view's parameters: its defaults overridden by `params` (values as text or typed)."""
    if name not in VIEWS:
        raise ValueError(f"unknown framework {name!r}; expected one of {', '.join(FRAMEWORKS)}")
    v = VIEWS[name]
    p = dict(v.defaults)
    for key, value in (params or {}).items():
        if key not in v.defaults:
            known = ", ".join(v.defaults) or "none"
            raise ValueError(f"--as {name} has no parameter {key!r} (parameters: {known})")
        try:
            p[key] = _value(value, v.defaults[key]) if isinstance(value, str) else value
        except ValueError as e:
            raise ValueError(f"--param {key}={value}: {e}") from None
    return v.check(p)


def parse_param_args(items: Sequence[str]) -> dict[str, str]:
    """['K=V', ...] -> {K: V} (the values stay text; resolve_params types them)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--param takes K=V, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def group_starts(seqs: pl.DataFrame, keys: list[str]) -> np.ndarray:
    """[0, the first row of each later group, height] of a frame sorted by `keys`."""
    if not seqs.height:
        return np.zeros(1, np.int64)
    change = np.zeros(seqs.height, bool)
    change[0] = True
    for k in keys:
        col = seqs[k]
        change[1:] |= (col[1:] != col[:-1]).to_numpy()
    return np.append(np.flatnonzero(change), seqs.height)


def framework_table(store: Store, runs: Sequence[str], name: str, by: str = "step",
                    params: Mapping[str, object] | None = None,
                    steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, (step,) n_tokens, n_sequences, <the framework's metric names>...] per group.

    Example: `framework_table(store, ["r"], "verl")["rollout_corr/k3_kl"]` is verl's k3_kl per step.
    """
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    runs = check_runs(runs)
    p = resolve_params(name, params)
    v = VIEWS[name]
    keys = ["run", "step"] if by == "step" else ["run"]
    if v.view is None:
        return primerl.table(store, runs, keys, steps)
    seqs = inputs.sequence_inputs(store, runs, steps, v.cap(p), logprobs=v.logprobs)
    # the sequences come sorted by (run, step, sample): each group is a slice of the columns, converted once
    # (a group_by with a conversion per group cost ~0.5 ms a group: 0.25 s for 400 steps)
    q_all = inputs.arrays(seqs)
    q_all["_step"] = seqs["step"].to_numpy()
    starts = group_starts(seqs, keys)
    rows = []
    for a, b in zip(starts[:-1], starts[1:]):
        q = {k: x[a:b] for k, x in q_all.items()}
        row = {k: seqs[k][int(a)] for k in keys}
        row |= {"n_tokens": int(q["n"].sum()), "n_sequences": int(b - a)}
        row |= v.view(q, p)
        rows.append(row)
    if not rows:
        return pl.DataFrame(schema={**{k: (pl.String if k == "run" else pl.Int64) for k in keys},
                                    "n_tokens": pl.Int64, "n_sequences": pl.Int64})
    df = pl.DataFrame(rows, infer_schema_length=None)
    return df.with_columns(pl.col(c).cast(pl.Float64) for c in df.columns if c not in (*keys, "n_tokens",
                                                                                        "n_sequences"))


__all__ = ["FRAMEWORKS", "VIEWS", "framework_table", "parse_param_args", "resolve_params"]
