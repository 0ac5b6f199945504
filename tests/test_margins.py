"""METRICS.md v3 router margins: margin_mean_sampler / _trainer (by=layer) and flip_rate_by_margin, from
DriftLogger's summaries at token_sample 1.0, 0.1 and 0.0 and from sequence JSON Lines, against brute-force
references (tests/helpers/margins.py) at rel 1e-12; RouterCapture's margins from router logits; refusals."""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from analysis.ingest import ingest_paths
from analysis.metrics.routing import flip_rate_by_margin, flip_rate_by_margin_rows, routing_metrics
from analysis.record.capture import RouterCapture, response_margins
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries.margins import margin_bin

from helpers.fulldist import ingest_sequence_lines
from helpers.logger import make_step
from helpers.margins import EDGES, add_margins, by_margin, margin_means

STEPS = (2, 5)


def steps(sides=("sampler", "trainer")) -> dict[int, dict]:
    return {n: add_margins(make_step(B=10, T=14, L=3, K=2, E=5, seed=n), seed=n, sides=sides) for n in STEPS}


def close(got, want, what):
    assert got is not None and math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300), (what, got, want)


def check(store: Store, data: dict[int, dict], side: str = "sampler", rows: bool = True) -> None:
    """rows: the store holds every routing and token row (then the drill-down from rows agrees too)."""
    want = by_margin(list(data.values()), side)
    frames = [flip_rate_by_margin(store, ["r"])] + ([flip_rate_by_margin_rows(store, ["r"])] if rows else [])
    for df in frames:
        assert df["margin_bin"].to_list() == list(want), (df, want)
        assert set(df["side"]) == {side}
        for row in df.to_dicts():
            n, rate, abs_d = want[row["margin_bin"]]
            assert row["n_tokens"] == n
            close(row["flip_rate"], rate, ("flip_rate", row["margin_bin"]))
            close(row["log_ratio_abs_mean"], abs_d, ("abs_d", row["margin_bin"]))
            assert (row["margin_lo"], row["margin_hi"]) == (EDGES[row["margin_bin"]], EDGES[row["margin_bin"] + 1])
    layers = {(r["step"], r["layer"]): r for r in routing_metrics(store, ["r"], by="layer").to_dicts()}
    for n, d in data.items():
        means = margin_means(d)
        for layer in range(3):
            for s in ("sampler", "trainer"):
                got = layers[(n, layer)][f"margin_mean_{s}"]
                if (layer, s) in means:
                    close(got, means[(layer, s)], (n, layer, s))
                else:
                    assert got is None, (n, layer, s, got)
    # one step only: the bins add up that step's rows
    one = flip_rate_by_margin(store, ["r"], steps=(5, 5))
    assert one["n_tokens"].sum() == int(data[5]["mask"].sum()) * 3


@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
def test_logger_margins_equal_reference(tmp_path, token_sample):
    data = steps()
    log = DriftLogger(tmp_path / "logs", "r", token_sample=token_sample, worst_sequences=1, top_tokens=3)
    for n, d in data.items():
        log.log_step(n, **d)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    check(store, data, rows=token_sample == 1.0)
    if token_sample == 1.0:  # the stored margins are the inputs (fp32 in, fp32 stored)
        row = store.sql("SELECT sampler_margin, trainer_margin FROM routing WHERE step = 2 AND sample = 103 "
                        "AND pos = 1 AND layer = 2").to_dicts()[0]
        assert row["sampler_margin"] == float(data[2]["sampler_margins"][1, 1, 2])
        assert row["trainer_margin"] == float(data[2]["trainer_margins"][1, 1, 2])


def test_sequence_jsonl_margins_equal_reference(tmp_path):
    data = steps()
    check(ingest_sequence_lines(tmp_path, data), data)


def test_trainer_margins_alone_bin_by_the_trainer(tmp_path):
    """RouterCapture records the trainer's side: flip_rate_by_margin then bins by the trainer's margin."""
    data = steps(sides=("trainer",))
    log = DriftLogger(tmp_path / "logs", "r", token_sample=0.0)
    for n, d in data.items():
        log.log_step(n, **d)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    check(store, data, side="trainer", rows=False)


def test_runs_without_margins(tmp_path):
    data = {2: make_step(B=6, T=9, seed=2)}
    DriftLogger(tmp_path / "logs", "r", token_sample=1.0).log_step(2, **data[2])
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    assert flip_rate_by_margin(store, ["r"]).is_empty()
    assert flip_rate_by_margin_rows(store, ["r"]).is_empty()
    layers = routing_metrics(store, ["r"], by="layer")
    assert layers["margin_mean_sampler"].is_null().all() and layers["margin_mean_trainer"].is_null().all()


def test_margin_bins_on_the_edges():
    """Bins [E_b, E_b+1), the last closed; fp32(1e-4) lies below 1e-4."""
    m = np.array([0.0, 9.9e-5, 1e-4, 1e-3, 0.00999, 0.01, 0.1, 0.5, 1.0, float(np.float32(1e-4))])
    assert margin_bin(m).tolist() == [0, 0, 1, 2, 2, 3, 4, 4, 4, 0]


@pytest.mark.parametrize("change, message", [
    (lambda d: d.update(sampler_margins=d["sampler_margins"] * 0 + 1.5), r"sampler_margins\[0, 0, 0\] = 1.5"),
    (lambda d: d["trainer_margins"].__setitem__((1, 2, 1), float("nan")), r"trainer_margins\[1, 2, 1\] = nan"),
    (lambda d: d.update(sampler_margins=d["sampler_margins"][..., :2]), "expected shape"),
    (lambda d: d.pop("trainer_experts"), "trainer_margins: given without trainer_experts"),
    (lambda d: d.update(sampler_margins=(d["sampler_margins"] * 0).long()), "floating-point"),
])
def test_logger_refuses_bad_margins(tmp_path, change, message):
    d = steps()[2]
    change(d)
    with pytest.raises(ValueError, match=message):
        DriftLogger(tmp_path / "logs", "r").log_step(2, **d)
    assert not list((tmp_path / "logs" / "r").glob("*.parquet"))  # nothing written


def test_padding_margins_are_not_checked(tmp_path):
    d = steps()[2]
    pad = ~d["mask"].bool()
    d["sampler_margins"][pad] = float("nan")
    DriftLogger(tmp_path / "logs", "r").log_step(2, **d)


@pytest.mark.parametrize("extra, rule", [
    ({"sampler_margins": [[0.5, 0.5]] * 3}, "shape"),
    ({"trainer_margins": [[0.1, 0.2, 1.5]] * 3}, "in [0, 1]"),
    ({"sampler_margins": "x"}, "not numbers"),
])
def test_jsonl_refusals_name_the_line_and_rule(tmp_path, extra, rule):
    obj = {"run": "r", "step": 1, "sample": 0, "sampler_logprobs": [-0.5, -1.0, -0.1],
           "trainer_logprobs": [-0.4, -1.1, -0.1], "sampler_experts": [[[0, 1]] * 3] * 3,
           "trainer_experts": [[[1, 0]] * 3] * 3} | extra
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(obj) + "\n")
    store = Store(tmp_path / "db.duckdb")
    (o,) = ingest_paths(store, [path])
    assert o.status == "refused" and "line 1" in o.line() and rule in o.line(), o.line()
    assert store.scalar("SELECT count(*) FROM routing") == 0


def test_parquet_margin_without_trainer_experts_refused(tmp_path):
    """A routing Parquet file's trainer margin without the trainer's experts names the file, row and column."""
    t = pa.table({"run": ["r"] * 2, "step": [1, 1], "sample": [0, 0], "pos": [0, 0], "layer": [0, 1],
                  "sampler_experts": [[0, 1], [2, 3]], "trainer_experts": [[0, 1], None],
                  "trainer_margin": pa.array([0.3, 0.2], pa.float32())})
    tok = pa.table({"run": ["r"], "step": [1], "sample": [0], "pos": [0], "sampler_logprob": [-0.5],
                    "trainer_logprob": [-0.4]})
    pq.write_table(tok, tmp_path / "tokens.parquet")
    pq.write_table(t, tmp_path / "routing.parquet")
    store = Store(tmp_path / "db.duckdb")
    outcomes = {o.name: o for o in ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"])}
    bad = outcomes["routing.parquet"]
    assert bad.status == "refused" and "row 2" in bad.line() and "trainer_margin" in bad.line(), bad.line()


class _Block(nn.Module):
    def __init__(self, experts: int, k: int):
        super().__init__()
        self.gate = nn.Linear(4, experts, bias=False)
        self.experts = nn.ModuleList(nn.Identity() for _ in range(experts))
        self.top_k = k

    def forward(self, h):
        self.gate(h)
        return h


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 4)
        self.blocks = nn.ModuleList([_Block(6, 2), _Block(6, 2)])

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for b in self.blocks:
            h = b(h)
        return h


def test_router_capture_margins_from_logits():
    """RouterCapture's margin: the k-th minus the (k+1)-th probability of the fp32 softmax of the logits it hooks,
    computed here with numpy from the same logits."""
    model = _Model()
    ids = torch.randint(0, 20, (3, 5), generator=torch.Generator().manual_seed(1))
    with RouterCapture(model) as cap:
        model(input_ids=ids)
    got = cap.margins()
    assert got.shape == (3, 5, 2) and got.dtype == torch.float32
    h = model.embed(ids).detach().numpy().astype(np.float64)
    for layer, block in enumerate(model.blocks):
        logits = (h @ block.gate.weight.detach().numpy().T.astype(np.float64)).astype(np.float32)
        z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
        p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
        srt = -np.sort(-p, axis=-1)
        np.testing.assert_allclose(got[:, :, layer].numpy(), srt[..., 1] - srt[..., 2], rtol=0, atol=2e-6)
    resp = response_margins(got, 2, 3)  # response token j's routing: position 1 + j
    assert torch.equal(resp, got[:, 1:4])


def test_database_made_before_the_margins(tmp_path):
    """A database without the routing margin columns, MARGIN_SUMS, summary_margin and summary_seq's top-k sums opens
    read-only with the new columns null and the margin table empty, and when opened for writing gains them and
    loads a logged step with margins, whose columns then equal the reference."""
    from analysis import schema
    from analysis.metrics.buckets import full_distribution_by
    from analysis.summaries import schema as S
    DriftLogger(tmp_path / "old", "old", token_sample=1.0).log_step(1, **make_step(B=4, T=6))
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "old"])
    for c in S.MARGIN_SUM_NAMES:
        store.sql(f"ALTER TABLE summary_layer DROP COLUMN {c}")
    for c in S.TOPK_SUM_NAMES:
        store.sql(f"ALTER TABLE summary_seq DROP COLUMN {c}")
    store.sql("DROP VIEW routing")
    for c in ("sampler_margin", "trainer_margin"):
        store.sql(f"ALTER TABLE {schema.ROUTING_STORE} DROP COLUMN {c}")
    store.sql(schema.routing_view().replace(", x.sampler_margin", ", NULL::FLOAT AS sampler_margin")
              .replace(", x.trainer_margin", ", NULL::FLOAT AS trainer_margin"))
    store.sql("DROP TABLE summary_margin")
    store.close()
    ro = Store(tmp_path / "db.duckdb", read_only=True)
    assert not ro.has_margin_sums and not ro.has_seq_topk_sums
    layers = routing_metrics(ro, ["old"], by="layer")
    assert layers["margin_mean_sampler"].null_count() == layers.height == 3
    assert flip_rate_by_margin(ro, ["old"]).is_empty()
    assert full_distribution_by(ro, ["old"], "length").is_empty()
    ro.close()
    rw = Store(tmp_path / "db.duckdb")
    assert rw.has_margin_sums and rw.has_seq_topk_sums
    data = {n: d for n, d in steps().items()}
    log = DriftLogger(tmp_path / "new", "r", token_sample=1.0)
    for n, d in data.items():
        log.log_step(n, **d)
    assert {o.status for o in ingest_paths(rw, [tmp_path / "new"])} == {"loaded"}
    check(rw, data)


def test_delete_run_removes_its_margin_rows(tmp_path):
    data = steps()
    for run in ("a", "b"):
        log = DriftLogger(tmp_path / "logs", run, token_sample=0.1)
        for n, d in data.items():
            log.log_step(n, **d)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    store.delete_run("a")
    assert store.scalar("SELECT count(*) FROM summary_margin WHERE run = 'a'") == 0
    assert store.scalar("SELECT count(*) FROM summary_margin WHERE run = 'b'") > 0
    assert flip_rate_by_margin(store, ["a"]).is_empty() and not flip_rate_by_margin(store, ["b"]).is_empty()


def test_sampler_routing_alone_gives_means_but_no_bins(tmp_path):
    """Without the trainer's experts there is no flip to count: the margin means come, the bins do not."""
    d = add_margins(make_step(B=6, T=9, L=3, seed=3, routing="sampler"), seed=3, sides=("sampler",))
    DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(3, **d)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    assert flip_rate_by_margin(store, ["r"]).is_empty()
    layers = {r["layer"]: r for r in routing_metrics(store, ["r"], by="layer").to_dicts()}
    for (layer, side), want in margin_means(d).items():
        close(layers[layer]["margin_mean_sampler"], want, layer)
        assert layers[layer]["margin_mean_trainer"] is None


def test_lake_with_margins_equals_direct_ingest(tmp_path):
    """A lake whose routing files carry margins: `summarize` (in process) merges summary_margin and the margin sums
    of its rank files into what ingesting every row directly gives."""
    import polars as pl
    from analysis.lake import partial
    from analysis.lake.engines import run_local
    from analysis.lake.layout import list_partitions
    from helpers import lake as lu

    tokens, routing = lu.make_rows(steps=(0, 3))
    rng = np.random.default_rng(4)
    n = routing.height
    margins = (10.0 ** (-6.0 * rng.random(n))).astype(np.float32)
    trainer = pl.when(pl.col("trainer_experts").is_not_null()).then(pl.Series(margins[::-1].copy()))
    routing = routing.with_columns(sampler_margin=pl.Series(margins), trainer_margin=trainer.cast(pl.Float32))
    lake = lu.write_lake(tmp_path / "lake", tokens, routing)
    store = Store(tmp_path / "direct.duckdb")
    assert [o.status for o in ingest_paths(store, lu.write_flat(tmp_path / "flat", tokens, routing))] == \
        ["loaded", "loaded"]
    direct = partial.summary_tables(store)
    assert direct["summary_margin"].num_rows > 0
    results = list(run_local(str(lake), list_partitions(str(lake)).partitions))
    assert [r.refused for r in results if r.refused] == []
    merged = {t: partial.merge(t, [r.tables[t] for r in results]) for t in ("summary_margin", "summary_layer")}
    lu.assert_same_summaries(merged, {t: direct[t] for t in merged})


@pytest.mark.parametrize("sides", [("sampler", "trainer"), ("trainer",)])
def test_kernel_and_torch_margin_tables_agree(sides):
    """The numba pass (CPU) and the torch ops (accelerators) give the same rows: counts exactly, sums at 1e-12."""
    from analysis.record.margins import margin_tables
    d = add_margins(make_step(B=10, T=14, L=3, K=2, E=5, seed=7), seed=7, sides=sides)
    args = (d["sampler_logprobs"].double(), d["trainer_logprobs"].double(), d["mask"].bool(), d["sampler_experts"],
            d["trainer_experts"], {s: d.get(f"{s}_margins") for s in ("sampler", "trainer")})
    (lk, rk), (lt, rt) = margin_tables(*args, engine="kernel"), margin_tables(*args, engine="torch")
    assert lk.keys() == lt.keys() and rk.keys() == rt.keys() and len(rk["layer"]) > 0
    for cols_k, cols_t in ((lk, lt), (rk, rt)):
        for c in cols_k:
            for a, b in zip(cols_k[c], cols_t[c], strict=True):
                assert a == b if not isinstance(a, float) else math.isclose(a, b, rel_tol=1e-12), (c, a, b)


def test_kernel_threads_agree_with_torch():
    """A step large enough that the CPU pass shares its pieces among threads gives the torch ops' rows."""
    from concurrent.futures import ThreadPoolExecutor
    from analysis.record.margins import margin_tables
    g = torch.Generator().manual_seed(9)
    B, T, L, K, E = 120, 600, 3, 2, 5
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
    t = (s + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.rand(B, T, generator=g) < 0.8
    se = torch.argsort(torch.rand(B, T, L, E, generator=g), -1)[..., :K]
    te = torch.where(torch.rand(B, T, L, 1, generator=g) < 0.3, torch.argsort(torch.rand(B, T, L, E, generator=g),
                                                                               -1)[..., :K], se.flip(-1))
    margins = {side: (10.0 ** (-6 * torch.rand(B, T, L, generator=g))).float() for side in ("sampler", "trainer")}
    args = (s, t, mask, se, te, margins)
    with ThreadPoolExecutor(2) as pool:
        lk, rk = margin_tables(*args, engine="kernel", pool=pool)
    lt, rt = margin_tables(*args, engine="torch")
    for cols_k, cols_t in ((lk, lt), (rk, rt)):
        for c in cols_k:
            for a, b in zip(cols_k[c], cols_t[c], strict=True):
                assert a == b if not isinstance(a, float) else math.isclose(a, b, rel_tol=1e-12), (c, a, b)


@pytest.mark.parametrize("column, value, rule", [
    ("margin_bin", 5, "margin_bin must be in [0, 5)"),
    ("side", "engine", "unknown side 'engine'"),
    ("n_flip", -1, "a count must be >= 0"),
])
def test_summary_file_margin_rows_are_checked(tmp_path, column, value, rule):
    """A summary file's summary_margin rows break a rule: the file is refused whole, naming the table, the row and
    the column; nothing of it is stored."""
    from analysis.ingest import summary_files
    row = {"layer": [0, 1], "side": ["sampler", "sampler"], "margin_bin": [0, 4], "n_rows": [3, 2],
           "n_flip": [1, 0], "sum_abs_d": [0.5, 0.25]}
    row[column] = [row[column][0], value]
    table = summary_files.build("r", 1, {"summary_margin": row})
    pq.write_table(table.replace_schema_metadata({summary_files.SUMMARY_KEY: summary_files.FORMAT_VERSION}),
                   tmp_path / "summary-step000001.parquet")
    store = Store(tmp_path / "db.duckdb")
    (o,) = ingest_paths(store, [tmp_path / "summary-step000001.parquet"])
    assert o.status == "refused" and "summary_margin" in o.line() and column in o.line() and rule in o.line(), o.line()
    assert store.scalar("SELECT count(*) FROM summary_margin") == 0


def test_csv_routing_margins_read_as_floats(tmp_path):
    """A CSV routing file whose first margins are written "0" and "1" still reads "0.25" later (floats whatever the
    first rows look like), and the margin means equal the values."""
    (tmp_path / "tokens.csv").write_text("run,step,sample,pos,sampler_logprob,trainer_logprob\n"
                                         "r,1,0,0,-0.5,-0.4\nr,1,0,1,-1.0,-1.2\n")
    (tmp_path / "routing.csv").write_text(
        "run,step,sample,pos,layer,sampler_experts,trainer_experts,trainer_margin\n"
        'r,1,0,0,0,"[0, 1]","[0, 1]",0\nr,1,0,1,0,"[0, 1]","[0, 2]",1\n'
        'r,1,0,0,1,"[2, 1]","[1, 2]",0.25\nr,1,0,1,1,"[3, 1]","[1, 3]",0.5\n')
    store = Store(tmp_path / "db.duckdb")
    outcomes = ingest_paths(store, [tmp_path / "tokens.csv", tmp_path / "routing.csv"])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    layers = routing_metrics(store, ["r"], by="layer").sort("layer")
    assert layers["margin_mean_trainer"].to_list() == [0.5, 0.375]
    df = flip_rate_by_margin(store, ["r"])  # layer 0: 0 (no flip), 1 (flip); layer 1: 0.25, 0.5 (no flips)
    assert df["side"].unique().to_list() == ["trainer"] and df["margin_bin"].to_list() == [0, 4]
    assert df["n_tokens"].to_list() == [1, 3] and df["flip_rate"].to_list() == [0.0, 1 / 3]
    close(df["log_ratio_abs_mean"][1], (0.2 + 0.1 + 0.2) / 3, "abs_d")
