"""What a user reads: rare tails never print as zero, and log axes label 0.2 and 0.5 as such."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import token as metrics
from ui import charts, glossary
from ui.number_format import fmt_share, log_ticks, share_decimals, share_tickformat


def test_rare_tail_card_reads_its_share_and_count(metrics_store_from):
    """23 tokens with r > C among 100,000: the card shows a non-zero share and, beneath it, the count 23, both
    checked against the drawn data (the bug printed "0.00%")."""
    rng = np.random.default_rng(7)
    n, rare = 100_000, 23
    s = -1.5 - rng.exponential(1.0, n)  # s + Δ stays a log-probability (≤ 0)
    d = rng.uniform(-0.2, 0.2, n)
    d[rng.choice(n, rare, replace=False)] = 1.0  # r = e > C = 2
    tokens = pl.DataFrame({"run": ["tail"] * n, "step": [0] * n, "sample": np.arange(n) // 100,
                           "pos": np.arange(n) % 100, "sampler_logprob": s, "trainer_logprob": np.minimum(s + d, 0)})
    want = int((np.exp(tokens["trainer_logprob"] - tokens["sampler_logprob"]) > 2.0).sum())
    assert want == rare
    row = metrics.token_metrics(metrics_store_from(tokens), ["tail"], by="run", cap=2.0).row(0, named=True)
    assert glossary.fmt_value("ratio_frac_high", row["ratio_frac_high"]) == "0.023%"
    assert glossary.token_count("ratio_frac_high", row["ratio_frac_high"], row["n_tokens"]) == "23 of 100,000 tokens"
    assert glossary.fmt_value("ratio_frac_high", 23 / 1_000_000) == "0.0023%"
    assert glossary.token_count("ess", 0.5, 10) is None  # not a share of tokens


@pytest.mark.parametrize("share, text", [
    (23 / 1_000_000, "0.0023%"), (0.5, "50.00%"), (0.1234, "12.34%"), (0.004, "0.40%"), (0.0, "0%"),
    (1 / 3 * 1e-3, "0.033%"), (2e-9, "2.0e-07%"), (None, "—"), (float("nan"), "—")])
def test_fmt_share_keeps_two_significant_digits(share, text):
    assert fmt_share(share) == text


def test_share_decimals_against_the_magnitude():
    for e in range(-9, 0):
        for m in (1.0, 2.3, 9.9):
            v = m * 10.0 ** e
            text = f"{v:.{share_decimals(v)}%}"
            digits = text.rstrip("%").replace(".", "").lstrip("0")
            assert len(digits) == 2 and abs(float(text.rstrip("%")) / 100 - v) <= 0.051 * v, (v, text)


@pytest.mark.parametrize("top", [2.3e-5, 4e-4, 0.0071, 0.05, 0.3, 1.0])
def test_share_ticks_never_all_read_zero(top):
    """Ticks a tenth of the largest share apart (what an axis with ~10 ticks draws) keep distinct, non-zero
    labels; the d3 "%" format with fixed decimals prints as Python's format()."""
    fmt = share_tickformat(top)[1:]
    ticks = [top * k / 10 for k in range(1, 11)]
    labels = [format(v, fmt) for v in ticks]
    assert all(float(lab.rstrip("%")) > 0 for lab in labels), labels
    assert len(set(labels)) == len(labels), labels


def test_step_curves_axis_of_a_tiny_share():
    df = pl.DataFrame({"run": ["a"] * 3, "step": [0, 1, 2], "ratio_frac_high": [0.0, 2.3e-5, 1.1e-5]})
    fig = charts.step_curves(df, ["ratio_frac_high"], {"a": "#1f77b4"})
    fmt = fig.layout.yaxis.tickformat
    assert format(2.3e-6, fmt[1:]) != format(0.0, fmt[1:])  # a tick at a tenth of the top is not "0…%"
    assert charts.hover_format("ratio_frac_high") == ".3~p"  # d3 significant-digit percent on hover


def test_log_ticks_label_their_values():
    vals, text = log_ticks(0.15, 6.0)
    assert text == ["0.2", "0.5", "1", "2", "5"]
    assert [float(t) for t in text] == vals
    vals, text = log_ticks(0.004, 120)
    assert vals == [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]
    assert all(math.isclose(float(t), v) for t, v in zip(text, vals))
    assert log_ticks(2e-6, 1e-5)[1] == ["2e-6", "5e-6", "1e-5"]
    assert log_ticks(0, 1) == ([], []) and log_ticks(2, 1) == ([], [])


def test_r_histogram_log_axis_shows_fractions():
    """The r histogram on a log x axis: the labels below 1 are 0.2 and 0.5, not "2" and "5"."""
    edges = np.geomspace(0.1, 10, 21)
    df = pl.DataFrame({"run": ["a"] * 20, "bin_lo": edges[:-1], "bin_hi": edges[1:], "count": [5] * 20,
                       "frac": [0.05] * 20})
    axis = charts.histogram(df, {"a": "#1f77b4"}, "r", log_x=True).layout.xaxis
    assert axis.type == "log" and axis.tickmode == "array"
    assert list(axis.ticktext) == ["0.1", "0.2", "0.5", "1", "2", "5", "10"]
    assert list(axis.tickvals) == [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0]


def test_tiny_card_values_are_short_scientific_numbers():
    """The demo's KL of 8.654e-04 was cut to "8.654e-…" on a card five to a row: 3 digits and a bare exponent, with
    the value read back to 3 significant digits; larger values keep 4 significant digits."""
    assert glossary.fmt_value("kl_k3", 8.6543e-5) == "8.65e-5"
    assert glossary.fmt_value("kl_k3", -1.2349e-7) == "-1.23e-7"
    assert glossary.fmt_value("kl_k3", 9.996e-4) == "1.00e-3"
    for v in (8.6543e-5, 3.3e-12, 7.77e-4):
        assert abs(float(glossary.fmt_value("kl_k3", v)) - v) <= 5e-3 * abs(v)
    assert glossary.fmt_value("kl_k3", 0.07042) == "0.07042" and glossary.fmt_value("kl_k3", 0.0) == "0"
