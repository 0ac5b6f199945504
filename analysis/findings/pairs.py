"""Runs read against a partner run: a trainer-vs-trainer rerun of a run's tokens, and the same configuration run
with another routing-replay mode (docs/DIAGNOSIS.md, "Against a partner run").

- trainer_self: `ingest FILES --pair-of RUN` stores {"pair_of": RUN, "pair_kind": "trainer_self"} in the rerun's
  config. Its Δ is the trainer against itself on RUN's tokens (two batch sizes, two chunkings): the part of RUN's
  mismatch the engine is not needed for (TRL #6789: 8.0 % of tokens outside r ∈ [0.9, 1.1] from trainer chunking
  alone, 7.5 % against the engine).
- replay: runs whose config has `replay` = none | ids | ids+weights and is otherwise the same (apart from the
  run's labels, PAIR_LABELS) form a group; against the group's `none` runs, each replay mode's kl_k3 removed and
  what remains, with the remaining mismatch's signatures (findings/residual.py) and flip rate (miles #2722:
  mean |Δ| 0.369 with natural routing, 0.139 with ids-only replay).
"""
from __future__ import annotations

import json
from typing import Sequence

import polars as pl

from analysis.findings import residual
from analysis.metrics import dashboard
from analysis.store import Store

TRAINER_SELF = "trainer_self"
REPLAY_MODES = ("none", "ids", "ids+weights")
# config keys that name a run rather than set it up: two runs differing only there (and in replay) are a pair
PAIR_LABELS = ("replay", "preset", "name", "run", "pair_of", "pair_kind")
OUTSIDE_CLIP = 0.1  # clip_frac at ε = 0.1: the share of tokens with r outside [0.9, 1.1] (TRL #6789)


def run_configs(store: Store) -> dict[str, dict]:
    """{run: its config} for every run of the database, from one query."""
    out = {}
    for run, text in store.runs().select("run", "config").iter_rows():
        try:
            cfg = json.loads(text) if text else {}
        except (TypeError, ValueError):
            cfg = {}
        out[run] = cfg if isinstance(cfg, dict) else {}
    return out


def trainer_self_runs(store: Store, configs: dict[str, dict] | None = None) -> dict[str, list[str]]:
    """{run: the runs ingested as its trainer-vs-trainer rerun (config pair_of = run, pair_kind = trainer_self)},
    for the runs that have one (and are in the database)."""
    configs = run_configs(store) if configs is None else configs
    out: dict[str, list[str]] = {}
    for run, cfg in configs.items():
        of = cfg.get("pair_of")
        if cfg.get("pair_kind") == TRAINER_SELF and isinstance(of, str) and of in configs and of != run:
            out.setdefault(of, []).append(run)
    return {k: sorted(v) for k, v in out.items()}


def trainer_self_table(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None,
                       configs: dict[str, dict] | None = None) -> pl.DataFrame:
    """Per (run of `runs` with a trainer-vs-trainer rerun, rerun): the engine's and the trainer's own kl_k3,
    log_ratio_abs_mean and share of tokens outside r ∈ [0.9, 1.1] (clip_frac at ε = 0.1), their token counts, and
    self_share = kl_k3 of the rerun / kl_k3 of the run (null when the run's is 0). A rerun given for a run is read
    whichever runs are selected."""
    pairs = trainer_self_runs(store, configs)
    wanted = [(r, p) for r in runs for p in pairs.get(r, [])]
    schema = {"run": pl.String, "trainer_self_run": pl.String, "n_tokens": pl.Int64, "n_tokens_self": pl.Int64,
              "kl_k3": pl.Float64, "kl_k3_self": pl.Float64, "self_share": pl.Float64,
              "log_ratio_abs_mean": pl.Float64, "log_ratio_abs_mean_self": pl.Float64,
              "outside_0_9_1_1": pl.Float64, "outside_0_9_1_1_self": pl.Float64}
    if not wanted:
        return pl.DataFrame(schema=schema)
    every = sorted({x for pair in wanted for x in pair})
    summary = {r["run"]: r for r in dashboard.run_summary(store, every, clip=OUTSIDE_CLIP, steps=steps)
               .iter_rows(named=True)}
    rows = []
    for run, other in wanted:
        a, b = summary.get(run), summary.get(other)
        if a is None or b is None:
            continue
        share = b["kl_k3"] / a["kl_k3"] if a["kl_k3"] else None
        rows.append({"run": run, "trainer_self_run": other, "n_tokens": a["n_tokens"], "n_tokens_self": b["n_tokens"],
                     "kl_k3": a["kl_k3"], "kl_k3_self": b["kl_k3"], "self_share": share,
                     "log_ratio_abs_mean": a["log_ratio_abs_mean"], "log_ratio_abs_mean_self": b["log_ratio_abs_mean"],
                     "outside_0_9_1_1": a["clip_frac"], "outside_0_9_1_1_self": b["clip_frac"]})
    return pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)


def has_partners(store: Store, runs: Sequence[str]) -> bool:
    """Whether some run of `runs` has a trainer-vs-trainer rerun or a replay group (what Compare's Pairs tab
    shows)."""
    configs = run_configs(store)
    return bool(set(runs) & set(trainer_self_runs(store, configs))) or bool(replay_groups(store, runs, configs))


def replay_mode(config: dict | None) -> str | None:
    """The run's routing-replay mode (config `replay`: none, ids or ids+weights, any case), or None when the config
    does not say. A boolean (the lab's before it had three modes) says too little: true may be either replay."""
    v = (config or {}).get("replay")
    if isinstance(v, str) and v.strip().lower() in REPLAY_MODES:
        return v.strip().lower()
    return None


def pairing_key(config: dict | None) -> str:
    """What two runs of one replay group share: the config without its PAIR_LABELS, as canonical JSON."""
    return json.dumps({k: v for k, v in (config or {}).items() if k not in PAIR_LABELS}, sort_keys=True, default=str)


def replay_groups(store: Store, runs: Sequence[str],
                  configs: dict[str, dict] | None = None) -> list[dict[str, list[str]]]:
    """The replay groups holding some run of `runs`: {mode: its runs} over every run of the database whose config
    has a replay mode, grouped by pairing_key; only groups with at least two modes, one of them none."""
    configs = run_configs(store) if configs is None else configs
    groups: dict[str, dict[str, list[str]]] = {}
    for run, cfg in configs.items():
        mode = replay_mode(cfg)
        if mode is not None:
            groups.setdefault(pairing_key(cfg), {}).setdefault(mode, []).append(run)
    chosen = set(runs)
    return [{m: sorted(g[m]) for m in REPLAY_MODES if m in g} for g in groups.values()
            if "none" in g and len(g) >= 2 and chosen & {r for rs in g.values() for r in rs}]


def replay_table(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None,
                 configs: dict[str, dict] | None = None) -> pl.DataFrame:
    """Per run of each replay group that holds one of `runs` (replay_groups): its mode, the group's none runs
    (baseline), kl_k3 and that of the baseline (the mean over its none runs), kl_k3_removed = baseline − kl_k3,
    removed_share = kl_k3_removed / baseline, remaining_share = kl_k3 / baseline (null when the baseline is 0),
    log_ratio_abs_mean, token_any_flip_rate, and the remaining mismatch's signatures: first_token_kl_share,
    lattice_share (non-zero multiples of 0.125), boundary_low_share, elsewhere_low_share (residual.py)."""
    schema = {"group": pl.Int64, "run": pl.String, "replay": pl.String, "baseline": pl.String,
              "kl_k3": pl.Float64, "kl_k3_baseline": pl.Float64, "kl_k3_removed": pl.Float64,
              "removed_share": pl.Float64, "remaining_share": pl.Float64, "log_ratio_abs_mean": pl.Float64,
              "token_any_flip_rate": pl.Float64, "first_token_kl_share": pl.Float64, "lattice_share": pl.Float64,
              "boundary_low_share": pl.Float64, "elsewhere_low_share": pl.Float64}
    groups = replay_groups(store, runs, configs)
    every = sorted({r for g in groups for rs in g.values() for r in rs})
    if not every:
        return pl.DataFrame(schema=schema)
    summary = {r["run"]: r for r in dashboard.run_summary(store, every, steps=steps).iter_rows(named=True)}
    sig = {r["run"]: r for r in residual.signature_table(store, every, steps=steps).iter_rows(named=True)}
    rows = []
    for i, g in enumerate(groups):
        base = [summary[r]["kl_k3"] for r in g["none"] if r in summary and summary[r]["kl_k3"] is not None]
        ref = sum(base) / len(base) if base else None
        for mode, members in g.items():
            for run in members:
                s, t = summary.get(run), sig.get(run) or {}
                if s is None:
                    continue
                k = s["kl_k3"]
                rows.append({"group": i, "run": run, "replay": mode, "baseline": ", ".join(g["none"]), "kl_k3": k,
                             "kl_k3_baseline": ref,
                             "kl_k3_removed": None if ref is None or k is None else ref - k,
                             "removed_share": (ref - k) / ref if ref and k is not None else None,
                             "remaining_share": k / ref if ref and k is not None else None,
                             "log_ratio_abs_mean": s["log_ratio_abs_mean"],
                             "token_any_flip_rate": s.get("token_any_flip_rate"),
                             **{c: t.get(c) for c in ("first_token_kl_share", "lattice_share", "boundary_low_share",
                                                      "elsewhere_low_share")}})
    return pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)
