"""The paired design's statistics (issue #40.4): exact sign-flip p, post-hoc paired MDD, TOST and the
interaction test against scipy and statsmodels on three classic paired data sets, plus their
published values. statsmodels is a test-only reference (the dev extra); without it those checks skip."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from masktrl.stats import interaction_test, paired_mdd, paired_tests, sign_flip_p, tost_paired, tost_welch

# Student (1908) / Cushny & Peebles: extra hours of sleep under two drugs, the same 10 patients (R's `sleep`)
SLEEP = ([0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0], [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4])
# Darwin's Zea mays, 15 pairs of cross- and self-fertilised plants (Fisher 1935, the design of experiments §21)
DARWIN = (
    [23.5, 12, 21, 22, 19.125, 21.5, 22.125, 20.375, 18.25, 21.625, 23.25, 21, 22.125, 23, 12],
    [17.375, 20.375, 20, 20, 18.375, 18.625, 18.625, 15.25, 16.5, 18, 16.25, 18, 12.75, 15.5, 18],
)
# Box, Hunter & Hunter: shoe-sole wear, material A and B on the two feet of 10 boys (R's MASS::shoes)
SHOES = (
    [13.2, 8.2, 10.9, 14.3, 10.7, 6.6, 9.5, 10.8, 8.8, 13.3],
    [14.0, 8.8, 11.2, 14.2, 11.8, 6.4, 9.8, 11.3, 9.3, 13.6],
)
DATA = {"sleep": SLEEP, "darwin": DARWIN, "shoes": SHOES}
PUBLISHED_T = {"sleep": (-4.0621, 0.002833), "darwin": (2.1480, 0.04970), "shoes": (-3.3489, 0.008539)}


def _d(name):
    a, b = DATA[name]
    return np.subtract(a, b)


@pytest.mark.parametrize("name", sorted(DATA))
def test_paired_t_is_scipy_and_the_published_value(name):
    a, b = DATA[name]
    r = paired_tests(a, b)
    ref = sps.ttest_rel(a, b)
    assert r["t"] == pytest.approx(ref.statistic, rel=1e-12) and r["p_ttest"] == pytest.approx(ref.pvalue, rel=1e-12)
    t, p = PUBLISHED_T[name]
    assert r["t"] == pytest.approx(t, abs=1e-4) and r["p_ttest"] == pytest.approx(p, rel=1e-3)


@pytest.mark.parametrize("name", sorted(DATA))
def test_sign_flip_p_is_scipy_permutation_test_exactly(name):
    d = _d(name)
    ref = sps.permutation_test(
        (d,),
        lambda x, axis: np.mean(x, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=np.inf,
        alternative="two-sided",
    )
    assert sign_flip_p(d) == pytest.approx(ref.pvalue, rel=1e-12)


def test_sign_flip_p_published_and_its_floor():
    assert sign_flip_p(_d("darwin")) == pytest.approx(1726 / 32768, rel=1e-12)  # Fisher's 5.27%
    assert sign_flip_p([0.1, 0.2, 0.15, 0.3, 0.05]) == 2 / 32  # five positive differences: the floor 0.0625
    assert math.isnan(sign_flip_p([]))


@pytest.mark.parametrize("name", sorted(DATA))
@pytest.mark.parametrize("alpha", [0.05, 0.05 / 7])
def test_paired_mdd_is_statsmodels_ttest_power(name, alpha):
    power = pytest.importorskip("statsmodels.stats.power", reason="statsmodels (the dev extra) is the reference")
    d = _d(name)
    es = power.TTestPower().solve_power(nobs=d.size, alpha=alpha, power=0.8, alternative="two-sided")
    assert paired_mdd(d, alpha=alpha) == pytest.approx(es * d.std(ddof=1), rel=1e-6)


def test_paired_mdd_limits():
    assert math.isnan(paired_mdd([0.1])) and paired_mdd([0.2, 0.2, 0.2]) == 0.0
    d = _d("sleep")
    assert paired_mdd(d, alpha=0.05 / 7) > paired_mdd(d, alpha=0.05)  # a stricter alpha needs a larger difference


@pytest.mark.parametrize("name", sorted(DATA))
@pytest.mark.parametrize("margin", [0.5, 2.0, 5.0])
def test_tost_is_statsmodels_ttost_paired(name, margin):
    wm = pytest.importorskip("statsmodels.stats.weightstats", reason="statsmodels (the dev extra) is the reference")
    a, b = DATA[name]
    p, low, high = wm.ttost_paired(np.asarray(a), np.asarray(b), -margin, margin)
    got = tost_paired(np.subtract(a, b), margin)
    assert got["p"] == pytest.approx(p, rel=1e-10)
    assert got["t_low"] == pytest.approx(low[0], rel=1e-10) and got["t_high"] == pytest.approx(high[0], rel=1e-10)


def test_tost_by_hand_and_bad_margins():
    d = _d("shoes")  # mean -0.41, se 0.1224
    m, se = d.mean(), d.std(ddof=1) / math.sqrt(d.size)
    p = max(sps.t.sf((m + 1.0) / se, d.size - 1), sps.t.cdf((m - 1.0) / se, d.size - 1))
    assert tost_paired(d, 1.0)["p"] == pytest.approx(p, rel=1e-12) and tost_paired(d, 1.0)["p"] < 0.05
    assert tost_paired(d, 0.3)["p"] > 0.5  # the difference is larger than the margin: not equivalent
    for bad in (0, -1.0, float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="margin"):
            tost_paired(d, bad)


@pytest.mark.parametrize("pair", [("sleep", "shoes"), ("darwin", "sleep"), ("shoes", "darwin")])
def test_interaction_is_welch_on_the_effects_and_tost_is_statsmodels(pair):
    x, y = _d(pair[0]), _d(pair[1])
    r = interaction_test(x, y, margin=1.0)
    ref = sps.ttest_ind(x, y, equal_var=False)
    assert r["interaction"] == pytest.approx(x.mean() - y.mean()) and r["p"] == pytest.approx(ref.pvalue, rel=1e-12)
    wm = pytest.importorskip("statsmodels.stats.weightstats", reason="statsmodels (the dev extra) is the reference")
    p, _, _ = wm.ttost_ind(x, y, -1.0, 1.0, usevar="unequal")
    assert r["tost"]["p"] == pytest.approx(p, rel=1e-10)
    assert tost_welch(x, y, 1.0)["p"] == r["tost"]["p"]


def test_paired_interaction_is_the_t_test_of_the_difference_of_effects():
    a, b = DATA["sleep"]
    c, d = DATA["shoes"]
    e1, e2 = np.subtract(a, b), np.subtract(c, d)
    r = interaction_test(e1, e2, paired=True, margin=2.0)
    ref = sps.ttest_1samp(e1 - e2, 0.0)
    assert r["p"] == pytest.approx(ref.pvalue, rel=1e-12) and r["p_sign_flip"] == sign_flip_p(e1 - e2)
    assert r["tost"]["p"] == tost_paired(e1 - e2, 2.0)["p"]
    with pytest.raises(ValueError, match="same seeds"):
        interaction_test(e1, e2[:5], paired=True)
