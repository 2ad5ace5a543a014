"""The collapse rate of ``analyze compare`` (analysis/collapse.py) on synthetic reward curves:
a collapse, a dip that recovers, a run too short, and the boundaries of the definition."""

from pathlib import Path

import numpy as np
import pytest

from masktrl.analysis import collapse as col
from masktrl.analysis import compare as cmp
from masktrl.analysis.io import RunInfo
from masktrl.config import from_dict


def test_smoothed_is_the_trailing_mean_by_hand():
    r = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert np.allclose(col.smoothed(r, window=3), [1.0, 1.5, 2.0, 3.0, 4.0])
    x = np.random.default_rng(0).random(57)
    ref = [x[max(0, t - 9) : t + 1].mean() for t in range(57)]
    assert np.allclose(col.smoothed(list(x)), ref, rtol=0, atol=1e-12)


def test_a_collapsing_curve_collapses_at_the_first_step_of_its_final_run_below_half():
    r = [0.4] * 40 + [0.0] * 40  # the smoothed reward drops below 0.2 five steps into the zeros
    out = col.collapse(r)
    assert out["collapsed"] is True and out["start"] == pytest.approx(0.4) and out["threshold"] == pytest.approx(0.2)
    s = col.smoothed(r)
    t = next(i for i in range(80) if all(s[i:] < 0.2))
    assert t == 45 and out["step"] == t + 1  # steps default to 1..n


def test_a_dip_that_recovers_is_no_collapse():
    r = [0.4] * 30 + [0.0] * 30 + [0.4] * 30
    out = col.collapse(r)
    assert out["collapsed"] is False and out["step"] is None and out["final_smoothed"] == pytest.approx(0.4)


def test_the_collapse_must_last_min_steps_to_the_end():
    s = col.smoothed([0.4] * 40 + [0.0] * 24)  # below from index 45 on: 19 steps
    assert sum(s < 0.2) == 19 and col.collapse([0.4] * 40 + [0.0] * 24)["collapsed"] is False
    assert col.collapse([0.4] * 40 + [0.0] * 25)["collapsed"] is True  # 20 steps


def test_a_run_too_short_is_not_judged_and_counts_in_no_rate():
    assert col.collapse([0.4] * 29)["collapsed"] is None
    assert col.collapse([0.4] * 30)["collapsed"] is False
    rate = col.collapse_rate(
        [col.collapse([0.4] * 10), col.collapse([0.4] * 40 + [0.0] * 40), col.collapse([0.4] * 50)]
    )
    assert rate == {"count": 1, "total": 2, "rate": 0.5, "too_short": 1}


def test_a_run_starting_at_zero_reward_cannot_collapse():
    assert col.collapse([0.0] * 50)["collapsed"] is False


def test_rows_are_read_by_step_and_non_finite_rewards_dropped():
    rows = [
        {"step": 2, "reward_mean": 0.5},
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "reward_mean": 0.7},
        {"step": 3, "reward_mean": float("nan")},
        {"step": 4, "loss": 1.0},
        {"step": 5, "reward_mean": 0.2},
    ]
    assert col.rewards_of(rows) == ([1, 2, 5], [0.1, 0.7, 0.2])
    out = col.run_collapse([{"step": s, "reward_mean": 0.5 if s <= 20 else 0.01} for s in range(1, 61)])
    assert out["collapsed"] and out["step"] == 26  # steps as logged


def _run(method, seed, rewards):
    cfg = from_dict({"seed": seed, "method": {"name": method}})
    metrics = [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
    return RunInfo(Path(f"/nowhere/{method}-seed{seed}"), cfg, metrics, {"eval_after": 0.3 + 0.01 * seed}, "complete")


def test_compare_reports_the_collapse_count_per_method():
    fine, down, short = [0.4] * 60, [0.4] * 30 + [0.0] * 30, [0.4] * 5
    runs = [
        _run("grpo", 0, down),
        _run("grpo", 1, fine),
        _run("grpo", 2, down),
        _run("sis", 0, fine),
        _run("sis", 1, short),
        _run("sis", 2, fine),
    ]
    table = cmp.compare(runs, n_boot=200, n_perm=200)
    by = {r["label"]: r["collapse"] for r in table["methods"]}
    assert (by["grpo"]["count"], by["grpo"]["total"], by["grpo"]["too_short"]) == (2, 3, 0)
    assert (by["sis"]["count"], by["sis"]["total"], by["sis"]["too_short"]) == (0, 2, 1)
    assert [r["collapsed"] for r in by["grpo"]["runs"]] == [True, False, True]
    assert "below 0.5 x the mean of the first 10 steps" in table["collapse_definition"]
    assert table["warnings"] == []  # too short is said in the column (count/total +N short), not as a warning
