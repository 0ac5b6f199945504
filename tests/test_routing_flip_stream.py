"""Per-token flip summaries from the rows ingest stages while a routing file streams (keys.routing_tokens): a
token's layers may be split over two read batches, some tokens have no trainer side at all and some only at
some layers. The stored summary rows equal a reference computed here in plain Python from the rows written, and
equal those of the SQL that groups the stored (token, layer) rows (the path of files not in key order)."""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis.ingest import ingest_paths, load
from analysis.ingest.limits import Limits
from analysis.store import Store, Writer

from helpers.ingest import make_logs

FLIP_STEP = ("n_routed", "n_any_flip", "sum_flipped_layers", "sum_abs_d_flip", "sum_abs_d_noflip")


def logs():
    tokens, rows = make_logs(seed=11, steps=3, samples=3, length=5, layers=4, k=3)
    for r in rows:
        # no trainer side: every layer of the tokens at pos 1, the odd layers of those at pos 3
        if r["pos"] == 1 or (r["pos"] == 3 and r["layer"] % 2):
            r["trainer_experts"] = None
    return tokens, rows


def reference(tokens, rows):
    """Per token (n_both, n_fl, first_flip) and the summary rows they make, in plain Python."""
    per = {}
    for r in rows:
        key = (r["step"], r["sample"], r["pos"])
        n_both, n_fl, first = per.get(key, (0, 0, None))
        if r["trainer_experts"] is not None:
            n_both += 1
            if set(r["trainer_experts"]) != set(r["sampler_experts"]):
                n_fl += 1
                first = r["layer"] if first is None else min(first, r["layer"])
        per[key] = (n_both, n_fl, first)
    delta = {(st, b, p): t - s for st, b, p, s, t in zip(tokens["step"], tokens["sample"], tokens["pos"],
                                                         tokens["sampler_logprob"], tokens["trainer_logprob"])}
    step, seq, first_layer = {}, {}, {}
    for (st, b, p), (n_both, n_fl, first) in per.items():
        if not n_both:
            continue
        row = step.setdefault(st, [0, 0, 0, 0.0, 0.0])
        row[0] += 1
        row[1] += n_fl > 0
        row[2] += n_fl
        row[3 if n_fl else 4] += abs(delta[(st, b, p)])
        seq[(st, b)] = seq.get((st, b), 0) + (n_fl > 0)
        if first is not None:
            first_layer[(st, first)] = first_layer.get((st, first), 0) + 1
    return step, seq, first_layer


def stored(store):
    step = {r[0]: list(r[1:]) for r in store.rows(
        f"SELECT step, {', '.join(FLIP_STEP)} FROM summary_step WHERE n_routed IS NOT NULL ORDER BY step")}
    seq = {(r[0], r[1]): r[2] for r in store.rows(
        "SELECT step, sample, n_flip_tokens FROM summary_seq WHERE n_flip_tokens IS NOT NULL")}
    first = {(r[0], r[1]): r[2] for r in store.rows(
        "SELECT step, layer, n_first_flip FROM summary_layer WHERE n_first_flip > 0")}
    return step, seq, first


def load_files(tmp_path, name, batch_rows, shuffle=False):
    tokens, rows = logs()
    if shuffle:  # not in key order: the routing rows are summarised by the SQL
        rows = [rows[i] for i in np.random.default_rng(3).permutation(len(rows))]
    d = tmp_path / name
    d.mkdir()
    pq.write_table(pa.table(tokens), d / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), d / "routing.parquet")
    store = Store(d / "db.duckdb")
    out = ingest_paths(store, [d / "tokens.parquet", d / "routing.parquet"], limits=Limits(batch_rows=batch_rows))
    assert [o.status for o in out] == ["loaded", "loaded"], [o.line() for o in out]
    return store, tokens, rows


@pytest.mark.parametrize("batch_rows", [7, 10_000])  # 7: most tokens' 4 layers span two batches
def test_streamed_flip_counts_equal_the_reference(tmp_path, batch_rows, monkeypatch):
    staged = []
    real = load.summaries.add_routing

    def spy(w, fid, routed=None):
        staged.append(routed)
        return real(w, fid, routed)
    monkeypatch.setattr(load.summaries, "add_routing", spy)
    store, tokens, rows = load_files(tmp_path, "s", batch_rows)
    assert staged == [load.ROUTED_TOKENS]  # the routing file, from its staged rows
    step, seq, first = stored(store)
    want_step, want_seq, want_first = reference(tokens, rows)
    assert 0 < sum(v[1] for v in want_step.values()) < sum(v[0] for v in want_step.values())  # some flips, not all
    assert step.keys() == want_step.keys()
    for st, row in step.items():
        assert row[:3] == want_step[st][:3]
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(row[3:], want_step[st][3:]))
    assert seq == want_seq
    assert first == want_first


def test_streamed_flip_counts_equal_the_sql_over_stored_rows(tmp_path, monkeypatch):
    a, _, _ = load_files(tmp_path, "a", 7)
    staged = []
    real = load.summaries.add_routing
    monkeypatch.setattr(load.summaries, "add_routing", lambda w, fid, routed=None: staged.append(routed)
                        or real(w, fid, routed))
    b, _, _ = load_files(tmp_path, "b", 7, shuffle=True)
    assert staged == [None]  # the routing file, by grouping its stored rows
    (step_a, seq_a, first_a), (step_b, seq_b, first_b) = stored(a), stored(b)
    assert seq_a == seq_b and first_a == first_b and step_a.keys() == step_b.keys()
    for st in step_a:
        assert step_a[st][:3] == step_b[st][:3]
        assert all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(step_a[st][3:], step_b[st][3:]))


@pytest.mark.parametrize("batch_rows", [1, 3, 7, 10_000])
def test_staged_tokens_are_one_row_per_token_whatever_the_batches(tmp_path, batch_rows, monkeypatch):
    """keys.TokenFlips: the staged rows hold each routed token once (its layers split over batches added up),
    with the counts of the plain Python reference."""
    seen = []
    real = Writer.drop_staged

    def spy(self, *names):
        if load.STAGED_TOKENS in self._staged:
            seen.extend(self.cur.execute(f"SELECT step, sample, pos, n_both, n_fl, first_flip "
                                         f"FROM {load.STAGED_TOKENS}").fetchall())
        return real(self, *names)
    monkeypatch.setattr(Writer, "drop_staged", spy)
    _, tokens, rows = load_files(tmp_path, "s", batch_rows)
    want = {}
    for r in rows:
        n_both, n_fl, first = want.get((r["step"], r["sample"], r["pos"]), (0, 0, None))
        if r["trainer_experts"] is not None:
            n_both += 1
            if set(r["trainer_experts"]) != set(r["sampler_experts"]):
                n_fl += 1
                first = r["layer"] if first is None else min(first, r["layer"])
        want[r["step"], r["sample"], r["pos"]] = (n_both, n_fl, first)
    assert len(seen) == len(want)  # one row per token
    assert {(a, b, c): (d, e, f) for a, b, c, d, e, f in seen} == want
