"""Expert load per (step, layer) and side, by every definition an engine or trainer logs (METRICS.md, "Expert load").

Read from the `expert_load` aggregate (tokens per run, step, layer, expert and side, written at ingest), never from
the routing rows, so a view costs what the steps × layers × experts cost. The formulas are numpy over a dense cube
[step, layer, expert] of counts; zero-load experts are the zeros of that cube.

Who logs which definition (our own code below; the engines' lines cited for the reader):
- vLLM EPLB `balancedness` = mean / max of tokens per EP rank (vllm/distributed/eplb/eplb_state.py @50feac95,
  EplbState.step: `balancedness = avg_tokens / max_tokens`, summed over layers before the division) and SGLang's
  "[Expert Balancedness]" utilisation (sglang python/sglang/srt/eplb/expert_distribution.py @02295fe5,
  compute_utilization_rate: (avg + 1e-5) / (max + 1e-5) of GPU physical counts per layer) → `rank_balancedness`.
- TensorRT-LLM `imbalance-ratio` = max / mean − 1 over ranks per layer and iteration
  (examples/wide_ep/ep_load_balancer/report_load_statistics.py:13-14 @aa71b35b; a replicated expert's tokens are
  divided evenly over its slots there, lines 74-78) → `rank_imbalance`.
- verl `rollout/moe/max_vio` and Tinker `e_max_violation` = (max − fair) / fair over all experts →
  `load_max_vio_all`. prime-rl's `max_vio` first drops the top_k most loaded experts (as padding), then takes
  (max − mean) / mean over the rest (PrimeIntellect-ai/prime-rl src/prime_rl/trainer/model.py:574-577 @559b4477,
  get_load_balance_stats) → `load_max_vio_primerl`, where k is known (config `top_k`, else the routing rows').
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from analysis.store import Store
from analysis.summaries.sql import run_filter

SIDES = ("sampler", "trainer")
EXPERT_COLUMNS = ("load_max_vio", "load_max_vio_all", "load_cv", "load_entropy_norm", "load_hot_experts")
RANK_COLUMNS = ("rank_balancedness", "rank_imbalance", "straggler")
HOT_FACTOR = 2.0  # an expert is hot above twice its fair share


@dataclass(frozen=True)
class Cube:
    """Counts of one run: n[side][step_i, layer_i, expert] (float64), with the step and layer labels."""
    steps: np.ndarray
    layers: np.ndarray
    n: dict[str, np.ndarray]
    n_experts: int
    n_experts_source: str  # "config", "given" or "seen"
    top_k: int | None = None  # for prime-rl's max_vio (run_top_k)

    def sides(self) -> list[str]:
        """The sides with any count (the trainer's is all zeros where it was not recorded)."""
        return [s for s in SIDES if self.n[s].any()]


@dataclass(frozen=True)
class Placement:
    """Physical slots per layer → logical expert, slots split contiguously over `n_ranks` ranks.

    slots[l, s] = the expert in slot s at layer index l (one row broadcast to every layer when slots is 1-D).
    A replicated expert (in several slots) has its tokens split evenly over its slots."""
    slots: np.ndarray
    n_ranks: int
    source: str = "contiguous"

    def __post_init__(self):
        n_slots = self.slots.shape[-1]
        if self.n_ranks < 1 or n_slots % self.n_ranks:
            raise ValueError(f"a placement of {n_slots} slots cannot be split over {self.n_ranks} ranks evenly")

    @staticmethod
    def contiguous(n_experts: int, ep_size: int) -> "Placement":
        if n_experts % ep_size:
            raise ValueError(f"ep_size {ep_size} does not divide the {n_experts} experts")
        return Placement(np.arange(n_experts), ep_size)

    def layer_slots(self, li: int) -> np.ndarray:
        return self.slots if self.slots.ndim == 1 else self.slots[li]


# -- the definitions, on arrays -------------------------------------------------------------------------------

def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, NaN where b == 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1.0), np.nan)


def expert_columns(c: np.ndarray, drop_k: int | None = None) -> dict[str, np.ndarray]:
    """Every expert-level definition over the last axis of counts c[..., n] (n = all experts of the model), and
    with `drop_k` prime-rl's max_vio without the drop_k most loaded experts (load_max_vio_primerl).

    NaN where the group has no tokens (and load_entropy_norm where n = 1)."""
    c = np.asarray(c, dtype=np.float64)
    n = c.shape[-1]
    total = c.sum(-1)
    mean = total / n
    seen = c > 0
    n_seen = seen.sum(-1)
    mean_seen = _div(total, n_seen.astype(np.float64))
    mx = c.max(-1)
    p = c / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
    std = np.sqrt(((c - mean[..., None]) ** 2).mean(-1))
    empty = total == 0
    out = {
        "load_max_vio": _div(mx - mean_seen, mean_seen),
        "load_max_vio_all": _div(mx - mean, mean),
        "load_cv": _div(std, mean),
        "load_entropy_norm": np.where(empty | (n < 2), np.nan, h / np.log(n) if n > 1 else np.nan),
        "load_hot_experts": np.where(empty, np.nan, (c > HOT_FACTOR * mean[..., None]).sum(-1)),
    }
    if drop_k is not None and 0 < drop_k < n:
        rest = -np.sort(-c, axis=-1)[..., drop_k:]
        m = rest.mean(-1)
        out["load_max_vio_primerl"] = np.where(empty, np.nan, _div(rest.max(-1) - m, m))
    return out


def rank_counts(c: np.ndarray, slots: np.ndarray, n_ranks: int) -> np.ndarray:
    """Tokens per rank from counts per logical expert c[..., n] and one layer's slots[S] → [..., n_ranks].

    Each expert's tokens are split evenly over its replicas (its slots); an expert in no slot is not counted."""
    slots = np.asarray(slots)
    replicas = np.bincount(slots, minlength=c.shape[-1]).astype(np.float64)
    per_slot = c[..., slots] / replicas[slots]
    return per_slot.reshape(*per_slot.shape[:-1], n_ranks, -1).sum(-1)


def rank_columns(r: np.ndarray) -> dict[str, np.ndarray]:
    """rank_balancedness, rank_imbalance, straggler over the last axis of tokens per rank r[..., R]."""
    r = np.asarray(r, dtype=np.float64)
    mean, mx = r.mean(-1), r.max(-1)
    straggler = _div(mx, mean)
    return {"rank_balancedness": _div(mean, mx), "rank_imbalance": straggler - 1.0, "straggler": straggler}


# -- the counts, from the store -------------------------------------------------------------------------------

def run_n_experts(store: Store, run: str) -> int | None:
    """The run's config key `n_experts` (run.json), if it is a positive integer."""
    v = store.run_config(run).get("n_experts")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def run_top_k(store: Store, run: str) -> int | None:
    """k of the run's top-k routing: config `top_k`, else the routing summaries' (one k per run), else None."""
    v = store.run_config(run).get("top_k")
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    ks = store.rows("SELECT DISTINCT k FROM summary_layer WHERE run = ? AND k IS NOT NULL", [run])
    return int(ks[0][0]) if len(ks) == 1 else None


def run_ep_size(store: Store, run: str) -> int | None:
    v = store.run_config(run).get("ep_size")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def counts_cube(store: Store, run: str, steps: tuple[int, int] | None = None,
                n_experts: int | None = None, layers: list[int] | None = None) -> Cube:
    """The run's expert_load as dense counts [step, layer, expert] per side (files summed).

    n_experts: given, else the run's config `n_experts`, else the number of experts seen in the run (any step,
    layer or side); an expert id at or above it is an error (the config or the argument is wrong)."""
    where, params = run_filter([run], steps)
    if layers:
        where += " AND list_contains($layers, layer)"
        params["layers"] = [int(x) for x in layers]
    # the rows as stored (several per key where several files hold counts of it), summed below in numpy: a
    # GROUP BY over the ~0.8M rows of a 400-step, 32-layer, 64-expert run took 0.3 s, the sums 20 ms
    df = store.sql(f"""SELECT step, layer, expert, n_sampler, n_trainer FROM expert_load WHERE {where}""", params)
    source = "given" if n_experts else "config"
    n_experts = n_experts or run_n_experts(store, run)
    seen, top = store.rows("SELECT count(DISTINCT expert), max(expert) FROM expert_load WHERE run = ?", [run])[0]
    if not n_experts:  # the experts seen; ids with gaps count up to the highest
        source, n_experts = "seen", max(int(seen or 0), int(top) + 1 if top is not None else 0)
    if not n_experts:
        raise ValueError(f"run {run!r} has no expert load: log its routing (sampler_experts / trainer_experts) or "
                         "load an engine's expert-load dump for it")
    width = int(n_experts)
    if top is not None and top >= n_experts:
        raise ValueError(f"run {run!r} has expert id {top}, but n_experts is {n_experts} ({source}): ids go from "
                         f"0 to n_experts − 1; set `n_experts` in the run's config or pass the right one")
    # labels by hashing (polars), indices by binary search into the few labels: np.unique's sort of every row
    # cost 0.1-0.3 s
    step_v = np.sort(df["step"].unique().to_numpy()) if df.height else np.zeros(0, np.int64)
    layer_v = np.sort(df["layer"].unique().to_numpy()) if df.height else np.zeros(0, np.int64)
    si = np.searchsorted(step_v, df["step"].to_numpy())
    li = np.searchsorted(layer_v, df["layer"].to_numpy())
    shape = (len(step_v), len(layer_v), width)
    flat = (si * shape[1] + li) * width + df["expert"].to_numpy().astype(np.int64) if df.height else None
    n = {}
    for side, col in (("sampler", "n_sampler"), ("trainer", "n_trainer")):
        if flat is None:
            n[side] = np.zeros(shape)
            continue
        w = df[col].fill_null(0).to_numpy().astype(np.float64)
        n[side] = np.bincount(flat, weights=w, minlength=int(np.prod(shape))).reshape(shape)
    return Cube(step_v, layer_v, n, int(n_experts), source, run_top_k(store, run))


def stored_placement(store: Store, run: str, layers: np.ndarray) -> tuple[np.ndarray, int | None] | None:
    """The placement logged or uploaded for the run (table expert_placement: slot → expert per layer, with the
    number of ranks where the dump said it) as (slots[layer index, slot] for the given layers, n_ranks or None);
    None without one. A layer without rows keeps the first layer's."""
    df = store.sql("""SELECT layer, slot, expert, n_ranks FROM expert_placement WHERE run = $run
                      ORDER BY layer, slot""", {"run": run})
    if df.is_empty():
        return None
    by_layer = {int(k[0]): g["expert"].to_numpy() for k, g in df.group_by("layer", maintain_order=True)}
    n_ranks = df["n_ranks"].drop_nulls()
    first = next(iter(by_layer.values()))
    if any(len(v) != len(first) for v in by_layer.values()):
        raise ValueError(f"run {run!r}: the stored placement has layers with different numbers of slots")
    slots = np.stack([by_layer.get(int(layer), first) for layer in layers]) if len(layers) else first[None]
    return slots, int(n_ranks[0]) if n_ranks.len() else None


def run_placement(store: Store, run: str, cube: Cube, ep_size: int | None = None,
                  placement: Placement | None = None) -> Placement | None:
    """The placement the rank columns use: given, else stored for the run (ranks: ep_size given or configured,
    else the dump's), else contiguous blocks over ep_size (given, else config `ep_size`); None when the ranks
    are unknown."""
    ep = ep_size or run_ep_size(store, run)
    if placement is None:
        stored = stored_placement(store, run, cube.layers)
        if stored is not None and (ep or stored[1]):
            placement = Placement(stored[0], ep or stored[1], "stored")
    if placement is None:
        return Placement.contiguous(cube.n_experts, ep) if ep else None
    if placement.slots.size and (placement.slots.min() < 0 or placement.slots.max() >= cube.n_experts):
        raise ValueError(f"run {run!r}: the placement names expert {int(placement.slots.max())}, but the run has "
                         f"{cube.n_experts} experts ({cube.n_experts_source})")
    return placement


# -- the tables -----------------------------------------------------------------------------------------------

def load_table(store: Store, run: str, steps: tuple[int, int] | None = None, n_experts: int | None = None,
               ep_size: int | None = None, placement: Placement | None = None) -> pl.DataFrame:
    """Every load column per (step, layer) and side: [run, step, layer, n_experts, <column>_<side>...].

    Expert columns over all n experts (zero-load ones included; load_max_vio over the experts seen;
    load_max_vio_primerl where top_k is known); rank
    columns where a placement is known (given, stored, or contiguous over ep_size), else absent. A side without
    tokens at (step, layer) gives nulls. `straggler_step_<side>` = Σ_layers max_r c_r / Σ_layers mean_r c_r: the
    step's expert-parallel MoE time over its perfectly balanced time, when every layer waits for its slowest
    rank (the reciprocal of vLLM's logged balancedness)."""
    cube = counts_cube(store, run, steps, n_experts)
    place = run_placement(store, run, cube, ep_size, placement)
    return table_of(run, cube, place)


def table_of(run: str, cube: Cube, place: Placement | None) -> pl.DataFrame:
    """load_table's frame from counts already read (a page reads the cube once for several views)."""
    S, L = len(cube.steps), len(cube.layers)
    cols: dict[str, object] = {
        "run": [run] * (S * L),
        "step": np.repeat(cube.steps, L).astype(np.int64),
        "layer": np.tile(cube.layers, S).astype(np.int64),
        "n_experts": np.full(S * L, cube.n_experts, dtype=np.int64),
    }
    for side in SIDES:
        for name, v in expert_columns(cube.n[side], cube.top_k).items():
            cols[f"{name}_{side}"] = v.reshape(-1)
        if place is not None:
            r = rank_array(cube.n[side], place)
            for name, v in rank_columns(r).items():
                cols[f"{name}_{side}"] = v.reshape(-1)
            with np.errstate(invalid="ignore"):
                step_f = _div(r.max(-1).sum(-1), r.mean(-1).sum(-1))
            cols[f"straggler_step_{side}"] = np.repeat(step_f, L)
    df = pl.DataFrame(cols)
    return df.with_columns(pl.col(pl.Float64).fill_nan(None)).with_columns(
        pl.col(f"load_hot_experts_{s}").cast(pl.Int64) for s in SIDES)


def rank_array(c: np.ndarray, place: Placement) -> np.ndarray:
    """Tokens per rank [step, layer, rank] of counts c[step, layer, expert] under a placement."""
    return np.stack([rank_counts(c[:, li, :], place.layer_slots(li), place.n_ranks)
                     for li in range(c.shape[1])], axis=1) if c.shape[1] else np.zeros((c.shape[0], 0, place.n_ranks))
