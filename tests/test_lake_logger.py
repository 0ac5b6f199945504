"""DriftLogger(layout="lake"): each rank writes its full rows of a step into run=<run>/step=<n>/, and summarize of
that lake equals ingesting every one of its tokens."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from analysis.ingest import ingest_paths  # noqa: E402
from analysis.lake import partial  # noqa: E402
from analysis.lake.engines import run_local  # noqa: E402
from analysis.lake.layout import list_partitions  # noqa: E402
from analysis.record.logger import DriftLogger  # noqa: E402
from analysis.store import Store  # noqa: E402

from helpers import lake as lu  # noqa: E402

B, T, L, K, E = 4, 9, 3, 2, 8


def rank_step(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.25
    s = -torch.rand(B, T, generator=g) * 4
    t = (s + torch.randn(B, T, generator=g) * 0.05).clamp(max=0.0)
    se = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
    te = se.clone()
    flip = torch.rand(B, T, L, generator=g) < 0.3
    te[..., 0] = torch.where(flip, (se[..., 1] + 1 + torch.randint(0, E - 2, (B, T, L), generator=g)) % E, se[..., 0])
    te[..., 0] = torch.where(te[..., 0] == se[..., 1], se[..., 0], te[..., 0])  # keep ids distinct
    return dict(sampler_logprobs=s, trainer_logprobs=t, mask=mask, sampler_experts=se, trainer_experts=te,
                sample_ids=torch.arange(B) + rank * B, sampler_version=3, trainer_version=4)


def test_lake_layout_writes_one_file_per_rank_and_kind(tmp_path):
    lake = tmp_path / "lake"
    loggers = [DriftLogger(lake, "moe", config={"dtype": "bf16"}, layout="lake", rank=r) for r in range(2)]
    masks = {}
    for step in (0, 7):
        for rank, log in enumerate(loggers):
            d = rank_step(100 * step + rank, rank)
            masks[(step, rank)] = d["mask"]
            paths = log.log_step(step, **d)
            assert sorted(paths) == ["routing", "tokens"]
    listing = list_partitions(str(lake))
    assert listing.configs == {"moe": {"dtype": "bf16"}} and listing.problems == []
    assert [(p.step, [f.rsplit("/", 1)[1] for f in p.files]) for p in listing.partitions] == [
        (s, ["routing-r00000.parquet", "routing-r00001.parquet", "tokens-r00000.parquet", "tokens-r00001.parquet"])
        for s in (0, 7)]
    assert not list(lake.rglob(".*"))  # no temporary file left behind
    for (step, rank), mask in masks.items():
        rows = pq.read_table(lake / "run=moe" / f"step={step}" / f"tokens-r{rank:05d}.parquet")
        assert rows.num_rows == int(mask.sum())  # every trained token: the lake holds full logs
        assert set(rows.column("sample").to_pylist()) <= set(range(rank * B, rank * B + B))
        assert pq.read_table(lake / "run=moe" / f"step={step}" / f"routing-r{rank:05d}.parquet").num_rows \
            == rows.num_rows * L

    # summarize of the lake == ingesting every token of it
    results = list(run_local(str(lake), listing.partitions))
    got = {t: partial.merge(t, [r.tables[t] for r in results]) for t in partial.MERGED_TABLES
           if t != partial.SAMPLE_TABLE}
    store = Store(tmp_path / "direct.duckdb")
    assert {o.status for o in ingest_paths(store, [lake])} == {"loaded"}
    lu.assert_same_summaries(got, partial.summary_tables(store))
    assert np.sum(got["summary_layer"].column("n_flip").to_numpy()) > 0
    store.close()


def test_lake_layout_keeps_every_token(tmp_path):
    with pytest.raises(ValueError, match="token_sample=1.0"):
        DriftLogger(tmp_path, "r", layout="lake", token_sample=0.1)
    with pytest.raises(ValueError, match="layout"):
        DriftLogger(tmp_path, "r", layout="hive")
    with pytest.raises(ValueError, match="rank"):
        DriftLogger(tmp_path, "r", layout="lake", rank=-1)
