import math
from itertools import combinations

import numpy as np
import pytest
from scipy.special import betainc  # Student-t tail probabilities are I_x(df/2, 1/2): scipy's, checked here

from masktrl.stats import (
    avg_at_k,
    bootstrap_ci,
    maj_at_k,
    mean_se,
    pass_at_k,
    pass_at_k_matrix,
    permutation_test,
    student_t_pvalue,
    welch_t_test,
)
from masktrl.tasks.grader import normalize


def brute_pass_at_k(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_large_n():
    assert pass_at_k(10, 0, 5) == 0.0 and pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(1000, 1, 1000) == 1.0
    assert 0.0 < pass_at_k(2000, 1, 10) == pytest.approx(10 / 2000)
    for bad in [(5, 6, 1), (5, 2, 0), (5, 2, 6), (5.0, 2, 1), (5, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)
    m = np.array([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=bool)
    assert pass_at_k_matrix(m, 2) == pytest.approx((0.5 + 0 + 1) / 3)
    assert pass_at_k_matrix(m, 1, per_problem=True).tolist() == pytest.approx([0.25, 0.0, 1.0])


def test_avg_at_k():
    m = [[True, False, True, False], [True, True, True, True], [False] * 4]
    assert avg_at_k(m) == pytest.approx(0.5)
    assert avg_at_k(m, per_problem=True).tolist() == [0.5, 1.0, 0.0]
    with pytest.raises(ValueError):
        avg_at_k([1, 0, 1])


def test_maj_at_k_votes_ties_and_normalisation():
    answers = [
        ["42", "041", "042", "7"],  # "42" and "042" normalise together: 2 votes, correct
        ["1/2", "\\frac{1}{2}", "\\dfrac{1}{2}", "1/2"],  # "1/2" x2 vs "\frac{1}{2}" x2: the first seen wins
        ["5", "6", "6", "5"],  # tie 2-2: "5" appears first -> wrong here
        [None, "", None, "3"],  # only one vote
        [None, None, None, None],  # no votes -> unsolved
    ]
    correct = [
        [True, False, True, False],
        [True, True, True, True],
        [False, True, True, False],
        [False, False, False, True],
        [False, False, False, False],
    ]
    assert maj_at_k(answers, correct, per_problem=True, normalize_fn=normalize).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert maj_at_k(answers, correct, normalize_fn=normalize) == pytest.approx(3 / 5)
    with pytest.raises(ValueError):
        maj_at_k(answers[:2], correct, normalize_fn=normalize)


def test_bootstrap_ci():
    assert bootstrap_ci([0.7] * 20) == (pytest.approx(0.7), pytest.approx(0.7))
    lo, hi = bootstrap_ci([0.7] * 20)
    assert lo == hi
    rng = np.random.default_rng(1)
    values = rng.random(50)
    lo, hi = bootstrap_ci(values, n_boot=2000, seed=3)
    assert lo < values.mean() < hi and hi - lo < 0.5
    assert bootstrap_ci(values, n_boot=2000, seed=3) == (lo, hi)  # seeded
    lo99, hi99 = bootstrap_ci(values, n_boot=2000, alpha=0.01, seed=3)
    assert lo99 <= lo and hi <= hi99
    # stat without an axis argument falls back to one call per resample
    vals = [1.0, 2.0, 3.0, 5.0]
    assert bootstrap_ci(vals, n_boot=500, stat=lambda s: float(max(s))) == bootstrap_ci(vals, n_boot=500, stat=np.max)
    with pytest.raises(ValueError):
        bootstrap_ci([])


def test_mean_se():
    assert mean_se([1.0, 2.0, 3.0, 4.0]) == (2.5, pytest.approx(math.sqrt(5 / 3) / 2))
    m, se = mean_se([3.0])
    assert m == 3.0 and math.isnan(se)


@pytest.mark.parametrize(
    "a, b, x", [(0.5, 0.5, 0.3), (2.0, 3.0, 0.4), (5.0, 0.5, 0.9), (1.0, 1.0, 0.37), (30, 40, 0.45)]
)
def test_betainc_identities(a, b, x):
    assert betainc(a, b, x) + betainc(b, a, 1 - x) == pytest.approx(1.0, abs=1e-12)
    if a == 1.0 and b == 1.0:
        assert betainc(a, b, x) == pytest.approx(x)
    assert betainc(a, 1.0, x) == pytest.approx(x**a)
    assert betainc(1.0, b, x) == pytest.approx(1 - (1 - x) ** b)
    assert betainc(a, a, 0.5) == pytest.approx(0.5)
    # I_x(0.5, 0.5) = (2/pi) asin(sqrt(x))
    assert betainc(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), abs=1e-12)


def test_betainc_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    for a, b, x in [(0.5, 0.5, 0.3), (5, 0.5, 0.9), (100, 0.5, 0.99), (2.5, 3.5, 0.4), (0.1, 7.0, 0.02)]:
        ref = float(mpmath.betainc(a, b, 0, x, regularized=True))
        assert betainc(a, b, x) == pytest.approx(ref, rel=1e-10)


def test_student_t_pvalue_known_values():
    for t in [0.3, 1.0, 2.5, 10.0]:
        assert student_t_pvalue(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-10)  # Cauchy
        assert student_t_pvalue(-t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-10)
    assert student_t_pvalue(2.228138851986, 10) == pytest.approx(0.05, abs=1e-9)  # t_{0.975, 10}
    assert student_t_pvalue(1.959963984540, 1e7) == pytest.approx(0.05, abs=1e-6)  # -> normal
    assert student_t_pvalue(0.0, 5) == 1.0 and student_t_pvalue(math.inf, 5) == 0.0


def test_welch_t_test():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    t, p = welch_t_test(a, b)
    # by hand: se^2 = 5/12 + 2, t = -3.5 / sqrt(29/12), df = (29/12)^2 / ((5/12)^2/3 + 4/4)
    se2 = 5 / 12 + 2
    df = se2**2 / ((5 / 12) ** 2 / 3 + 1.0)
    assert t == pytest.approx(-3.5 / math.sqrt(se2))
    assert p == pytest.approx(student_t_pvalue(t, df))
    assert 0.06 < p < 0.08  # R: t.test(a, b) gives p = 0.06913
    assert p == pytest.approx(0.06913, abs=5e-5)
    assert welch_t_test([1, 1, 1], [1, 1]) == (0.0, 1.0)
    assert welch_t_test([1, 1, 1], [2, 2]) == (-math.inf, 0.0)
    assert all(math.isnan(v) for v in welch_t_test([1.0], [1.0, 2.0]))
    t_sym, p_sym = welch_t_test(b, a)
    assert t_sym == pytest.approx(-t) and p_sym == pytest.approx(p)


def test_permutation_test():
    # exact: 20 relabelings of 6 values, only the 2 extreme ones reach |diff| = 3
    assert permutation_test([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1)
    assert permutation_test([1, 2, 3], [1, 2, 3]) == 1.0
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, 30), rng.normal(1.5, 1, 30)
    p = permutation_test(x, y, n_perm=2000, seed=1)
    assert 0 < p < 0.01 and p == permutation_test(x, y, n_perm=2000, seed=1)
    same = permutation_test(rng.normal(0, 1, 30), rng.normal(0, 1, 30), n_perm=2000)
    assert same > 0.01


def test_paired_tests_are_scipy_s_with_the_degenerate_cases():
    from scipy import stats as sps

    from masktrl.stats import paired_tests

    a, b = [0.1, 0.5, 0.3, 0.4, 0.9], [0.2, 0.4, 0.1, 0.1, 0.3]
    r = paired_tests(a, b)
    assert r["n"] == 5 and r["diff_mean"] == pytest.approx(np.mean(np.subtract(a, b)))
    assert r["p_ttest"] == pytest.approx(sps.ttest_rel(a, b).pvalue) and r["p_wilcoxon"] == pytest.approx(
        sps.wilcoxon(a, b).pvalue
    )
    same = paired_tests([0.2, 0.4], [0.2, 0.4])
    assert same["p_ttest"] == 1.0 and same["p_wilcoxon"] == 1.0
    assert paired_tests([1.0, 2.0], [0.0, 1.0])["p_ttest"] == 0.0  # constant nonzero difference
    one = paired_tests([1.0], [0.0])
    assert np.isnan(one["p_ttest"]) and np.isnan(one["p_wilcoxon"])
    with pytest.raises(ValueError):
        paired_tests([1.0, 2.0], [1.0])
