"""DriftLogger's trainer-side summaries equal the summaries ingest computes from every token, for any token_sample.

Reference: the same step logged with token_sample=1.0, its token and routing files stripped of the
`driftscope.summarised` mark and ingested, so that ingest's SQL (analysis/ingest/summarise.py) summarises
every token. The logger's own summary file is ingested into another database; both are merged per key (SUM of
counts and sums, MIN/MAX of extremes, as every reader merges them) and compared at rel 1e-12.
"""
from __future__ import annotations


import pyarrow.parquet as pq
import pytest
import torch

from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import schema as S

from helpers.logger import COMPARED, assert_same_rows, logger_store, make_step, merged, reference_store

@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
def test_summaries_equal_ingest_of_every_token(tmp_path, token_sample):
    data = make_step()
    ref = reference_store(tmp_path, data)
    got = logger_store(tmp_path, data, token_sample)
    for table in COMPARED:
        want = merged(ref, table)
        assert want, f"{table}: the reference has rows"  # the data exercises every table
        assert_same_rows(merged(got, table), want, table)
    # the token rows written are the sample, and no summary is computed from them again
    n = int(data["mask"].sum())
    kept = got.scalar("SELECT count(*) FROM tokens")
    assert got.scalar("SELECT sum(n_tokens) FROM summary_sample") == n
    assert got.scalar("SELECT sum(n_kept) FROM summary_sample") == kept
    assert got.scalar("SELECT count(*) FROM summary_skip") == (2 if token_sample > 0 else 0)
    if token_sample == 1.0:
        assert kept == n
    elif token_sample == 0.0:
        assert kept == 0 and got.scalar("SELECT count(*) FROM routing") == 0
    else:
        assert 0 < kept < n
        assert got.scalar("SELECT count(*) FROM routing") == kept * 3  # a kept token keeps all its layers


@pytest.mark.slow  # several databases built through ingest
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("routing", [None, "sampler", "both"])
def test_widths_and_routing_sides(tmp_path, dtype, routing):
    data = make_step(B=6, T=17, seed=3, dtype=dtype, routing=routing)
    ref = reference_store(tmp_path, data)
    got = logger_store(tmp_path, data, 0.0)
    for table in COMPARED:
        assert_same_rows(merged(got, table), merged(ref, table), table)


@pytest.mark.parametrize("chunk_rows", [None, 2])
def test_lag_buckets_from_per_token_versions(tmp_path, monkeypatch, chunk_rows):
    from analysis.record import summaries as logger_summaries
    if chunk_rows:
        monkeypatch.setattr(logger_summaries, "CHUNK_TOKENS", 9 * chunk_rows)
    data = make_step(B=5, T=9, seed=5, routing=None)
    g = torch.Generator().manual_seed(9)
    data["sampler_version"] = torch.randint(0, 4, (5, 9), generator=g)  # per token, and lags of both signs
    data["trainer_version"] = torch.full((5,), 2)
    ref = reference_store(tmp_path, data)
    got = logger_store(tmp_path, data, 0.0)
    lags = merged(got, "summary_bucket")
    assert {r["bucket"] for r in lags if r["dim"] == "lag"} == {-1, 0, 1, 2}
    assert_same_rows(lags, merged(ref, "summary_bucket"), "summary_bucket")


def test_empty_step_writes_no_summary_rows(tmp_path):
    data = make_step(B=3, T=4)
    data["mask"] = torch.zeros(3, 4)
    store = logger_store(tmp_path, data, 0.5)
    for table in COMPARED:
        assert merged(store, table) == [] or table in ("summary_layer", "expert_load")
    assert store.scalar("SELECT n_tokens FROM summary_sample") == 0


@pytest.mark.slow  # several databases built through ingest
def test_chunked_reduction_equals_reference(tmp_path, monkeypatch):
    """Steps larger than one chunk (here: 2 sequences per chunk) reduce to the same rows."""
    from analysis.record import summaries as logger_summaries
    data = make_step(B=7, T=30, seed=11)
    ref = reference_store(tmp_path, data)
    monkeypatch.setattr(logger_summaries, "CHUNK_TOKENS", 60)
    monkeypatch.setattr(logger_summaries, "ROUTING_CHUNK", 5)
    got = logger_store(tmp_path, data, 0.0)
    for table in COMPARED:
        assert_same_rows(merged(got, table), merged(ref, table), table)


def test_every_summary_column_is_written():
    """A column added to the summary format (analysis/summaries/schema.py) must be computed here too."""
    from analysis.record.summaries import EXTREMES, WIDE, token_terms
    assert set(WIDE) | set(EXTREMES) | {"max_abs_d"} == {c.name for c in S.TOKEN_SUMS}
    terms = token_terms(torch.tensor([-1.0], dtype=torch.float64), torch.tensor([-0.5], dtype=torch.float64))
    assert terms.V.shape == (len(WIDE), 1) and terms.X.shape == (len(EXTREMES), 1)


@pytest.mark.slow  # several databases built through ingest
def test_a_step_logged_by_two_ranks_merges_to_the_whole(tmp_path):
    """Two trainer ranks each log half of a step's sequences (own folders, distinct sample ids): the merged
    summaries equal those of one logger given the whole batch."""
    data = make_step(B=10, T=20, seed=21)
    whole = logger_store(tmp_path, data, 0.0, name="whole")
    for rank, rows in enumerate((slice(0, 4), slice(4, 10))):
        half = {k: (v[rows] if isinstance(v, torch.Tensor) and v.ndim >= 1 else v) for k, v in data.items()}
        DriftLogger(tmp_path / "ranks" / str(rank), "r", token_sample=0.05).log_step(4, **half)
    both = Store(tmp_path / "ranks.duckdb")
    outcomes = ingest_paths(both, [tmp_path / "ranks"])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    for table in COMPARED:
        assert_same_rows(merged(both, table), merged(whole, table), table)


def test_mask_with_holes_and_empty_rows(tmp_path, monkeypatch):
    """Trained positions anywhere in a row (not a prefix), rows with none, NaN at padding, 3 rows per chunk:
    padding adds nothing to any sum, extreme, position bucket or max_pos."""
    from analysis.record import summaries as logger_summaries
    data = make_step(B=8, T=16, seed=13)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(8, 16, generator=g) < 0.6
    mask[2] = False
    mask[5, 0] = False
    data["sampler_version"][2] = 100  # the empty row's lag lies outside the step's lags
    data["mask"] = mask
    for side in ("sampler_logprobs", "trainer_logprobs"):  # finite where trained, NaN elsewhere
        lp = data[side].nan_to_num(-1.0)
        lp[~mask] = float("nan")
        data[side] = lp
    ref = reference_store(tmp_path, data)
    monkeypatch.setattr(logger_summaries, "CHUNK_TOKENS", 48)
    got = logger_store(tmp_path, data, 0.0)
    for table in COMPARED:
        assert_same_rows(merged(got, table), merged(ref, table), table)
    assert 2 * 3 + 100 not in {r["sample"] for r in merged(got, "summary_seq")}


@pytest.mark.parametrize("run", ["bf16", "bf16-async"])  # routing flips of both sides; one version of staleness
def test_bundled_demo_summaries_equal_ingest_of_its_tokens(tmp_path, run):
    """data/demo carries DriftLogger's summary files, which the app's first start loads instead of summarising
    the tokens (no kernel to compile): they must still be what ingest computes from the demo's own token and
    routing files (a demo regenerated without them, or from other tokens, fails here)."""
    from analysis.ingest.demo import DEMO_DIR

    folder = DEMO_DIR / run
    summaries = sorted(folder.glob("summary-*.parquet"))  # one file of every step's rows (analysis/lab/pack.py)
    assert len(summaries) == 1, "no summary file: see data/demo/README.md"
    assert sorted(set(pq.read_table(summaries[0], columns=["step"])["step"].to_pylist())) == list(range(200))
    plain = tmp_path / "plain" / run
    plain.mkdir(parents=True)
    for f in sorted(folder.glob("tokens-*.parquet")) + sorted(folder.glob("routing-*.parquet")):
        pq.write_table(pq.read_table(f).replace_schema_metadata({}), plain / f.name)
    (plain / "run.json").write_bytes((folder / "run.json").read_bytes())
    ref = Store(tmp_path / "ref.duckdb")
    got = Store(tmp_path / "demo.duckdb")
    for store, path in ((ref, plain), (got, folder)):
        outcomes = ingest_paths(store, [path])
        assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    assert ref.scalar("SELECT count(*) FROM summary_skip") == 0  # every token summarised by ingest
    # one row per token file (tokens and routing, every step in one file): their summaries came in the summary file
    assert got.scalar("SELECT count(*) FROM summary_skip") == 2
    for table in COMPARED:
        want = merged(ref, table)
        assert want, f"{table}: the reference has rows"
        rows = merged(got, table)
        assert_same_rows(rows, want, table)
