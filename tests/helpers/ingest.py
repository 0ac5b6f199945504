"""Small seeded logs as rows (tokens and routing of both sides), the brute-force check of what ingest derives
from their routing, and the stored tables that one view reads, each as one relation."""
from __future__ import annotations

import numpy as np

from analysis import schema

# The packed table and its twin for files not in key order (schema.KEY_RUN) as one
PACKED = f"(SELECT * FROM {schema.ROUTING_PACKED_STORE} UNION ALL SELECT * FROM {schema.ROUTING_PACKED_LOOSE})"
# Every stored routing table as one (the packed ones lack the wide table's list and weight columns)
STORED = f"(SELECT * FROM {schema.ROUTING_STORE} UNION ALL BY NAME SELECT * FROM {PACKED})"
# The narrow table and its twin for files not in key order (schema.KEY_RUN) as one
NARROW = f"(SELECT * FROM {schema.TOKEN_STORE} UNION ALL SELECT * FROM {schema.TOKEN_STORE_LOOSE})"


def make_logs(seed=0, run="r", steps=2, samples=3, length=4, layers=3, k=2, experts=8):
    """Seeded token and routing rows (dicts of columns) with a few real flips and reordered-but-equal sets."""
    rng = np.random.default_rng(seed)
    keys = [(s, b, p) for s in range(steps) for b in range(samples) for p in range(length)]
    n = len(keys)
    s = -rng.exponential(1.0, n)
    t = np.minimum(0.0, s + rng.normal(0, 0.05, n))
    tokens = {"run": [run] * n, "step": [k_[0] for k_ in keys], "sample": [k_[1] for k_ in keys],
              "pos": [k_[2] for k_ in keys], "token_id": rng.integers(0, 1000, n).tolist(),
              "token": [f"t{i}'\"<b>" for i in range(n)], "sampler_logprob": s.tolist(), "trainer_logprob": t.tolist(),
              "sampler_version": [k_[0] for k_ in keys], "trainer_version": [k_[0] + 1 for k_ in keys]}
    rows = []
    for (st_, b, p) in keys:
        for layer in range(layers):
            se = rng.choice(experts, k, replace=False).tolist()
            u = rng.random()
            te = se[::-1] if u < 0.3 else (se[:-1] + [next(e for e in range(experts) if e not in se)]
                                           if u < 0.5 else list(se))
            rows.append({"run": run, "step": st_, "sample": b, "pos": p, "layer": layer,
                         "sampler_experts": se, "trainer_experts": te})
    return tokens, rows


def check_derived(store, rows):
    """flip / top1_flip / n_common / expert_load against a brute-force Python reference."""
    got = store.rows("SELECT step, sample, pos, layer, flip, top1_flip, n_common, k FROM routing ORDER BY ALL")
    want = sorted((r["step"], r["sample"], r["pos"], r["layer"], set(r["sampler_experts"]) != set(r["trainer_experts"]),
                   r["sampler_experts"][0] != r["trainer_experts"][0],
                   len(set(r["sampler_experts"]) & set(r["trainer_experts"])), len(r["sampler_experts"])) for r in rows)
    assert got == want
    assert any(w[4] for w in want) and not all(w[4] for w in want)
    load = {}
    for r in rows:
        for side, key in ((0, "sampler_experts"), (1, "trainer_experts")):
            for e in r[key]:
                load.setdefault((r["step"], r["layer"], e), [0, 0])[side] += 1
    got_load = store.rows("SELECT step, layer, expert, sum(n_sampler)::BIGINT, sum(n_trainer)::BIGINT "
                          "FROM expert_load GROUP BY ALL ORDER BY ALL")
    assert got_load == sorted((k[0], k[1], k[2], v[0], v[1]) for k, v in load.items())


def summaries_by_sql(monkeypatch, by_sql: bool = True) -> None:
    """Make every tokens file's summaries come from ingest's SQL over its stored rows (analysis/ingest/summarise.py)
    instead of the kernel that streams with the batches: the stream is told to give up just before its rows
    would be kept, which takes the load's own fallback path."""
    if not by_sql:
        return
    from analysis.ingest.file_rows import FileRows
    keep = FileRows.keep_summaries

    def given_up(self, tx):
        if self.summaries is not None:
            self.summaries._give_up("the test asks for the SQL")
        return keep(self, tx)
    monkeypatch.setattr(FileRows, "keep_summaries", given_up)
