"""The compiled per-row routing work (analysis/ingest/routing_kernel.py) against plain Python sets, and the
ingest results it feeds: derived set columns, expert load, and the refusals of negative or repeated ids, for
ids below 64 (masks) and above (the sorting fallback)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import ingest_paths, keys, routing_kernel
from analysis.store import Store

from helpers.ingest import check_derived, make_logs


def _matrix(seed, n, k, experts, repeat_p=0.0, negative_p=0.0):
    rng = np.random.default_rng(seed)
    M = np.argsort(rng.random((n, experts)), axis=1)[:, :k].astype(np.int32)
    for i in np.flatnonzero(rng.random(n) < repeat_p):
        M[i, -1] = M[i, 0]
    for i in np.flatnonzero(rng.random(n) < negative_p):
        M[i, int(rng.integers(0, k))] = -1 - int(rng.integers(0, 5))
    return M


@pytest.mark.parametrize("experts,repeat_p,negative_p", [(64, 0, 0), (64, 0.01, 0), (64, 0.01, 0.005),
                                                        (40, 0, 0.01), (8, 0.02, 0)])
def test_set_masks_match_python_sets(experts, repeat_p, negative_p):
    M = _matrix(1, 5000, 6, experts, repeat_p, negative_p)
    masks, neg, rep, top = routing_kernel.set_masks(M)
    rows = [list(r) for r in M.tolist()]
    want_neg = next((i for i, r in enumerate(rows) if min(r) < 0), -1)
    want_rep = next((i for i, r in enumerate(rows) if len(set(e for e in r if e >= 0)) != sum(e >= 0 for e in r)), -1)
    assert (neg, rep, top) == (want_neg, want_rep, max(max(r) for r in rows))
    for i in range(0, len(rows), 97):
        assert int(masks[i]) == sum(1 << e for e in set(rows[i]) if e >= 0)


def test_compare_and_counts_match_python_sets():
    rng = np.random.default_rng(2)
    S = _matrix(3, 4000, 4, 64)
    rows = np.flatnonzero(rng.random(len(S)) < 0.7)
    T = S[rows].copy()
    for j in range(len(T)):
        u = rng.random()
        if u < 0.3:
            T[j] = T[j][::-1]
        elif u < 0.6:
            T[j, int(rng.integers(0, 4))] = next(e for e in range(64) if e not in S[rows[j]])
    flip, top1, same = (np.zeros(len(S), bool) for _ in range(3))
    common = np.zeros(len(S), np.int16)
    routing_kernel.compare(S, T, rows, routing_kernel.set_masks(S)[0], routing_kernel.set_masks(T)[0],
                           flip, top1, common, same)
    for j, i in enumerate(rows):
        s, t = S[i].tolist(), T[j].tolist()
        assert (flip[i], top1[i], common[i], same[i]) == (set(s) != set(t), s[0] != t[0], len(set(s) & set(t)), s == t)
    assert flip.any() and same.any() and not flip[np.setdiff1d(np.arange(len(S)), rows)].any()
    base = rng.integers(0, 10, len(S)) * 64
    out = np.zeros(10 * 64, np.int64)
    routing_kernel.count_experts(base, S, out)
    want = np.zeros_like(out)
    np.add.at(want, (base[:, None] + S).ravel(), 1)
    assert (out == want).all()


def _load(tmp_path, rows, tokens):
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    store = Store(tmp_path / "d.duckdb")
    return store, ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"])


@pytest.mark.parametrize("experts", [64, 160])  # masks (ids up to 63) and the sorting fallback
def test_ingest_derives_sets_and_load_either_way(tmp_path, experts):
    tokens, rows = make_logs(seed=9, steps=2, samples=3, length=5, layers=3, k=4, experts=experts)
    rows[0]["sampler_experts"][0] = experts - 1  # the largest id: bit 63 of a mask, or past it
    store, out = _load(tmp_path, rows, tokens)
    assert [o.status for o in out] == ["loaded", "loaded"], [o.line() for o in out]
    check_derived(store, rows)


@pytest.mark.parametrize("experts", [64, 160])
@pytest.mark.parametrize("fault,message", [("negative", "negative expert id in"),
                                           ("repeat", "expert ids repeat within one top-k")])
def test_bad_ids_are_refused_at_their_row(tmp_path, experts, fault, message):
    tokens, rows = make_logs(seed=10, steps=1, samples=2, length=4, layers=2, k=3, experts=experts)
    bad = 11
    side = "trainer_experts" if fault == "repeat" else "sampler_experts"
    ids = rows[bad][side]
    rows[bad][side] = [ids[0], ids[1], ids[0]] if fault == "repeat" else [ids[0], -3, ids[2]]
    store, out = _load(tmp_path, rows, tokens)
    assert out[1].status == "refused"
    assert out[1].message.startswith(f"routing.parquet: row {bad + 1}, column '{side}': {message}"), out[1].message
    assert store.scalar("SELECT count(*) FROM routing") == 0


@pytest.mark.parametrize("runs,steps", [(["r"], [3, 4, 9]), (["r", "q"], [0, 5000, 12])])
def test_expert_load_of_a_batch_counts_every_id(runs, steps):
    """One run and close steps (offsets, no hashing), or several runs and far-apart steps (dictionaries)."""
    rng = np.random.default_rng(4)
    n = 600
    run = rng.choice(runs, n)
    step = rng.choice(steps, n).astype(np.int64)
    layer = rng.integers(0, 3, n).astype(np.int32)
    S = _matrix(5, n, 2, 12)
    t_rows = np.flatnonzero(rng.random(n) < 0.6)
    T = _matrix(6, len(t_rows), 2, 12)
    data = pa.table({"run": pa.array(run, pa.string()), "step": step, "layer": layer})
    got = keys.expert_load(data, S, T, t_rows)
    want: dict[tuple, list[int]] = {}
    for side, (M, rows) in enumerate(((S, np.arange(n)), (T, t_rows))):
        for j, i in enumerate(rows):
            for e in M[j].tolist():
                want.setdefault((run[i], int(step[i]), int(layer[i]), e), [0, 0])[side] += 1
    rows = sorted(zip(*(got.column(c).to_pylist() for c in ("run", "step", "layer", "expert", "n_sampler",
                                                              "n_trainer"))))
    assert rows == sorted((*k, v[0], v[1]) for k, v in want.items())
