"""Evaluation statistics: pass@k, avg@k, maj@k, bootstrap CIs and two-sample tests.

numpy only (no scipy): the Student-t p-value uses the regularized incomplete beta
function, computed with the Lentz continued fraction (Numerical Recipes, section 6.4).

Conventions: ``correct`` is a ``[P, k]`` boolean matrix (P problems, k samples each);
per-problem values are what CIs resample (problems are the unit of replication).
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Callable, Sequence

import numpy as np

from masktrl.tasks.grader import normalize

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
    answers: Sequence[Sequence[str | None]],
    correct,
    per_problem: bool = False,
    normalize_fn: Callable[[str], str] = normalize,
) -> float | np.ndarray:
    """Majority-vote accuracy: the most frequent normalised answer of each problem's k samples.

    ``answers[p][j]`` is sample j's extracted answer (None or empty = no answer, no vote);
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
    values,
    n_boot: int = 10000,
    alpha: float = 0.05,
    seed: int = 0,
    stat: Callable = np.mean,
) -> tuple[float, float]:
    """Percentile bootstrap ``(low, high)`` of ``stat`` over resampled ``values`` (e.g. problems).

    ``stat`` is called as ``stat(samples, axis=1)`` on ``[B, n]`` resamples when it accepts
    ``axis`` (np.mean, np.median...), else once per resample.
    """
    v = _as_vector(values)
    if not 0 < alpha < 1 or n_boot < 1:
        raise ValueError(f"bootstrap_ci needs 0 < alpha < 1 and n_boot >= 1, got {alpha}, {n_boot}")
    rng = np.random.default_rng(seed)
    chunk = max(1, min(n_boot, 4_000_000 // v.size))
    stats = []
    for start in range(0, n_boot, chunk):
        idx = rng.integers(0, v.size, size=(min(chunk, n_boot - start), v.size))  # [B, n]
        samples = v[idx]
        try:
            s = np.asarray(stat(samples, axis=1), dtype=np.float64)
        except TypeError:
            s = np.array([stat(row) for row in samples], dtype=np.float64)
        stats.append(s.reshape(-1))
    lo, hi = np.quantile(np.concatenate(stats), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def _as_vector(values) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        raise ValueError("expected at least one value")
    return v


# --------------------------------------------------------------------------- tests


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if a <= 0 or b <= 0 or not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc needs a, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x == 0.0 or x == 1.0:
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):  # the continued fraction converges fast here
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float, eps: float = 1e-15, max_iter: int = 100_000) -> float:
    """Continued fraction of I_x(a, b) by the modified Lentz method."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, max_iter + 1):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"betainc continued fraction did not converge (a={a}, b={b}, x={x})")


def student_t_pvalue(t: float, df: float) -> float:
    """Two-sided p-value P(|T| >= |t|) of Student's t with ``df`` degrees of freedom."""
    if math.isnan(t) or not df > 0:
        return float("nan")
    if math.isinf(t):
        return 0.0
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t * t)))


def welch_t_test(a, b) -> tuple[float, float]:
    """Welch's unequal-variance t-test of mean(a) == mean(b): ``(t, two-sided p)``.

    Degrees of freedom by Welch–Satterthwaite. Both groups need >= 2 values, else
    ``(nan, nan)``. With zero variance in both: ``(0, 1)`` for equal means, ``(±inf, 0)``
    otherwise.
    """
    x, y = _as_vector(a), _as_vector(b)
    if x.size < 2 or y.size < 2:
        return float("nan"), float("nan")
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    diff = float(x.mean() - y.mean())
    se2 = vx + vy
    if se2 == 0.0:
        return (0.0, 1.0) if diff == 0.0 else (math.copysign(math.inf, diff), 0.0)
    t = diff / math.sqrt(se2)
    df = se2**2 / (vx**2 / (x.size - 1) + vy**2 / (y.size - 1))
    return float(t), float(student_t_pvalue(float(t), float(df)))


def permutation_test(a, b, n_perm: int = 10000, seed: int = 0) -> float:
    """Two-sided permutation p-value for a difference in means between ``a`` and ``b``.

    Exact (all relabelings enumerated) when there are at most ``n_perm`` of them;
    otherwise Monte Carlo with the ``(1 + hits) / (1 + n_perm)`` correction, so p > 0.
    """
    x, y = _as_vector(a), _as_vector(b)
    pooled = np.concatenate([x, y])
    n, na = pooled.size, x.size
    observed = abs(x.mean() - y.mean())
    tol = 1e-12 * max(1.0, float(np.abs(pooled).max()))  # relabelings that tie count as extreme
    total = pooled.sum()
    if math.comb(n, na) <= n_perm:
        sums = np.array([pooled[list(idx)].sum() for idx in combinations(range(n), na)])
        diffs = np.abs(sums / na - (total - sums) / (n - na))
        return float(np.mean(diffs >= observed - tol))
    rng = np.random.default_rng(seed)
    hits = 0
    chunk = max(1, min(n_perm, 2_000_000 // n))
    for start in range(0, n_perm, chunk):
        perms = rng.permuted(np.broadcast_to(pooled, (min(chunk, n_perm - start), n)), axis=1)  # [B, n]
        sums = perms[:, :na].sum(axis=1)
        diffs = np.abs(sums / na - (total - sums) / (n - na))
        hits += int(np.sum(diffs >= observed - tol))
    return (1 + hits) / (1 + n_perm)
