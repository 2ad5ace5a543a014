"""Evaluation statistics: pass@k, avg@k, maj@k, bootstrap CIs, two-sample and paired tests, the paired
design's exact sign-flip p, post-hoc detectable difference, equivalence (TOST) and interaction tests.

The tests and the bootstrap are scipy.stats': Welch's t-test is ``ttest_ind(equal_var=False)``,
Student-t p-values and quantiles come from ``scipy.stats.t``, the permutation test is
``permutation_test``, the paired tests are ``wilcoxon`` and ``ttest_rel`` and the CI is
``bootstrap(method="percentile")``, each drawing from
``np.random.default_rng(seed)`` in the batches the earlier hand-written versions used, so the
numbers are theirs to float precision. scipy refuses samples of one value; for those the
single-value CI and the few permutation relabelings are computed here. pass@k, avg@k and maj@k
are written here too: no library provides them.

Conventions: ``correct`` is a ``[P, k]`` boolean matrix (P problems, k samples each);
per-problem values are what CIs resample (problems are the unit of replication).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from itertools import combinations

import numpy as np


def _sps():
    """scipy.stats, imported where a test or interval first needs it: a process that never does (a
    training run, the CLI's start) is spared its import, about half a second."""
    from scipy import stats

    return stats


# --------------------------------------------------------------------------- sampling metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, eq. 1).

    ``1 - C(n-c, k) / C(n, k)`` computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, which
    never forms the (huge) binomials.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"pass_at_k: {name} must be an integer, got {v!r}")
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_matrix(correct, k: int, per_problem: bool = False) -> float | np.ndarray:
    """pass@k of a ``[P, n]`` correctness matrix: mean over problems (or the ``[P]`` values)."""
    m = _as_matrix(correct)
    vals = np.array([pass_at_k(m.shape[1], int(row.sum()), k) for row in m])  # [P]
    return vals if per_problem else float(vals.mean())


def avg_at_k(correct, per_problem: bool = False) -> float | np.ndarray:
    """Mean accuracy over all k samples of all problems of a ``[P, k]`` matrix.

    With ``per_problem`` the ``[P]`` per-problem accuracies (what a bootstrap resamples).
    """
    m = _as_matrix(correct).astype(np.float64)
    vals = m.mean(axis=1)  # [P]
    return vals if per_problem else float(vals.mean())


def maj_at_k(
    answers: Sequence[Sequence[str | None]], correct, per_problem: bool = False, *, normalize_fn: Callable[[str], str]
) -> float | np.ndarray:
    """Majority-vote accuracy: the most frequent normalised answer of each problem's k samples.

    ``answers[p][j]`` is sample j's extracted answer (None or empty = no answer, no vote),
    compared after ``normalize_fn`` (for math answers: ``masktrl.tasks.grader.normalize``);
    ``correct[p][j]`` its correctness. The problem counts as solved when the winning answer's
    first sample is correct. Ties go to the answer that appears first (lowest sample index),
    so results are deterministic and independent of hashing. No votes at all = unsolved.
    """
    m = _as_matrix(correct)
    if len(answers) != m.shape[0] or any(len(a) != m.shape[1] for a in answers):
        raise ValueError(f"maj_at_k: answers must have the shape of correct {m.shape}")
    vals = np.zeros(m.shape[0])
    for p, row in enumerate(answers):
        counts: dict[str, int] = {}
        first: dict[str, int] = {}
        for j, ans in enumerate(row):
            key = normalize_fn(ans) if isinstance(ans, str) else ""
            if key:
                counts[key] = counts.get(key, 0) + 1
                first.setdefault(key, j)
        if counts:
            winner = min(counts, key=lambda a: (-counts[a], first[a]))
            vals[p] = float(m[p, first[winner]])
    return vals if per_problem else float(vals.mean())


def _as_matrix(correct) -> np.ndarray:
    m = np.asarray(correct, dtype=bool)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"expected a non-empty [P, k] matrix, got shape {m.shape}")
    return m


# --------------------------------------------------------------------------- intervals


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std with ddof=1 over sqrt(n)); se is nan for n < 2."""
    v = _as_vector(values)
    se = float(v.std(ddof=1) / math.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def bootstrap_ci(
    values, n_boot: int = 10000, alpha: float = 0.05, seed: int = 0, stat: Callable = np.mean
) -> tuple[float, float]:
    """Percentile bootstrap ``(low, high)`` of ``stat`` over resampled ``values`` (e.g. problems).

    ``scipy.stats.bootstrap(method="percentile")``, drawing the resamples from
    ``np.random.default_rng(seed)`` in batches of at most 4M values. ``stat`` is called as
    ``stat(samples, axis=...)`` when it accepts ``axis`` (np.mean, np.median...), else once per
    resample. A single value is its own interval (scipy needs two).
    """
    v = _as_vector(values)
    if not 0 < alpha < 1 or n_boot < 1:
        raise ValueError(f"bootstrap_ci needs 0 < alpha < 1 and n_boot >= 1, got {alpha}, {n_boot}")
    if v.size == 1:
        one = float(np.asarray(stat(v[None, :], axis=1)).reshape(-1)[0]) if _takes_axis(stat) else float(stat(v))
        return one, one
    batch = max(1, min(n_boot, 4_000_000 // v.size))
    res = _sps().bootstrap(
        (v,),
        stat,
        n_resamples=n_boot,
        batch=batch,
        confidence_level=1 - alpha,
        method="percentile",
        vectorized=_takes_axis(stat),
        rng=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _takes_axis(fn: Callable) -> bool:
    import inspect

    try:
        return "axis" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some numpy functions have no signature
        return True


def _as_vector(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError("expected at least one value")
    return v


# --------------------------------------------------------------------------- tests


def student_t_pvalue(t: float, df: float) -> float:
    """Two-sided p-value P(|T| >= |t|) of Student's t with ``df`` degrees of freedom."""
    if math.isnan(t) or not df > 0:
        return float("nan")
    return float(min(1.0, 2.0 * _sps().t.sf(abs(t), df)))


def t_critical(df: float, alpha: float = 0.05) -> float:
    """The two-sided Student-t quantile: P(|T| >= t) = alpha."""
    return float(_sps().t.ppf(1.0 - alpha / 2.0, df))


def welch_t_test(a, b) -> tuple[float, float]:
    """Welch's unequal-variance t-test of mean(a) == mean(b): ``(t, two-sided p)``.

    ``scipy.stats.ttest_ind(equal_var=False)`` (Welch–Satterthwaite degrees of freedom). Both
    groups need >= 2 values, else ``(nan, nan)``. With zero variance in both: ``(0, 1)`` for
    equal means, ``(±inf, 0)`` otherwise (scipy would return nan).
    """
    x, y = _as_vector(a), _as_vector(b)
    if x.size < 2 or y.size < 2:
        return float("nan"), float("nan")
    diff = float(x.mean() - y.mean())
    if x.var(ddof=1) / x.size + y.var(ddof=1) / y.size == 0.0:
        return (0.0, 1.0) if diff == 0.0 else (math.copysign(math.inf, diff), 0.0)
    with warnings.catch_warnings():  # near-equal values: scipy warns of precision loss; the result stands
        warnings.simplefilter("ignore", RuntimeWarning)
        res = _sps().ttest_ind(x, y, equal_var=False)
    return float(res.statistic), float(res.pvalue)


def permutation_test(a, b, n_perm: int = 10000, seed: int = 0) -> float:
    """Two-sided permutation p-value for a difference in means between ``a`` and ``b``.

    ``scipy.stats.permutation_test`` on the statistic |mean(a) - mean(b)| (alternative
    "greater", so relabelings at least as extreme in either direction count). Exact (all
    relabelings enumerated) when there are at most ``n_perm`` of them; otherwise Monte Carlo
    with the ``(1 + hits) / (1 + n_perm)`` correction, so p > 0. The relabelings are drawn
    from ``np.random.default_rng(seed)`` in batches of at most 2M values.
    """
    x, y = _as_vector(a), _as_vector(b)
    if min(x.size, y.size) < 2:  # scipy needs two values per sample; here there are only n relabelings
        return _exact_permutation_p(x, y)
    batch = max(1, min(n_perm, 2_000_000 // (x.size + y.size)))

    def abs_mean_diff(u, v, axis):
        return np.abs(np.mean(u, axis=axis) - np.mean(v, axis=axis))

    res = _sps().permutation_test(
        (x, y),
        abs_mean_diff,
        permutation_type="independent",
        vectorized=True,
        n_resamples=n_perm,
        batch=batch,
        alternative="greater",
        rng=np.random.default_rng(seed),
    )
    return float(res.pvalue)


def _exact_permutation_p(x: np.ndarray, y: np.ndarray) -> float:
    """The exact two-sided p-value of |mean(x) - mean(y)| over every relabeling."""
    pooled = np.concatenate([x, y])
    n, na, total = pooled.size, x.size, pooled.sum()
    observed = abs(x.mean() - y.mean())
    tol = 1e-12 * max(1.0, float(np.abs(pooled).max()))  # relabelings that tie count as extreme
    sums = np.array([pooled[list(idx)].sum() for idx in combinations(range(n), na)])
    return float(np.mean(np.abs(sums / na - (total - sums) / (n - na)) >= observed - tol))


def paired_tests(a, b) -> dict:
    """Paired comparison of ``a[i]`` and ``b[i]`` (the same replicates measured twice).

    ``n`` pairs, ``diff_mean`` and ``diff_se`` of d = a - b, the paired t-test
    (``scipy.stats.ttest_rel``: ``t``, ``p_ttest``) and the Wilcoxon signed-rank test
    (``scipy.stats.wilcoxon``, zero differences dropped, exact for small n: ``w``,
    ``p_wilcoxon``), both two-sided. Fewer than 2 pairs: the p-values are nan. All differences
    equal: the t-test gives p = 1 if they are 0, else 0 (scipy would return nan); all zero: the
    Wilcoxon p is 1.
    """
    x, y = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"paired_tests needs samples of one length, got {x.size} and {y.size}")
    d = x - y
    out = {
        "n": int(d.size),
        "diff_mean": float(d.mean()) if d.size else float("nan"),
        "diff_se": mean_se(d)[1] if d.size else float("nan"),
        "t": float("nan"),
        "p_ttest": float("nan"),
        "w": float("nan"),
        "p_wilcoxon": float("nan"),
    }
    if d.size < 2:
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if np.all(d == d[0]):
            out["t"], out["p_ttest"] = (0.0, 1.0) if d[0] == 0 else (math.copysign(math.inf, d[0]), 0.0)
        else:
            res = _sps().ttest_rel(x, y)
            out["t"], out["p_ttest"] = float(res.statistic), float(res.pvalue)
        if np.all(d == 0):
            out["w"], out["p_wilcoxon"] = 0.0, 1.0
        else:
            res = _sps().wilcoxon(x, y, zero_method="wilcox")
            out["w"], out["p_wilcoxon"] = float(res.statistic), float(res.pvalue)
    return out


# --------------------------------------------------------------------------- replicates nested in runs


def run_blocked_test(diff, runs, n_perm: int = 10000, seed: int = 0) -> dict:
    """Paired comparison when replicates (batches) are nested in runs: the run is the unit.

    ``diff`` [n]: per-replicate differences a - b; ``runs`` [n]: the run of each replicate. The
    statistic is T = mean over runs of the run's mean difference; under the null of no difference
    between a and b the labels a/b can be swapped for a whole run at once (a run's batches share
    its trajectory, so they cannot be swapped one by one), i.e. the sign of each run's mean flips
    independently. p = P(|T*| >= |T|) over the 2^R sign vectors (exact when 2^R <= n_perm, else
    Monte Carlo with (1 + hits) / (1 + n_perm)); ties count as extreme. Hence p = 1 for one run,
    p = 1 when every run's mean difference is 0, and p >= 2^(1-R) whatever the batches say.
    Returns {unit: "run", n_runs, n_replicates, diff_mean: T, diff_se (over run means), p, exact}.
    """
    d = np.asarray(diff, dtype=np.float64).reshape(-1)
    r = np.asarray(runs).reshape(-1)
    if d.shape != r.shape:
        raise ValueError(f"run_blocked_test needs one run per difference, got {d.size} and {r.size}")
    ok = np.isfinite(d)
    d, r = d[ok], r[ok]
    labels = list(dict.fromkeys(r.tolist()))
    means = np.array([d[r == x].mean() for x in labels])
    out = {
        "unit": "run",
        "n_runs": len(labels),
        "n_replicates": int(d.size),
        "diff_mean": float(means.mean()) if means.size else float("nan"),
        "diff_se": mean_se(means)[1] if means.size > 1 else float("nan"),
        "p": float("nan"),
        "exact": True,
    }
    if not means.size:
        return out
    t = abs(means.mean())
    tol = 1e-12 * max(1.0, float(np.abs(means).max()))
    n_runs = means.size
    if 2**n_runs <= n_perm:
        signs = ((np.arange(2**n_runs)[:, None] >> np.arange(n_runs)) & 1) * 2 - 1  # [2^R, R] every sign vector
        out["p"] = float(np.mean(np.abs(signs @ means / n_runs) >= t - tol))
    else:
        rng = np.random.default_rng(seed)
        signs = rng.choice((-1.0, 1.0), size=(n_perm, n_runs))
        hits = int(np.sum(np.abs(signs @ means / n_runs) >= t - tol))
        out["p"], out["exact"] = (1 + hits) / (1 + n_perm), False
    return out


# --------------------------------------------------------------------------- paired design: power, equivalence, exact p


def _diffs(d) -> np.ndarray:
    v = np.asarray(d, dtype=np.float64).reshape(-1)
    return v[np.isfinite(v)]


def sign_flip_p(d, n_perm: int = 2**16, seed: int = 0) -> float:
    """Two-sided exact sign-flip (paired permutation) p-value of mean(d) = 0: the share of the
    2^n sign vectors whose |mean| is at least the observed one (ties count as extreme); Monte Carlo
    with (1 + hits) / (1 + n_perm) when 2^n > n_perm. Its floor is 2^(1-n): 0.0625 at n = 5, so
    with 5 pairs nothing is below 0.05. nan for no pair. Equals ``scipy.stats.permutation_test``
    with ``permutation_type="samples"`` on one sample."""
    v = _diffs(d)
    if v.size == 0:
        return float("nan")
    return run_blocked_test(v, np.arange(v.size), n_perm=n_perm, seed=seed)["p"]


def paired_mdd(d, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference the two-sided paired t-test at ``alpha`` detects with
    probability ``power``, from the observed SD of the differences ``d`` (so post hoc): delta with
    P(|T| > t_{1-alpha/2, n-1}) = power for T noncentral t with df n-1 and noncentrality
    delta sqrt(n) / s_d (both tails counted, as statsmodels' ``TTestPower``). nan with < 2 pairs;
    0 when every difference is equal."""
    v = _diffs(d)
    n = v.size
    if n < 2 or not 0 < alpha < 1 or not 0 < power < 1:
        return float("nan")
    if np.all(v == v[0]):
        return 0.0
    s = float(v.std(ddof=1))
    df = n - 1
    crit = float(_sps().t.ppf(1 - alpha / 2, df))

    def achieved(es: float) -> float:
        nc = es * math.sqrt(n)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            upper, lower = float(_sps().nct.sf(crit, df, nc)), float(_sps().nct.cdf(-crit, df, nc))
        # far in the tail scipy's noncentral t can return nan: the upper tail is then 1, the lower 0
        return (upper if math.isfinite(upper) else 1.0) + (lower if math.isfinite(lower) else 0.0) - power

    hi = 1.0
    while achieved(hi) < 0:
        hi *= 2
    from scipy.optimize import brentq

    return float(brentq(achieved, 0.0, hi, xtol=1e-12, rtol=1e-12)) * s


def tost_paired(d, margin: float) -> dict:
    """Two one-sided paired t-tests of equivalence: H0 |mean(d)| >= margin against |mean(d)| <
    margin. t_low = (mean + margin) / se (H0 mean <= -margin), t_high = (mean - margin) / se
    (H0 mean >= margin), df n-1; p = max of the two one-sided p-values (statsmodels'
    ``ttost_paired(x, y, -margin, margin)``). Equivalence at alpha is p < alpha, i.e. the
    (1 - 2 alpha) interval inside (-margin, margin). nan with < 2 pairs; with no spread p is 0
    inside the margin and 1 outside."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0 or math.isinf(margin):
        raise ValueError(f"the equivalence margin must be a positive number, got {margin!r}")
    v = _diffs(d)
    out = {"margin": float(margin), "n": int(v.size), "t_low": float("nan"), "t_high": float("nan"), "p": float("nan")}
    if v.size < 2:
        return out
    m, se = float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))
    if se == 0:
        out["p"] = 0.0 if abs(m) < margin else 1.0
        return out
    df = v.size - 1
    out["t_low"], out["t_high"] = (m + margin) / se, (m - margin) / se
    out["p"] = float(max(_sps().t.sf(out["t_low"], df), _sps().t.cdf(out["t_high"], df)))
    return out


def interaction_test(d1, d2, *, paired: bool = False, margin: float | None = None) -> dict:
    """Does an effect depend on the source? ``d1``, ``d2``: the effect (a - b, one value per seed)
    under two sources. The interaction is mean(d1) - mean(d2): Welch's t-test of d1 vs d2
    (``scipy.stats.ttest_ind(equal_var=False)``), or, with ``paired`` (the same seeds in both
    sources, in order), the one-sample t-test of d1 - d2 (``ttest_rel``) and its exact sign-flip
    p. With ``margin``, the TOST of the interaction (Welch df, or paired): "the effect does not
    depend on the source" needs that p < alpha, not a large interaction p."""
    x, y = _diffs(d1), _diffs(d2)
    out = {
        "interaction": float(x.mean() - y.mean()) if x.size and y.size else float("nan"),
        "paired": paired,
        "n1": int(x.size),
        "n2": int(y.size),
        "t": float("nan"),
        "p": float("nan"),
    }
    if paired:
        if x.size != y.size:
            raise ValueError(f"a paired interaction needs the same seeds under both sources, got {x.size} and {y.size}")
        r = paired_tests(x, y)
        out.update(t=r["t"], p=r["p_ttest"], p_sign_flip=sign_flip_p(x - y))
        if margin is not None:
            out["tost"] = tost_paired(x - y, margin)
        return out
    out["t"], out["p"] = welch_t_test(x, y)
    if margin is not None:
        out["tost"] = tost_welch(x, y, margin)
    return out


def tost_welch(a, b, margin: float) -> dict:
    """TOST of mean(a) - mean(b) within (-margin, margin) with Welch's standard error and
    Welch-Satterthwaite df (statsmodels' ``ttost_ind(usevar="unequal")``)."""
    tost_paired([margin], margin)  # validates the margin
    x, y = _diffs(a), _diffs(b)
    out = {
        "margin": float(margin),
        "n": int(min(x.size, y.size)),
        "t_low": float("nan"),
        "t_high": float("nan"),
        "p": float("nan"),
    }
    if min(x.size, y.size) < 2:
        return out
    va, vb = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    m, se = float(x.mean() - y.mean()), math.sqrt(va + vb)
    if se == 0:
        out["p"] = 0.0 if abs(m) < margin else 1.0
        return out
    df = (va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1))
    out["t_low"], out["t_high"] = (m + margin) / se, (m - margin) / se
    out["p"] = float(max(_sps().t.sf(out["t_low"], df), _sps().t.cdf(out["t_high"], df)))
    return out
