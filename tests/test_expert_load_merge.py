"""Expert-load counts summed across batches while a routing file streams (keys.StepCounts): each (run, step,
layer, expert) once and in order for a file in key order, appended as they are; the partial counts of a file out
of order are regrouped in the database to the same exact counts. References: plain Python counts."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import ingest_paths
from analysis.ingest.keys import StepCounts, TableKeys, expert_load, run_codes
from analysis.ingest.limits import Limits
from analysis.store import Store, Writer

from helpers.ingest import check_derived, make_logs


def _routing(seed: int, steps: int, tokens: int, layers: int, k: int, experts: int, shuffle: bool = False):
    """Routing rows in key order (step, token, layer) or shuffled, with sampler and trainer expert matrices."""
    rng = np.random.default_rng(seed)
    n = steps * tokens * layers
    step = np.repeat(np.arange(steps, dtype=np.int64) * 3 + 5, tokens * layers)  # gaps between steps
    pos = np.tile(np.repeat(np.arange(tokens, dtype=np.int64), layers), steps)
    layer = np.tile(np.arange(layers, dtype=np.int64), steps * tokens)
    S = np.argsort(rng.random((n, experts)), axis=1)[:, :k].astype(np.int64)
    T = np.argsort(rng.random((n, experts)), axis=1)[:, :k].astype(np.int64)
    order = rng.permutation(n) if shuffle else np.arange(n)
    data = pa.table({"run": ["r"] * n, "step": step[order], "sample": np.zeros(n, np.int64), "pos": pos[order],
                     "layer": layer[order]})
    return data, S[order], T[order]


def _reference(data: pa.Table, S: np.ndarray, T: np.ndarray) -> dict:
    counts: dict = {}
    for i, (st, la) in enumerate(zip(data.column("step").to_pylist(), data.column("layer").to_pylist())):
        for side, M in ((0, S), (1, T)):
            for e in M[i]:
                c = counts.setdefault(("r", st, la, int(e)), [0, 0])
                c[side] += 1
    return counts


def _stream(data, S, T, cuts, counts: StepCounts) -> list[pa.Table]:
    keys = TableKeys("routing")
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        part = data.slice(a, b - a)
        keys.add(part)
        staged = counts.add(expert_load(part, S[a:b], T[a:b], np.arange(b - a), run_codes(part.column("run"))),
                            keys.ordered)
        if staged is not None:
            out.append(staged)
    last = counts.finish()
    return out + ([last] if last is not None else [])


@pytest.mark.parametrize("seed", range(6))
def test_batches_of_a_file_in_key_order_give_each_key_once_summed_and_in_order(seed):
    rng = np.random.default_rng(100 + seed)
    data, S, T = _routing(seed, steps=5, tokens=7, layers=3, k=2, experts=6)
    n = data.num_rows
    # batch boundaries anywhere, some batches within one step, some spanning several
    cuts = [0] + sorted(set(rng.integers(1, n, size=int(rng.integers(1, 20))).tolist())) + [n]
    counts = StepCounts()
    rows = pa.concat_tables(_stream(data, S, T, cuts, counts))
    assert counts.merged
    got = list(zip(*(rows.column(c).to_pylist() for c in ("run", "step", "layer", "expert"))))
    assert len(got) == len(set(got))  # each key once
    assert got == sorted(got)  # in (step, layer, expert) order, as the database stores them
    want = _reference(data, S, T)
    assert {key: [a, b] for key, a, b in zip(got, rows.column("n_sampler").to_pylist(),
                                            rows.column("n_trainer").to_pylist())} == want


def test_one_batch_per_file_and_batches_inside_one_step():
    data, S, T = _routing(7, steps=2, tokens=6, layers=2, k=3, experts=8)
    n = data.num_rows
    for cuts in ([0, n], list(range(0, n, 5)) + [n], [0, 1, 2, n - 1, n]):
        counts = StepCounts()
        rows = pa.concat_tables(_stream(data, S, T, cuts, counts))
        keys = list(zip(*(rows.column(c).to_pylist() for c in ("run", "step", "layer", "expert"))))
        assert counts.merged and len(keys) == len(set(keys)) == len(_reference(data, S, T))


def test_a_file_out_of_order_passes_partial_counts_through():
    data, S, T = _routing(8, steps=3, tokens=5, layers=2, k=2, experts=5, shuffle=True)
    n = data.num_rows
    counts = StepCounts()
    rows = pa.concat_tables(_stream(data, S, T, list(range(0, n, 4)) + [n], counts))
    assert not counts.merged
    total: Counter = Counter()
    for key, a, b in zip(zip(*(rows.column(c).to_pylist() for c in ("run", "step", "layer", "expert"))),
                         rows.column("n_sampler").to_pylist(), rows.column("n_trainer").to_pylist()):
        total[key, 0] += a
        total[key, 1] += b
    assert {k: [total[k, 0], total[k, 1]] for k, _ in total} == _reference(data, S, T)
    # a file that turns out of order after merged batches keeps what it held: nothing is lost at the switch
    data2, S2, T2 = _routing(9, steps=3, tokens=4, layers=2, k=2, experts=5)
    order = np.r_[np.arange(10), np.arange(n := data2.num_rows)[:9:-1]]  # in order, then backwards
    counts = StepCounts()
    rows = pa.concat_tables(_stream(data2.take(pa.array(order)), S2[order], T2[order], [0, 6, 10, 14, n], counts))
    assert not counts.merged
    assert sum(rows.column("n_sampler").to_pylist()) == n * 2 == sum(rows.column("n_trainer").to_pylist())


@pytest.mark.parametrize("batch_rows", [7, 64, 100_000])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ingest_stores_exact_expert_load_and_regroups_only_out_of_key_order(tmp_path, monkeypatch, batch_rows,
                                                                          shuffle):
    tokens, rows = make_logs(seed=5, steps=3, samples=4, length=5, layers=4, k=3, experts=16)
    if shuffle:
        rows = [rows[i] for i in np.random.default_rng(1).permutation(len(rows))]
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    calls = []
    regroup = Writer.regroup_expert_load

    def spy(self, file_id):
        calls.append(file_id)
        return regroup(self, file_id)
    monkeypatch.setattr(Writer, "regroup_expert_load", spy)
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"],
                       limits=Limits(batch_rows=batch_rows))
    assert [o.status for o in out] == ["loaded", "loaded"]
    assert len(calls) == shuffle
    check_derived(store, rows)  # expert_load against a brute-force count
    assert store.scalar("SELECT count(*) FROM (SELECT DISTINCT run, step, layer, expert FROM expert_load)") == \
        store.scalar("SELECT count(*) FROM expert_load")
    assert store.rows("SELECT DISTINCT file_id FROM expert_load") == \
        store.rows("SELECT file_id FROM files WHERE name = 'routing.parquet'")
