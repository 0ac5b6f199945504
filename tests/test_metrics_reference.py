"""Checks of the brute-force numpy references (tests/helpers/reference.py) on hand-computed numbers: the metrics
of METRICS.md written from the definitions, which the other metric tests compare the library with."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from helpers.reference import ref_max_vio, ref_token_metrics

# -- the references on hand-computed numbers ------------------------------------------------------------

def test_reference_one_token_by_hand():
    m = ref_token_metrics(np.array([math.log(0.5)]), np.array([math.log(0.25)]), np.array([0]))
    assert m["kl_k1"] == pytest.approx(math.log(2))
    assert m["ratio_mean"] == pytest.approx(0.5)
    assert m["kl_k3"] == pytest.approx(0.5 - 1 + math.log(2))
    assert m["ratio_frac_low"] == 0.0 and m["prob_pearson"] is None
    assert m["ppl_ratio"] == pytest.approx(2.0)
    assert m["chi2_seq"] == pytest.approx(0.25 - 1)
    assert m["mult_prob_error"] == pytest.approx(2.0)  # exp(|log 0.5|)
    assert m["kl_k3_reverse"] == pytest.approx(2.0 - 1 - math.log(2))
    assert m["seq_geo_ratio_mean"] == m["seq_geo_ratio_min"] == pytest.approx(0.5)


def test_reference_kl3_reverse_example_of_metrics_md():
    # METRICS.md: s = −5, t = −15 gives kl_k3 ≈ 9 but kl_k3_reverse ≈ 22,015
    m = ref_token_metrics(np.array([-5.0]), np.array([-15.0]), np.array([0]))
    assert m["kl_k3"] == pytest.approx(9.0, abs=1e-4)
    assert m["kl_k3_reverse"] == pytest.approx(22015.47, rel=1e-6)


def test_reference_ess_and_max_vio_by_hand():
    # w = (0.5, 2): mean 1.25, mean w² 2.125 -> ess = 1.5625 / 2.125
    m = ref_token_metrics(np.log([0.5, 0.25]), np.log([0.125, 1.0]), np.array([0, 0]), cap=2.0)
    assert m["ess"] == pytest.approx(1.5625 / 2.125)
    assert ref_max_vio(Counter({1: 3, 2: 1})) == pytest.approx((3 - 2) / 2)
    assert ref_max_vio(Counter()) is None
