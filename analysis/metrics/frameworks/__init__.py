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

_never = lambda p, *a: None


@dataclass(frozen=True)
class View:
    name: str
    source: str                      # repository @ commit the definitions were read at
    defaults: dict
    check: Callable[[dict], dict]
    view: Callable[..., dict] | None  # (sequence columns, inputs.Groups, params) -> {column: one value a group}
    logprobs: bool | Callable[[dict], bool]  # whether the view reads Σ s, Σ t, ... (summary_seq's SEQ_SUMS)
    cap: Callable[[dict], float | tuple] = lambda p: 2.0  # the ratio bands' C, or (lo, hi) bounds on band edges
    # which ratio-band columns it reads: per sequence (True), only summed over a group's sequences ("group": from
    # the per-step Δ histogram) or none (False)
    bands: Callable[[dict], bool | str] = lambda p: True
    signs: Callable[[dict], bool] = lambda p: False  # whether it reads Σ (r − 1) either side of 0 (rm1_pos, rm1_neg)
    token_sql: Callable = _never     # (params, WHERE over tokens) -> (per-sequence SQL, its parameters) or None
    below: Callable = _never         # params -> ln τ: count per sequence the tokens with Δ < ln τ (`n_below`)
    rewards: Callable = lambda p: False  # whether it reads `reward` of table sequences
    only: tuple | None = None        # the TOKEN_SUMS of summary_seq it reads (None: all); fewer is a faster scan


VIEWS: dict[str, View] = {v.name: v for v in (
    View("verl", "volcengine/verl@b178a3cd", verl.DEFAULTS, verl.check, verl.trainer_view, True,
         cap=lambda p: float(p["rollout_is_threshold"]), bands=lambda p: p["rollout_is"] == "token" and "group",
         token_sql=verl.token_sql, below=verl.below, only=verl.READS),
    View("verl-actor", "volcengine/verl@b178a3cd", verl.DEFAULTS, verl.check, verl.actor_view, True,
         bands=lambda p: False, only=("sum_k3",)),
    View("nemo", "NVIDIA-NeMo/RL@7ea279ab", nemo.DEFAULTS, nemo.check, nemo.view, True,
         cap=nemo.cap, bands=nemo.bands, rewards=nemo.rewards, only=("sum_d2", "sum_k3", "sum_k3r", "sum_mpe")),
    View("prime-rl", "PrimeIntellect-ai/prime-rl@559b4477", primerl.DEFAULTS, primerl.check, None, False),
    View("slime", "THUDM/slime@624b824a", slime.DEFAULTS, slime.check, slime.view, slime.logprobs,
         cap=slime.cap, bands=slime.bands, signs=lambda p: p["tis_function"] != "mis", below=slime.below,
         only=("sum_abs_d", "sum_k3")),
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


def framework_table(store: Store, runs: Sequence[str], name: str, by: str = "step",
                    params: Mapping[str, object] | None = None,
                    steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, (step,) n_tokens, n_sequences, <the framework's metric names>...] per group.

    Example: `framework_table(store, ["r"], "verl")["rollout_corr/k3_kl"]` is verl's k3_kl per step.
    """
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    runs = sorted(set(check_runs(runs)))  # rows in run-name order
    p = resolve_params(name, params)
    v = VIEWS[name]
    keys = ["run", "step"] if by == "step" else ["run"]
    if v.view is None:
        return primerl.table(store, runs, keys, steps, p)
    logprobs = v.logprobs(p) if callable(v.logprobs) else v.logprobs
    q = inputs.sequence_arrays(store, runs, steps, v.cap(p), logprobs=logprobs, bands=v.bands(p), signs=v.signs(p),
                               only=v.only)
    inputs.token_columns(store, runs, steps, q, lambda where: v.token_sql(p, where), v.below(p), v.rewards(p))
    q["_step"] = q["step"]
    # the sequences come sorted by (run, step, sample): each group is a slice, and every column is reduced over
    # all groups at once (a loop over groups cost ~0.3 ms a group: 0.12 s for 400 steps)
    starts = inputs.group_starts(q, ["_run", "step"] if by == "step" else ["_run"])
    if starts.size < 2:
        return pl.DataFrame(schema={**{k: (pl.String if k == "run" else pl.Int64) for k in keys},
                                    "n_tokens": pl.Int64, "n_sequences": pl.Int64})
    g = inputs.Groups(starts)
    # one value per group: columns built from lists (a polars Series from a numpy array imports numpy.ma,
    # ~10 ms of a command's start)
    cols = {"run": pl.Series("run", [runs[i] for i in q["_run"][g.first].tolist()], pl.String)}
    if by == "step":
        cols["step"] = pl.Series("step", q["step"][g.first].tolist(), pl.Int64)
    cols |= {"n_tokens": pl.Series("n_tokens", g.add(q["n"]).round().astype(np.int64).tolist(), pl.Int64),
             "n_sequences": pl.Series("n_sequences", g.count.astype(np.int64).tolist(), pl.Int64)}
    cols |= {k: pl.Series(k, np.asarray(x, dtype=np.float64).tolist(), pl.Float64)
             for k, x in v.view(q, g, p).items()}
    return pl.DataFrame(cols)


__all__ = ["FRAMEWORKS", "VIEWS", "framework_table", "parse_param_args", "resolve_params"]
