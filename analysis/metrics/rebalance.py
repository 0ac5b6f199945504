"""Rebalancing what-if: where would a load balancer put the experts, and how balanced would the next steps be?

Our own hierarchical replicate-and-pack (the problem DeepSeek's EPLB solves, deepseek-ai/EPLB eplb.py @d52c72d5,
`rebalance_experts`; none of its code): given token counts per expert over a fitting window,
1. expert groups (contiguous blocks of experts) go to nodes, the same number of groups per node, heaviest group
   first onto the lightest node that still has room (so that replicas never cross the slow inter-node link);
2. within a node, the node's slots are shared out: each extra slot goes to the expert with the largest load per
   replica (a heap; this minimises the largest load per replica);
3. the replicas (each carrying load / replicas) are packed onto the node's GPUs, the same number per GPU, heaviest
   first onto the lightest GPU with room, preferring a GPU that holds no replica of the same expert.
Small nodes (few experts and slots: `EXACT_LIMIT` candidates) are solved exactly instead: every replica count and
packing is tried, and the one whose GPU loads sorted from the largest are smallest (lexicographically) wins.

The placement is then judged on the *next* window of steps (a forecast: counts it was not fitted on), against the
static placement (experts in contiguous blocks over the GPUs, no replicas), by rank_imbalance = max/mean − 1 of
tokens per GPU (metrics/load.py, a replica's tokens split evenly).
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from analysis.metrics import load as L
from analysis.store import Store

EXACT_LIMIT = 50_000  # candidate (replica counts × packings) per node tried exhaustively; above: the greedy


@dataclass(frozen=True)
class Plan:
    """slots[s] = logical expert of physical slot s; slot s sits on GPU s // slots_per_gpu, node gpu // gpus_per_node."""
    slots: np.ndarray
    n_gpus: int
    exact: bool


def _check(n_experts: int, n_slots: int, n_groups: int, n_nodes: int, n_gpus: int) -> None:
    rules = [(n_slots >= n_experts, f"{n_slots} slots cannot hold {n_experts} experts"),
             (n_gpus >= 1 and n_nodes >= 1 and n_groups >= 1, "groups, nodes and GPUs must be at least 1"),
             (n_experts % n_groups == 0, f"{n_groups} groups do not divide {n_experts} experts"),
             (n_groups % n_nodes == 0, f"{n_nodes} nodes do not divide {n_groups} groups"),
             (n_gpus % n_nodes == 0, f"{n_nodes} nodes do not divide {n_gpus} GPUs"),
             (n_slots % n_gpus == 0, f"{n_gpus} GPUs do not divide {n_slots} slots")]
    for ok, why in rules:
        if not ok:
            raise ValueError(why)


def _pack_greedy(loads: np.ndarray, bins: int, per_bin: int, tags: np.ndarray | None = None) -> np.ndarray:
    """Bin of each item: heaviest first onto the lightest bin with room (and, where `tags` are given, without an
    item of the same tag if such a bin has room). Returns bin[item]."""
    out = np.empty(len(loads), np.int64)
    total, count = np.zeros(bins), np.zeros(bins, np.int64)
    held: list[set] = [set() for _ in range(bins)]
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        room = [b for b in range(bins) if count[b] < per_bin]
        if tags is not None:
            fresh = [b for b in room if tags[i] not in held[b]]
            room = fresh or room
        b = min(room, key=lambda b: (total[b], b))
        out[i] = b
        total[b] += loads[i]
        count[b] += 1
        if tags is not None:
            held[b].add(tags[i])
    return out


def _replicas_greedy(w: np.ndarray, n_slots: int) -> np.ndarray:
    """Replicas per expert: every expert one, each extra slot to the expert with the largest load per replica."""
    cnt = np.ones(len(w), np.int64)
    heap = [(-w[e], e) for e in range(len(w))]
    heapq.heapify(heap)
    for _ in range(n_slots - len(w)):
        _, e = heapq.heappop(heap)
        cnt[e] += 1
        heapq.heappush(heap, (-w[e] / cnt[e], e))
    return cnt


def _compositions(extra: int, n: int):
    """Every way of giving `extra` identical slots to n experts."""
    for cut in itertools.combinations(range(extra + n - 1), n - 1):
        prev, out = -1, []
        for c in cut + (extra + n - 1,):
            out.append(c - prev - 1)
            prev = c
        yield out


def _packings(n_items: int, bins: int, per_bin: int):
    """Every split of items 0..n−1 into `bins` unlabelled bins of `per_bin` each (each split once)."""
    assign = [-1] * n_items
    count = [0] * bins

    def go(i: int, used: int):
        if i == n_items:
            yield list(assign)
            return
        for b in range(min(used + 1, bins)):
            if count[b] < per_bin:
                assign[i], count[b] = b, count[b] + 1
                yield from go(i + 1, max(used, b + 1))
                count[b] -= 1
        assign[i] = -1
    yield from go(0, 0)


def _n_candidates(n_exp: int, n_slots: int, bins: int) -> int:
    """How many (replica counts, packing) pairs the exact search would try (exact integers: no overflow)."""
    per = n_slots // bins
    comps = math.comb(n_slots - 1, n_exp - 1)  # ways to give the n_slots − n_exp extra slots to n_exp experts
    packs = math.factorial(n_slots) // (math.factorial(per) ** bins * math.factorial(bins))
    return comps * packs


def _node_exact(w: np.ndarray, n_slots: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica counts and packing minimising the GPU loads sorted from the largest (lexicographically)."""
    per = n_slots // bins
    best = None
    for cnt in _compositions(n_slots - len(w), len(w)):
        items = np.repeat(np.arange(len(w)), np.asarray(cnt) + 1)
        loads = (w / (np.asarray(cnt) + 1))[items]
        for assign in _packings(n_slots, bins, per):
            tot = np.zeros(bins)
            np.add.at(tot, assign, loads)
            key = tuple(np.round(np.sort(tot)[::-1], 9))
            if best is None or key < best[0]:
                best = (key, items, np.asarray(assign))
    return best[1], best[2]


def _node_plan(w: np.ndarray, n_slots: int, bins: int, exact: bool | None) -> tuple[np.ndarray, bool]:
    """Local slots of one node: expert (local index) per slot, slots ordered GPU by GPU."""
    per = n_slots // bins
    use_exact = exact if exact is not None else _n_candidates(len(w), n_slots, bins) <= EXACT_LIMIT
    if use_exact:
        items, gpu = _node_exact(w, n_slots, bins)
    else:
        cnt = _replicas_greedy(w, n_slots)
        items = np.repeat(np.arange(len(w)), cnt)
        gpu = _pack_greedy((w / cnt)[items], bins, per, tags=items)
    order = np.lexsort((items, gpu))  # GPU by GPU, experts ascending within a GPU
    return items[order], use_exact


def rebalance(weight: np.ndarray, n_slots: int, n_groups: int, n_nodes: int, n_gpus: int,
              exact: bool | None = None) -> Plan:
    """A placement of one layer's experts (loads `weight[E]`) on n_slots slots over n_gpus GPUs in n_nodes nodes.

    exact: True / False force the exhaustive search / the greedy per node; None picks by size (EXACT_LIMIT)."""
    w = np.asarray(weight, dtype=np.float64)
    E = len(w)
    _check(E, n_slots, n_groups, n_nodes, n_gpus)
    gsize, per_node = E // n_groups, n_groups // n_nodes
    group_load = w.reshape(n_groups, gsize).sum(1)
    node_of_group = _pack_greedy(group_load, n_nodes, per_node)
    slots, all_exact = [], True
    for node in range(n_nodes):
        experts = np.concatenate([np.arange(g * gsize, (g + 1) * gsize) for g in np.flatnonzero(node_of_group == node)])
        local, was_exact = _node_plan(w[experts], n_slots // n_nodes, n_gpus // n_nodes, exact)
        slots.append(experts[local])
        all_exact &= was_exact
    return Plan(np.concatenate(slots), n_gpus, all_exact)


def imbalance(counts: np.ndarray, slots: np.ndarray, n_gpus: int) -> float:
    """rank_imbalance (max/mean − 1 of tokens per GPU) of counts[E] under slots; NaN without tokens."""
    r = L.rank_counts(np.asarray(counts, dtype=np.float64), np.asarray(slots), n_gpus)
    return float(L.rank_columns(r)["rank_imbalance"])


# -- over a run ------------------------------------------------------------------------------------------------

def what_if(store: Store, run: str, n_slots: int, n_nodes: int, n_gpus: int, n_groups: int | None = None,
            layers: list[int] | None = None, window: int | None = None, steps: tuple[int, int] | None = None,
            n_experts: int | None = None, side: str = "sampler") -> tuple[pl.DataFrame, dict[int, np.ndarray]]:
    """Fit on the first `window` steps of the run's (selected) steps, forecast on the `window` steps after them.

    window: default half the steps. n_groups: default n_nodes. Returns ([layer, fit_steps, forecast_steps,
    static_fit, rebalanced_fit, static_forecast, rebalanced_forecast, exact], {layer: the plan's slots}); the
    imbalances are rank_imbalance of the summed counts of each window."""
    if side not in L.SIDES:
        raise ValueError(f"side must be one of {', '.join(L.SIDES)}")
    cube = L.counts_cube(store, run, steps, n_experts, layers)
    step_v = cube.steps
    if len(step_v) < 2:
        raise ValueError(f"run {run!r} has {len(step_v)} step(s) of expert load here: the what-if needs at least "
                         "two (one to fit, one to forecast)")
    w = window or len(step_v) // 2
    if not 1 <= w < len(step_v):
        raise ValueError(f"--window {w}: needs 1 ≤ window < {len(step_v)} (the steps with expert load)")
    fit, nxt = cube.n[side][:w].sum(0), cube.n[side][w:2 * w].sum(0)
    static = np.arange(cube.n_experts)
    if cube.n_experts % n_gpus:
        raise ValueError(f"{n_gpus} GPUs do not divide the {cube.n_experts} experts (the static placement)")
    rows, plans = [], {}
    for li, layer in enumerate(cube.layers):
        plan = rebalance(fit[li], n_slots, n_groups or n_nodes, n_nodes, n_gpus)
        plans[int(layer)] = plan.slots
        rows.append({"layer": int(layer), "fit_steps": f"{step_v[0]}-{step_v[w - 1]}",
                     "forecast_steps": f"{step_v[w]}-{step_v[min(2 * w, len(step_v)) - 1]}",
                     "static_fit": imbalance(fit[li], static, n_gpus),
                     "rebalanced_fit": imbalance(fit[li], plan.slots, n_gpus),
                     "static_forecast": imbalance(nxt[li], static, n_gpus),
                     "rebalanced_forecast": imbalance(nxt[li], plan.slots, n_gpus), "exact": plan.exact})
    return pl.DataFrame(rows), plans
