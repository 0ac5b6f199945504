"""METRICS.md v3 full-distribution (topk_*, top1_agree) and routing-weight (weight_abs_diff_*) columns: from
DriftLogger's summaries at token_sample 1.0, 0.1 and 0.0, and from the same step as sequence JSON Lines, against
brute-force references (tests/helpers/fulldist.py) at rel 1e-12; edge cases; refusals of bad input."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from analysis.ingest import ingest_paths
from analysis.metrics.report import metrics_table
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import fulldist

from helpers.fulldist import add_fulldist, ingest_sequence_lines, topk_reference, topk_terms, weight_reference
from helpers.logger import make_step

TOPK = ("topk_overlap", "top1_agree", "topk_mass_sampler", "topk_mass_trainer", "topk_kl_shared", "topk_tv_lower",
        "topk_tv_upper")
STEPS = (2, 5)


def steps() -> dict[int, dict]:
    return {n: add_fulldist(make_step(B=10, T=14, L=3, K=2, E=5, seed=n), seed=n) for n in STEPS}


def close(got, want, what):
    assert got is not None and math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-300), (what, got, want)


def check_columns(store: Store, data: dict[int, dict], rows: bool = True) -> None:
    """rows: the store holds token rows (else a table from token rows, for C outside the summaries, is empty)."""
    by_step = {r["step"]: r for r in metrics_table(store, ["r"], by="step").to_dicts()}
    refs = {n: topk_reference(d) for n, d in data.items()}
    for n, ref in refs.items():
        for c in TOPK:
            close(by_step[n][c], ref[c], (n, c))
    # per run: each step's means weighted by its positions
    counts = {n: int(d["mask"].sum()) for n, d in data.items()}
    run = metrics_table(store, ["r"], by="run").to_dicts()[0]
    for c in TOPK:
        want = math.fsum(refs[n][c] * counts[n] for n in refs) / sum(counts.values())
        close(run[c], want, ("run", c))
    # C and ε outside the summaries' grid: the token columns come from the token rows, the top-k ones still from
    # the summaries (they depend on neither)
    other = metrics_table(store, ["r"], by="run", cap=1.7)
    assert all(other[c].to_list() == [run[c]] for c in TOPK) if rows else other.is_empty()
    layers = {(r["step"], r["layer"]): r for r in metrics_table(store, ["r"], by="layer").to_dicts()}
    for n, d in data.items():
        for layer, (mean, top) in weight_reference(d).items():
            close(layers[(n, layer)]["weight_abs_diff_mean"], mean, (n, layer, "mean"))
            close(layers[(n, layer)]["weight_abs_diff_max"], top, (n, layer, "max"))


@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
def test_logger_summaries_equal_reference(tmp_path, token_sample):
    data = steps()
    log = DriftLogger(tmp_path / "logs", "r", token_sample=token_sample, worst_sequences=1, top_tokens=3)
    for n, d in data.items():
        written = log.log_step(n, **d)
        assert ("topk" in written) == (token_sample > 0)
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    check_columns(store, data, rows=token_sample > 0)
    if token_sample == 1.0:  # the stored rows are the inputs (fp32 in, fp32 stored)
        row = store.sql("SELECT * FROM topk WHERE step = 2 AND sample = 100 AND pos = 0").to_dicts()[0]
        assert row["sampler_topk_ids"] == data[2]["sampler_topk_ids"][0, 0].tolist()
        assert row["trainer_topk_logprobs"] == data[2]["trainer_topk_logprobs"][0, 0].tolist()
        w = store.sql("SELECT sampler_weights FROM routing WHERE step = 2 AND sample = 100 AND pos = 0 "
                      "AND layer = 1").item()
        assert w.to_list() == data[2]["sampler_weights"][0, 0, 1].tolist()


def test_sequence_jsonl_equals_reference(tmp_path):
    data = steps()
    check_columns(ingest_sequence_lines(tmp_path, data), data)


def test_long_parquet_topk_after_tokens(tmp_path):
    """A top-k Parquet file given before its tokens file still finds its tokens (top-k loads after tokens)."""
    data = {2: steps()[2]}
    DriftLogger(tmp_path / "logs", "r", token_sample=1.0).log_step(2, **data[2])
    import pyarrow.parquet as pq
    plain = tmp_path / "plain"
    plain.mkdir()
    for kind in ("topk", "tokens", "routing"):  # unmarked: ingest summarises every row itself
        table = pq.read_table(tmp_path / "logs" / "r" / f"{kind}-step000002.parquet")
        pq.write_table(table.replace_schema_metadata({}), plain / f"a-{kind}.parquet")
    store = Store(tmp_path / "db.duckdb")
    outcomes = ingest_paths(store, sorted(plain.iterdir()))
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    check_columns(store, data)


def terms(si, sl, ti, tl):
    """The per-position terms of one position, as the CPU pass sums them (one group of one row)."""
    f = lambda a, dt: np.asarray(a, dt)[None]  # noqa: E731
    out = fulldist.topk_sums(f(si, np.int64), f(sl, np.float64), f(ti, np.int64), f(tl, np.float64),
                             np.zeros(1, np.int64), 1)[0]
    assert out[0] == 1
    return dict(zip(("overlap", "agree", "mass_sampler", "mass_trainer", "kl_shared", "tv_lower", "tv_upper"),
                    out[1:].tolist()))


def test_edge_cases():
    lp = np.log([0.5, 0.2, 0.1])
    same = terms([4, 7, 9], lp, [4, 7, 9], lp)
    assert same["overlap"] == 1.0 and same["agree"] == 1.0 and same["kl_shared"] == 0.0
    assert same["tv_lower"] == 0.0 and math.isclose(same["tv_upper"], 1 - 0.8, rel_tol=1e-12)
    disjoint = terms([4, 7, 9], lp, [1, 2, 3], lp)
    assert disjoint["overlap"] == 0.0 and disjoint["agree"] == 0.0 and disjoint["kl_shared"] == 0.0
    assert disjoint["tv_lower"] == 0.0 and disjoint["tv_upper"] == 1.0  # nothing shared: TV may be anything up to 1
    one = terms([4, 7, 9], lp, [1, 9, 3], lp)  # |I| = 1: no distribution over I to compare
    assert one["kl_shared"] == 0.0 and math.isclose(one["overlap"], 1 / 3)
    assert math.isclose(one["tv_lower"], 0.5 * abs(0.1 - 0.2) + 0.5 * abs(0.1 - 0.2), rel_tol=1e-12)
    # renormalised over I, equal proportions give KL 0 even where the masses differ
    prop = terms([1, 2], np.log([0.4, 0.2]), [2, 1], np.log([0.1, 0.2]))
    assert abs(prop["kl_shared"]) < 1e-15 and prop["agree"] == 1.0


def test_identical_sides_in_the_logger(tmp_path):
    d = add_fulldist(make_step(B=4, T=6, seed=3), seed=3)
    d["trainer_topk_ids"], d["trainer_topk_logprobs"] = d["sampler_topk_ids"], d["sampler_topk_logprobs"]
    d["trainer_experts"], d["trainer_weights"] = d["sampler_experts"], d["sampler_weights"]
    DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(1, **d)
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "logs"])
    row = metrics_table(store, ["r"], by="step").to_dicts()[0]
    assert (row["topk_overlap"], row["top1_agree"], row["topk_kl_shared"], row["topk_tv_lower"]) == (1, 1, 0, 0)
    layers = metrics_table(store, ["r"], by="layer")
    assert layers["weight_abs_diff_mean"].to_list() == [0.0] * len(layers)


def test_runs_without_topk_have_null_columns(tmp_path):
    DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(1, **make_step(B=3, T=4))
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "logs"])
    row = metrics_table(store, ["r"], by="step").to_dicts()[0]
    assert all(row[c] is None for c in TOPK)
    assert metrics_table(store, ["r"], by="layer")["weight_abs_diff_mean"].null_count() == 3


REFUSALS = [
    (lambda d: d.pop("trainer_topk_logprobs"), "trainer_topk_logprobs: missing"),
    (lambda d: d.update(trainer_topk_ids=d["trainer_topk_ids"][..., :3]), "trainer_topk_ids: expected shape"),
    (lambda d: d["sampler_topk_logprobs"].__setitem__((0, 0, 2), 0.5), "sampler_topk_logprobs[0, 0, 2] = 0.5"),
    (lambda d: d["sampler_topk_logprobs"].__setitem__((1, 0, 0), float("nan")), "sampler_topk_logprobs[1, 0, 0]"),
    (lambda d: d["trainer_topk_ids"].__setitem__((0, 0, 1), d["trainer_topk_ids"][0, 0, 0]),
     "trainer_topk_ids[0, 0] = "),
    (lambda d: d["sampler_topk_ids"].__setitem__((0, 0, 1), -3), "sampler_topk_ids[0, 0, 1] = -3"),
    (lambda d: d.update(sampler_topk_ids=d["sampler_topk_ids"].float()), "expected integer token ids"),
    (lambda d: d.pop("trainer_experts"), "trainer_weights: given without trainer_experts"),
    (lambda d: d.update(sampler_weights=d["sampler_weights"][..., :1]), "sampler_weights: expected shape"),
    (lambda d: d["trainer_weights"].__setitem__((2, 0, 1, 0), float("inf")), "trainer_weights[2, 0]"),
]


@pytest.mark.parametrize("change, message", REFUSALS)
def test_logger_refuses(tmp_path, change, message):
    d = add_fulldist(make_step(B=4, T=6, seed=1), seed=1)
    d["mask"] = torch.ones_like(d["mask"])
    d["sampler_logprobs"] = torch.nan_to_num(d["sampler_logprobs"], nan=-1.0)
    change(d)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DriftLogger(tmp_path / "logs", "r").log_step(0, **d)
    assert not list((tmp_path / "logs" / "r").glob("*.parquet"))


@pytest.mark.parametrize("change, message", REFUSALS)
def test_accelerator_checks_word_the_same_refusals(change, message):
    """The checks that run before the sums on an accelerator (here forced on CPU tensors: in_pass=False) refuse
    what the CPU pass refuses, in the same words."""
    from analysis.record.logger import _topk, _weights
    d = add_fulldist(make_step(B=4, T=6, seed=1), seed=1)
    d["mask"] = torch.ones_like(d["mask"])
    d["sampler_logprobs"] = torch.nan_to_num(d["sampler_logprobs"], nan=-1.0)
    change(d)
    log = DriftLogger.__new__(DriftLogger)
    log.work = None
    names = ("sampler_logprobs", "trainer_logprobs", "mask", "token_ids", "sampler_experts", "trainer_experts",
             "sampler_version", "trainer_version", "sample_ids")
    x = DriftLogger._checked(log, 0, *(d.get(k) for k in names))
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _weights(x, d.get("sampler_weights"), d.get("trainer_weights"))
        _topk(x, *(d.get(k) for k in ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids",
                                      "trainer_topk_logprobs")), in_pass=False)


def test_padding_is_not_checked(tmp_path):
    d = add_fulldist(make_step(B=4, T=6, seed=1), seed=1)
    pad = ~d["mask"].bool()
    assert pad.any()
    d["sampler_topk_logprobs"][pad] = float("nan")
    d["trainer_topk_ids"][pad] = 0  # repeated ids at padding
    d["sampler_weights"][pad] = float("inf")
    DriftLogger(tmp_path / "logs", "r").log_step(0, **d)


def one_line(**extra) -> str:
    obj = {"run": "r", "step": 1, "sample": 0, "sampler_logprobs": [-0.5, -1.0], "trainer_logprobs": [-0.4, -1.1],
           "sampler_topk_ids": [[1, 2], [3, 4]], "sampler_topk_logprobs": [[-0.5, -1.5], [-1.0, -2.0]],
           "trainer_topk_ids": [[2, 1], [3, 5]], "trainer_topk_logprobs": [[-0.6, -1.2], [-1.1, -1.9]]}
    return json.dumps({**obj, **extra})


@pytest.mark.parametrize("extra, place, rule", [
    ({"trainer_topk_ids": None}, "line 2 (step 1, sample 0)", "'trainer_topk_ids' missing"),
    ({"trainer_topk_ids": [[2, 1, 7], [3, 5, 8]]}, "line 2 (step 1, sample 0)", "has shape [2, 3]"),
    ({"trainer_topk_ids": [[2, 2], [3, 5]]}, "line 2 (step 1, sample 0, token 0), column 'trainer_topk_ids'",
     "token ids repeat"),
    ({"sampler_topk_logprobs": [[-0.5, 0.5], [-1.0, -2.0]]},
     "line 2 (step 1, sample 0, token 0), column 'sampler_topk_logprobs'", "finite and <= 0"),
    ({"sampler_topk_ids": [[1, -2], [3, 4]]}, "line 2 (step 1, sample 0, token 0), column 'sampler_topk_ids'",
     "negative token id"),
    ({"sampler_weights": [[[0.5]], [[0.5]]]}, "line 2 (step 1, sample 0)", "'sampler_weights' given without"),
    ({"sampler_experts": [[[1, 2]], [[0, 3]]], "sampler_weights": [[[0.5]], [[0.5]]]}, "line 2 (step 1, sample 0)",
     "'sampler_weights' has shape [2, 1, 1], expected [2, 1, 2]"),
])
def test_jsonl_refusals_name_file_line_and_rule(tmp_path, extra, place, rule):
    path = tmp_path / "bad.jsonl"
    good = json.loads(one_line())
    good["sample"] = 9
    path.write_text(json.dumps(good) + "\n" + one_line(**extra) + "\n")
    store = Store(tmp_path / "db.duckdb")
    [outcome] = ingest_paths(store, [path])
    assert outcome.status == "refused"
    assert "bad.jsonl" in outcome.line() and place in outcome.line() and rule in outcome.line(), outcome.line()
    assert store.scalar("SELECT count(*) FROM topk") == 0 and store.scalar("SELECT count(*) FROM tokens") == 0


def test_orphan_topk_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from analysis.routing_rows import list_column
    table = pa.table({"run": ["r"], "step": [1], "sample": [0], "pos": [0],
                      "sampler_topk_ids": list_column(np.array([[1, 2]], np.int32)),
                      "sampler_topk_logprobs": list_column(np.array([[-0.1, -2.0]], np.float32)),
                      "trainer_topk_ids": list_column(np.array([[1, 2]], np.int32)),
                      "trainer_topk_logprobs": list_column(np.array([[-0.1, -2.0]], np.float32))})
    pq.write_table(table, tmp_path / "topk.parquet")
    store = Store(tmp_path / "db.duckdb")
    [outcome] = ingest_paths(store, [tmp_path / "topk.parquet"])
    assert outcome.status == "refused" and "top-k row (run='r', step=1, sample=0, pos=0)" in outcome.line()
    assert store.scalar("SELECT count(*) FROM topk") == 0


@pytest.mark.parametrize("ids_dtype, lp_dtype", [(torch.int64, torch.float32), (torch.int32, torch.float64),
                                                 (torch.int32, torch.bfloat16)])
def test_cpu_pass_and_torch_ops_agree_with_reference(ids_dtype, lp_dtype):
    """The CPU's numba pass (threads sharing the chunks) and the torch ops of accelerators, run here on the CPU,
    against the reference, for the dtypes trainers hand over (bf16 log-probs widen exactly)."""
    from concurrent.futures import ThreadPoolExecutor

    from analysis.record import fulldist as R
    d = add_fulldist(make_step(B=40, T=30, seed=4), seed=4)
    for k in ("sampler_topk_ids", "trainer_topk_ids"):
        d[k] = d[k].to(ids_dtype)
    for k in ("sampler_topk_logprobs", "trainer_topk_logprobs"):
        d[k] = d[k].to(lp_dtype)
    ref = topk_reference(d)
    args = [d[k] for k in ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids", "trainer_topk_logprobs")]
    mask = d["mask"].bool()
    with ThreadPoolExecutor(1) as pool:
        old = R.CPU_CHUNK
        R.CPU_CHUNK = 64  # many chunks, shared by two threads
        try:
            cpu = R.topk_sums(*args, mask, pool=pool)
        finally:
            R.CPU_CHUNK = old
    for sums in (cpu, R.topk_sums_torch(*args, mask)):
        n = sums["n_topk"]
        assert n == int(mask.sum())
        for c, name in zip(TOPK, ("sum_topk_overlap", "n_top1_agree", "sum_topk_mass_sampler", "sum_topk_mass_trainer",
                                  "sum_topk_kl_shared", "sum_topk_tv_lower", "sum_topk_tv_upper")):
            close(sums[name] / n, ref[c], c)


def test_torch_engine_equals_cpu_pass_for_routing_and_topk():
    """summarise's torch ops (the accelerators' path, here on the CPU) and its CPU passes give the same summary_layer
    and expert_load rows (weights included) and the same top-k sums, and both the weight reference."""
    from analysis.record.summaries import summarise
    from analysis.record.token_sample import Kept, SamplePlan
    d = add_fulldist(make_step(B=30, T=20, L=4, K=3, E=7, seed=6), seed=6)
    log = DriftLogger.__new__(DriftLogger)
    log.work = None
    x = DriftLogger._checked(log, 0, *(d[k] for k in ("sampler_logprobs", "trainer_logprobs", "mask", "token_ids",
                                                      "sampler_experts", "trainer_experts", "sampler_version",
                                                      "trainer_version", "sample_ids")))
    from analysis.record.logger import _topk, _weights
    x.sampler_weights, x.trainer_weights = _weights(x, d["sampler_weights"], d["trainer_weights"])
    x.topk = _topk(x, *(d[k] for k in ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids",
                                       "trainer_topk_logprobs")))
    kept, plan = Kept(int(x.mask.sum()), 0, 0, 0, 0), SamplePlan(0.0, 0, 0, 0)
    cpu, ops = (summarise(x, kept, plan, engine=e) for e in ("kernel", "torch"))
    assert cpu["expert_load"] == ops["expert_load"]
    for k, v in ops["summary_layer"].items():
        got = cpu["summary_layer"][k]
        assert len(got) == len(v) == 4, k
        for a, b in zip(got, v):
            assert a == b if isinstance(b, int) or b is None else math.isclose(a, b, rel_tol=1e-12), (k, a, b)
    for name in ("n_topk", "sum_topk_overlap", "n_top1_agree", "sum_topk_kl_shared", "sum_topk_tv_upper"):
        assert math.isclose(cpu["summary_step"][name][0], ops["summary_step"][name][0], rel_tol=1e-12), name
    for layer, (mean, top) in weight_reference(d).items():
        rows = cpu["summary_layer"]
        close(rows["sum_weight_abs_diff"][layer] / rows["n_weight_rows"][layer], mean, layer)
        close(rows["max_weight_abs_diff"][layer], top, layer)


def test_database_made_before_the_columns(tmp_path):
    """A database without table topk, TOPK_SUMS and WEIGHT_SUMS (the earlier layout) opens read-only with the
    new columns null, and when opened for writing gains them (null in its rows) and loads a logged step."""
    from analysis.summaries import schema as S
    DriftLogger(tmp_path / "old", "old", token_sample=0.0).log_step(1, **make_step(B=4, T=6))
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "old"])
    for c in S.TOPK_SUM_NAMES:
        store.sql(f"ALTER TABLE summary_step DROP COLUMN {c}")
    for c in S.WEIGHT_SUM_NAMES:
        store.sql(f"ALTER TABLE summary_layer DROP COLUMN {c}")
    store.sql("DROP TABLE topk")
    before = metrics_table(store, ["old"], by="step").drop(*TOPK)
    store.close()
    ro = Store(tmp_path / "db.duckdb", read_only=True)
    assert not ro.has_topk_sums and not ro.has_weight_sums
    got = metrics_table(ro, ["old"], by="step")
    assert got.drop(*TOPK).equals(before) and all(got[c].to_list() == [None] for c in TOPK)
    assert metrics_table(ro, ["old"], by="layer")["weight_abs_diff_mean"].null_count() == 3
    ro.close()
    rw = Store(tmp_path / "db.duckdb")
    assert rw.has_topk_sums and rw.has_weight_sums
    data = {2: steps()[2]}
    log = DriftLogger(tmp_path / "new", "r", token_sample=0.1)
    log.log_step(2, **data[2])
    assert {o.status for o in ingest_paths(rw, [tmp_path / "new"])} == {"loaded"}
    check_columns(rw, data)


def test_jsonl_loss_mask_keeps_the_trained_positions_top_k(tmp_path):
    path = tmp_path / "masked.jsonl"
    obj = {"run": "r", "step": 1, "sample": 0, "sampler_logprobs": [-0.5, -1.0, -0.25],
           "trainer_logprobs": [-0.4, -1.1, -0.25], "loss_mask": [1, 0, 1],
           "sampler_topk_ids": [[1, 2], [3, 3], [5, 6]], "sampler_topk_logprobs": [[-0.5, -1.5], [1.0, 2.0], [-0.25, -2]],
           "trainer_topk_ids": [[2, 1], [3, 3], [6, 7]], "trainer_topk_logprobs": [[-1.5, -0.5], [1.0, 2.0], [-0.5, -1]],
           "sampler_experts": [[[0, 1]], [[2, 2]], [[1, 3]]], "sampler_weights": [[[0.75, 0.25]], [[9, 9]], [[0.5, 0.5]]],
           "trainer_experts": [[[1, 0]], [[2, 2]], [[3, 1]]], "trainer_weights": [[[0.25, 0.75]], [[9, 9]], [[0.5, 0.5]]]}
    path.write_text(json.dumps(obj) + "\n")  # the masked-out position breaks every rule: it is never read
    store = Store(tmp_path / "db.duckdb")
    outcomes = ingest_paths(store, [path])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    assert store.rows("SELECT pos, trainer_topk_ids FROM topk ORDER BY pos") == [(0, [2, 1]), (2, [6, 7])]
    row = metrics_table(store, ["r"], by="step").to_dicts()[0]
    p = math.exp
    # position 0: identical distributions over the same ids; position 2: one shared id (6)
    close(row["topk_overlap"], (1.0 + 0.5) / 2, "overlap")
    close(row["top1_agree"], (1.0 + 0.0) / 2, "top1")
    tv_up2 = 0.5 * abs(p(-2) - p(-0.5)) + 0.5 * (1 - p(-2)) + 0.5 * (1 - p(-0.5))
    close(row["topk_tv_upper"], ((1 - p(-0.5) - p(-1.5)) + tv_up2) / 2, "tv upper")
    layer = metrics_table(store, ["r"], by="layer").to_dicts()[0]
    assert (layer["weight_abs_diff_mean"], layer["weight_abs_diff_max"]) == (0.0, 0.0)  # matched by id


def test_lake_layout_refuses_top_k_and_weights(tmp_path):
    d = add_fulldist(make_step(B=3, T=4), seed=0)
    with pytest.raises(ValueError, match="layout='lake' does not carry top-k log-probs or routing weights"):
        DriftLogger(tmp_path / "lake", "r", layout="lake").log_step(0, **d)


def slot(x: int) -> int:
    return ((x * 2654435761) >> 20) & 4095  # summaries/fulldist._slot, for ids below 2**32


def colliding_pair() -> tuple[int, int]:
    """The first two ids > 0 that share a slot of the CPU pass's table (2 and 2586)."""
    first = {}
    for x in range(1, 200_000):
        h = slot(x)
        if h in first:
            return first[h], x
        first[h] = x
    raise AssertionError("no two ids share a slot")


def test_ids_sharing_a_slot_take_the_exact_path():
    """Distinct ids whose hash slots collide, on either side, are matched by the exact comparisons (the CPU pass
    uses the slots only where a side's ids take distinct slots); a real repeat among them is still found."""
    a, b = colliding_pair()
    lp = np.log([0.4, 0.3, 0.2, 0.05])
    cases = [([a, b, 7, 9], [b, 11, a, 7]), ([7, 9, 11, 13], [a, b, 13, 7]), ([a, b, 3, 4], [5, 6, 7, 8])]
    for s_ids, t_ids in cases:
        got = terms(s_ids, lp, t_ids, lp[::-1])
        step = {"mask": np.ones((1, 1)), "sampler_topk_ids": np.array([[s_ids]]),
                "sampler_topk_logprobs": np.array([[lp]]), "trainer_topk_ids": np.array([[t_ids]]),
                "trainer_topk_logprobs": np.array([[lp[::-1]]])}
        ref = topk_reference(step)
        for k, c in zip(("overlap", "agree", "mass_sampler", "mass_trainer", "kl_shared", "tv_lower", "tv_upper"),
                        TOPK):
            assert math.isclose(got[k], ref[c], rel_tol=1e-12, abs_tol=1e-15), (s_ids, t_ids, k, got[k], ref[c])
    for s_ids, t_ids in (([a, b, a, 4], [1, 2, 3, 4]), ([1, 2, 3, 4], [b, a, 3, b])):
        f = lambda v, dt: np.asarray(v, dt)[None]  # noqa: E731
        with pytest.raises(ValueError, match="repeat"):
            fulldist.topk_sums(f(s_ids, np.int64), f(lp, np.float64), f(t_ids, np.int64), f(lp, np.float64),
                               np.zeros(1, np.int64), 1)


def rank_rows(rng: np.random.Generator, J: int, n: int) -> tuple[list, list]:
    """n pairs of top-J id lists in the shapes the CPU pass matches by rank: every rank agreeing, some ranks off
    (the trainer's id there new, or another off-rank id of the sampler's), every rank off (the same ids
    permuted), and lists sharing nothing; ids from a small vocabulary, so that off-rank ids are often shared."""
    si, ti = [], []
    for r in range(n):
        s = rng.choice(3 * J, J, replace=False)
        t = s.copy()
        kind = r % 4
        if kind == 1:  # some ranks off: their trainer ids a permutation of the sampler's there, some replaced
            off = rng.choice(J, rng.integers(1, J), replace=False)
            t[off] = rng.permutation(s[off])
            fresh = [x for x in range(3 * J) if x not in s]
            for k in off[: rng.integers(0, len(off) + 1)]:
                t[k] = fresh.pop(rng.integers(len(fresh)))
        elif kind == 2:  # every rank off, the same set
            t = np.roll(s, 1 + rng.integers(J - 1))
        elif kind == 3:
            t = rng.choice(np.setdiff1d(np.arange(4 * J), s), J, replace=False)
        si.append(s)
        ti.append(t)
    return si, ti


def test_rank_matching_equals_reference():
    """The CPU pass matches the ranks where both sides hold the same id without its table: rows that agree at
    every rank, at some, at none, and share nothing, row by row against the brute-force reference; with ids that
    share a slot (the exact path) among them."""
    from analysis.record import fulldist as R
    rng = np.random.default_rng(11)
    J, n = 7, 400
    si, ti = rank_rows(rng, J, n)
    a, b = colliding_pair()  # a = 2: the other ids below are 11 and up
    si.append(np.array([a, b, 11, 12, 13, 14, 15]))  # sampler ids sharing a slot, one off rank
    ti.append(np.array([a, 12, 11, b, 13, 14, 19]))
    si.append(np.array([11, 12, 13, 14, 15, 16, 17]))  # the trainer's off-rank ids sharing a slot
    ti.append(np.array([11, a, b, 14, 15, 16, 12]))
    si.append(np.array([11, 12, 13, 14, 15, 16, a]))  # an off-rank trainer id in the slot of another sampler id
    ti.append(np.array([11, 12, 13, 14, 15, b, 16]))
    s_ids, t_ids = np.array(si, np.int64), np.array(ti, np.int64)
    s_lp = np.log(rng.uniform(1e-3, 1 / J, s_ids.shape))
    t_lp = np.log(rng.uniform(1e-3, 1 / J, s_ids.shape))
    step = {"mask": np.ones((len(si), 1)), "sampler_topk_ids": s_ids[:, None], "sampler_topk_logprobs": s_lp[:, None],
            "trainer_topk_ids": t_ids[:, None], "trainer_topk_logprobs": t_lp[:, None]}
    ref = topk_terms(step)
    per_row = fulldist.topk_sums(s_ids, s_lp, t_ids, t_lp, np.arange(len(si)), len(si))
    logged = np.zeros_like(per_row)
    R.topk_sums(*(torch.from_numpy(v)[:, None] for v in (s_ids, s_lp, t_ids, t_lp)),
                torch.ones(len(si), 1, dtype=torch.bool), per_row=logged)
    assert np.array_equal(per_row, logged)
    # padding rows between them (group −1: ids repeated, log-probs not finite) are never read, and the
    # exponentials of the rows kept stay with their rows
    pad = np.arange(len(si)) % 3 == 1
    grow = lambda v, fill: np.insert(v, np.flatnonzero(pad), fill, axis=0)  # noqa: E731
    group = grow(np.arange(len(si)), -1)
    padded = fulldist.topk_sums(grow(s_ids, 7), grow(s_lp, np.nan), grow(t_ids, 7), grow(t_lp, np.inf), group,
                                len(si))
    assert len(group) > len(si) and np.array_equal(padded, per_row)
    kinds = {"all": 0, "some": 0, "none": 0}
    for row in range(len(si)):
        on = int((s_ids[row] == t_ids[row]).sum())
        kinds["all" if on == J else "some" if on else "none"] += 1
        assert per_row[row, 0] == 1
        for k, c in enumerate(TOPK, start=1):
            assert math.isclose(per_row[row, k], ref[c][row], rel_tol=1e-12, abs_tol=1e-15), (row, c)
    assert min(kinds.values()) >= 90, kinds
    assert 0 < per_row[:, 1].sum() < len(si) and 0 < per_row[:, 2].sum() < len(si)


@pytest.mark.parametrize("rows", [
    lambda a, b: ([1, 2, 1, 4], [1, 2, 1, 4]),  # the sampler repeats, every rank agreeing
    lambda a, b: ([1, 2, 3, 2], [1, 5, 3, 6]),  # the sampler repeats off rank
    lambda a, b: ([1, 2, 3, 4], [1, 2, 3, 2]),  # an off-rank trainer id equal to one where the ranks agree
    lambda a, b: ([1, 2, 3, 4], [1, 3, 2, 3]),  # two off-rank trainer ids equal, both the sampler's
    lambda a, b: ([1, 2, 3, 4], [1, 9, 3, 9]),  # two off-rank trainer ids equal, neither the sampler's
    lambda a, b: ([a, b, 3, a], [1, 4, 3, 5]),  # the sampler repeats, its ids sharing a slot (the exact path)
    lambda a, b: ([a, b, 3, 4], [a, 3, 3, 4]),  # the exact path: the trainer repeats an agreeing id
    lambda a, b: ([1, 3, 4, 5], [1, b, a, 1]),  # an off-rank trainer id equal to an agreeing one, ids sharing a slot
])
def test_rank_matching_finds_repeats(rows):
    """A row that repeats an id on either side is refused, whichever of its ranks agree; it follows a valid row,
    whose table entries it must not take for its own."""
    s_ids, t_ids = rows(*colliding_pair())
    good = [5, 6, 7, 8]
    lp = np.tile(np.log([0.4, 0.3, 0.2, 0.05]), (3, 1))
    with pytest.raises(ValueError, match="repeat"):
        fulldist.topk_sums(np.array([good, s_ids, good]), lp, np.array([good, t_ids, good]), lp,
                           np.zeros(3, np.int64), 1)
