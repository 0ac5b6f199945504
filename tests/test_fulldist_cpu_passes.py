"""The CPU passes of DriftLogger's routing and top-k summaries against the torch ops of accelerators (run here on
the CPU): the same rows for repeated expert ids, ids past the pass's first table width and one-sided weights, and
the refusals the CPU routing pass makes as it reads (negative ids, weights that are not finite) in the words of
the checks that run before it elsewhere."""
from __future__ import annotations

import math

import pytest
import torch

from analysis.record import summaries as R
from analysis.record.logger import DriftLogger, _weights
from analysis.record.token_sample import Kept, SamplePlan

from helpers.fulldist import add_fulldist
from helpers.logger import make_step


def _summaries(d: dict, engine: str) -> dict:
    log = DriftLogger.__new__(DriftLogger)
    log.work = None  # as the lake layout: the logger's own checks run
    names = ("sampler_logprobs", "trainer_logprobs", "mask", "token_ids", "sampler_experts", "trainer_experts",
             "sampler_version", "trainer_version", "sample_ids")
    x = DriftLogger._checked(log, 0, *(d.get(k) for k in names))
    x.sampler_weights, x.trainer_weights = _weights(x, d.get("sampler_weights"), d.get("trainer_weights"))
    return R.summarise(x, Kept(int(x.mask.sum()), 0, 0, 0, 0), SamplePlan(0.0, 0, 0, 0), engine=engine)


def _same(cpu: dict, ops: dict) -> None:
    assert cpu["expert_load"] == ops["expert_load"]
    for k, v in ops["summary_layer"].items():
        for a, b in zip(cpu["summary_layer"][k], v, strict=True):
            assert a == b if isinstance(b, int) or b is None else math.isclose(a, b, rel_tol=1e-12), (k, a, b)
    for k in ("n_routed", "n_any_flip", "sum_flipped_layers", "sum_abs_d_flip", "sum_k3_noflip"):
        assert math.isclose(cpu["summary_step"][k][0], ops["summary_step"][k][0], rel_tol=1e-12), k


@pytest.mark.parametrize("case", ["repeats", "wide ids", "sampler weights only", "no trainer side", "int32 views"])
def test_routing_pass_equals_torch_ops(case, monkeypatch):
    d = add_fulldist(make_step(B=20, T=16, L=3, K=4, E=9, seed=3), seed=3)
    if case == "repeats":  # repeated ids: multisets, not sets, decide a flip; the weights of a repeat add up
        d["trainer_experts"][..., 1] = d["trainer_experts"][..., 0]
        d["sampler_experts"][:5, ..., 2] = d["sampler_experts"][:5, ..., 3]
        d["trainer_experts"][:3] = d["sampler_experts"][:3]
    if case == "wide ids":  # ids past the first table: the pass runs again with a wider one
        monkeypatch.setattr(R, "EXPERT_TABLE", 4)
        d["trainer_experts"] = d["trainer_experts"] * 37
        d["sampler_experts"][1] = d["trainer_experts"][1]
    if case == "sampler weights only":
        d.pop("trainer_weights")
    if case == "no trainer side":
        for k in ("trainer_experts", "trainer_weights"):
            d.pop(k)
    if case == "int32 views":  # int32 ids, and ids and weights strided along K (the pass reads contiguous copies)
        for k in ("sampler_experts", "trainer_experts", "sampler_weights", "trainer_weights"):
            v = d[k].to(torch.int32) if k.endswith("experts") else d[k]
            d[k] = torch.stack([v, torch.zeros_like(v)], -1)[..., 0]
            assert not d[k].is_contiguous()
    cpu, ops = _summaries(d, "kernel"), _summaries(d, "torch")
    if case == "no trainer side":
        assert cpu["expert_load"] == ops["expert_load"] and cpu["summary_layer"] == ops["summary_layer"]
    else:
        _same(cpu, ops)
        assert cpu["summary_step"]["n_any_flip"][0] > 0


@pytest.mark.parametrize("change, message", [
    (lambda d: d["trainer_experts"].__setitem__((2, 3, 1, 0), -4), "trainer_experts[2, 3, 1] = [-4, "),
    (lambda d: d["sampler_experts"].__setitem__((0, 5, 2, 1), -1), "sampler_experts[0, 5, 2] = ["),
    (lambda d: d["sampler_weights"].__setitem__((3, 1, 0, 1), float("nan")), "sampler_weights[3, 1]: a weight"),
    (lambda d: d["trainer_weights"].__setitem__((1, 0, 2, 0), -float("inf")), "trainer_weights[1, 0]: a weight"),
])
def test_routing_pass_refuses_in_the_checks_words(tmp_path, change, message):
    d = add_fulldist(make_step(B=4, T=6, L=3, K=2, E=5, seed=1), seed=1)
    d["mask"] = torch.ones_like(d["mask"])
    d["sampler_logprobs"] = torch.nan_to_num(d["sampler_logprobs"], nan=-1.0)
    change(d)
    pattern = message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=pattern):  # the logger's checks (accelerators, lake layout)
        _summaries(d, "torch")
    with pytest.raises(ValueError, match=pattern):  # the CPU pass, through log_step
        DriftLogger(tmp_path / "logs", "r", token_sample=0.0).log_step(0, **d)
    assert not list((tmp_path / "logs" / "r").glob("*.parquet"))
