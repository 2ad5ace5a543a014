"""The run-blocked sign-flip test (masktrl.stats.run_blocked_test): the run is the unit when
batches are nested in runs."""

from __future__ import annotations

import numpy as np
import pytest

from masktrl.stats import paired_tests, run_blocked_test


def test_no_difference_in_any_run_gives_p_1():
    runs = np.repeat(["a", "b", "c"], 13)
    res = run_blocked_test(np.zeros(39), runs)
    assert res["p"] == 1.0 and res["unit"] == "run" and res["n_runs"] == 3 and res["n_replicates"] == 39


def test_identical_runs_carry_one_run_of_evidence():
    """Three copies of one run (13 batches each): the per-batch paired t-test calls the
    difference certain; the run-blocked test cannot go below 2^(1-R) = 0.25 (one run: p = 1)."""
    one = np.random.default_rng(0).normal(0.05, 0.02, 13)
    d = np.tile(one, 3)
    runs = np.repeat(["r0", "r1", "r2"], 13)
    assert paired_tests(d, np.zeros(39))["p_ttest"] < 1e-10
    assert run_blocked_test(d, runs)["p"] == pytest.approx(0.25)
    assert run_blocked_test(one, np.repeat("r0", 13))["p"] == 1.0


def test_exact_enumeration_and_monte_carlo_agree():
    rng = np.random.default_rng(1)
    runs = np.repeat(np.arange(12), 3)
    d = rng.normal(0.3, 1.0, 36) + np.repeat(rng.normal(0, 0.5, 12), 3)
    exact = run_blocked_test(d, runs, n_perm=10000)
    mc = run_blocked_test(d, runs, n_perm=2000, seed=3)
    assert exact["exact"] and not mc["exact"]
    assert mc["p"] == pytest.approx(exact["p"], abs=0.03)
    means = np.array([d[runs == i].mean() for i in range(12)])
    assert exact["diff_mean"] == pytest.approx(means.mean())


def test_consistent_runs_are_detected():
    runs = np.repeat(np.arange(8), 4)
    d = 0.1 + 0.01 * np.random.default_rng(2).normal(size=32)
    assert run_blocked_test(d, runs)["p"] == pytest.approx(2 / 2**8)  # only the all-equal sign vectors tie


def test_nan_differences_are_dropped_and_shapes_checked():
    res = run_blocked_test([0.1, np.nan, 0.2], ["a", "a", "b"])
    assert res["n_replicates"] == 2 and res["n_runs"] == 2
    with pytest.raises(ValueError):
        run_blocked_test([0.1, 0.2], ["a"])


def test_disagreement_summary_uses_the_run_when_runs_are_pooled():
    """The same per-replicate rates, once as 4 batches of one run and once as 2 batches of each
    of 2 runs: one run reports the per-batch tests with unit batch; two runs the run-blocked test."""
    from masktrl.analysis import disagreement as dis

    rows = []
    for r in range(4):
        rows.append(
            dict(
                d=[0.5, 0.5],
                adv=[1.0, -1.0],
                keep_ratio=[True, False],
                keep_ddot_agg=[False, True],
                keep_ddot_uniform=[False, True],
                d_one=[0.6, 0.4 if r else 0.6],
            )
        )
    cols = {k: np.concatenate([np.asarray(x[k]) for x in rows]) for k in rows[0]}
    n = 8
    base = {
        "step": np.full(n, 1),
        "partition": np.zeros(n, dtype=int),
        "valid": np.ones(n, dtype=bool),
        "replicate": np.repeat(np.arange(4), 2),
        **cols,
    }
    base["d_all"] = base["d_one"]
    one = {**base, "run": np.array(["r"] * n, dtype=object)}
    two = {**base, "run": np.array(["r0"] * 4 + ["r1"] * 4, dtype=object)}
    p1 = dis.summarize(one, dis.replicate_counts(one, 0.1), 0.1)["ratio_vs_ddot_agg"]["one_step"]["paired"]
    p2 = dis.summarize(two, dis.replicate_counts(two, 0.1), 0.1)["ratio_vs_ddot_agg"]["one_step"]["paired"]
    assert p1["p_unit"] == "batch" and "p_wilcoxon" in p1["unsafe_keep"]
    assert p2["p_unit"] == "run" and p2["unsafe_keep"]["n_runs"] == 2 and p2["test"] == "run-blocked sign flip"
    assert p2["p"] == 0.5  # 2 runs, both with a positive mean difference: 2 of the 4 sign vectors tie
