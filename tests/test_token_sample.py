"""The token sample DriftLogger writes when token_sample < 1: its three parts against numpy brute force."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from analysis.record.token_sample import SamplePlan, select, step_generator


def step(B=64, T=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[B // 2] = False  # an empty sequence: never among the worst
    delta = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    delta[~mask] = 1e9  # padding holds anything: it must never be chosen
    return delta, mask


def draw(delta, mask, plan, run="r", step_=3):
    return select(delta, mask, plan, step_generator(plan.seed, run, step_, mask.device))


def test_worst_sequences_and_top_tokens_match_brute_force():
    delta, mask = step()
    plan = SamplePlan(rate=0.05, worst_sequences=4, top_tokens=10)
    keep, kept = draw(delta, mask, plan)
    d, m = delta.numpy(), mask.numpy()
    seq_abs = np.array([abs(sum(d[b, t] for t in range(d.shape[1]) if m[b, t])) for b in range(d.shape[0])])
    for b in np.argsort(-seq_abs)[:4]:
        assert keep[b][mask[b]].all()
    flat = [(abs(d[b, t]), b, t) for b in range(d.shape[0]) for t in range(d.shape[1]) if m[b, t]]
    for _, b, t in sorted(flat, reverse=True)[:10]:
        assert keep[b, t]
    assert not (keep & ~mask).any()  # padding never kept
    assert kept.n_tokens == int(m.sum())
    assert kept.n_worst_sequence_tokens == sum(int(m[b].sum()) for b in np.argsort(-seq_abs)[:4])
    assert kept.n_top_tokens == 10
    assert kept.n_kept == int(keep.sum())
    assert kept.n_kept <= kept.n_uniform + kept.n_worst_sequence_tokens + kept.n_top_tokens


def test_uniform_share_is_near_the_rate():
    mask = torch.ones(1000, 1000, dtype=torch.bool)
    delta = torch.zeros(1000, 1000, dtype=torch.float64)
    _, kept = draw(delta, mask, SamplePlan(rate=0.01, worst_sequences=0, top_tokens=0))
    # binomial(1e6, 0.01): sd ≈ 99.5; 6 sd either side
    assert abs(kept.n_uniform - 10_000) < 600
    assert kept.n_kept == kept.n_uniform and kept.n_worst_sequence_tokens == kept.n_top_tokens == 0


def test_rate_one_keeps_every_token_and_rate_zero_none():
    delta, mask = step()
    keep, kept = draw(delta, mask, SamplePlan(rate=1.0))
    assert torch.equal(keep, mask) and kept.n_kept == kept.n_tokens == int(mask.sum())
    keep, kept = draw(delta, mask, SamplePlan(rate=0.0))
    assert not keep.any() and kept.n_kept == 0 and kept.n_tokens == int(mask.sum())


def test_same_seed_run_and_step_give_the_same_sample():
    delta, mask = step(B=200)
    plan = SamplePlan(rate=0.1, worst_sequences=2, top_tokens=5)
    a, _ = draw(delta, mask, plan)
    b, _ = draw(delta, mask, plan)
    assert torch.equal(a, b)
    assert not torch.equal(a, draw(delta, mask, plan, step_=4)[0])
    assert not torch.equal(a, draw(delta, mask, plan, run="other")[0])
    assert not torch.equal(a, draw(delta, mask, SamplePlan(rate=0.1, worst_sequences=2, top_tokens=5, seed=1))[0])


def test_more_asked_than_there_are():
    delta, mask = step(B=3, T=4)
    keep, kept = draw(delta, mask, SamplePlan(rate=0.5, worst_sequences=100, top_tokens=1000))
    assert torch.equal(keep, mask)
    assert kept.n_top_tokens == kept.n_worst_sequence_tokens == kept.n_tokens


@pytest.mark.parametrize("kwargs, message", [
    (dict(rate=1.5), r"token_sample: expected a share of tokens in \[0, 1\], got 1.5"),
    (dict(rate=-0.1), r"token_sample: expected a share"),
    (dict(rate=True), r"token_sample: expected a share"),
    (dict(worst_sequences=-1), r"worst_sequences: expected an int >= 0, got -1"),
    (dict(top_tokens=2.5), r"top_tokens: expected an int >= 0, got 2.5"),
])
def test_bad_plans_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplePlan(**kwargs)


@pytest.mark.parametrize("k", [0, 1, 7, 256, 5000])
def test_cpu_pass_matches_numpy(k):
    """The CPU pass (row sums, lengths, top-k heap) against numpy on 300 × 40 positions, padding holding huge Δ."""
    from analysis.record.token_sample import _cpu_parts
    rng = np.random.default_rng(k)
    mask = rng.random((300, 40)) > 0.4
    mask[7] = False
    delta = np.where(mask, rng.standard_t(2, (300, 40)), 1e9)
    k = min(k, int(mask.sum()))
    draw = rng.random((300, 40), dtype=np.float32)
    uniform, n_uniform, seq_abs, lengths, top = _cpu_parts(delta, mask, k, draw, np.float32(0.3))
    assert (uniform == (mask & (draw < np.float32(0.3)))).all() and n_uniform == uniform.sum()
    np.testing.assert_allclose(seq_abs, np.abs(np.where(mask, delta, 0.0).sum(1)), rtol=1e-12, atol=1e-12)
    assert (lengths == mask.sum(1)).all()
    flat = np.where(mask, np.abs(delta), -1.0).ravel()
    assert sorted(top.tolist()) == sorted(np.argsort(-flat, kind="stable")[:k].tolist())


def test_cpu_uniform_part_is_torchs_draw():
    """The CPU pass keeps the uniform part torch's own comparison gives for the step's generator (the rate
    compared in float32, as torch does), so the sample is the torch path's on any device."""
    delta, mask = step(B=300, T=64, seed=5)
    for rate in (0.001, 0.1, 1 / 3):
        plan = SamplePlan(rate=rate, worst_sequences=0, top_tokens=0)
        keep, kept = draw(delta, mask, plan)
        g = step_generator(plan.seed, "r", 3, mask.device)
        want = (torch.rand(*mask.shape, generator=g) < rate) & mask
        assert torch.equal(keep, want) and kept.n_uniform == int(want.sum()) == kept.n_kept


@pytest.mark.parametrize("plan", [SamplePlan(rate=0.05, worst_sequences=4, top_tokens=10),
                                  SamplePlan(rate=0.3, worst_sequences=1, top_tokens=0, seed=2),
                                  SamplePlan(rate=0.001, worst_sequences=0, top_tokens=500)])
def test_cpu_pass_and_torch_ops_keep_the_same_tokens(plan):
    """The torch ops are the path of other devices (a GPU trainer); on the CPU both must give the same sample."""
    delta, mask = step(B=120, T=70, seed=9)
    got = draw(delta, mask, plan)
    want = select(delta, mask, plan, step_generator(plan.seed, "r", 3, mask.device), engine="torch")
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
