"""scripts/minibatch_groups.py: RESULTS §3's tables from synthetic cells. An arm is told by its
cell's train.minibatch_groups; whole groups minus single samples is paired by seed over the
seeds both arms have; the tests are the stats module's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from masktrl.stats import sign_flip_p, tost_paired

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import minibatch_groups as mg

AFTER = {False: [0.40, 0.42, 0.39, 0.44, 0.41, 0.43], True: [0.38, 0.43, 0.36, 0.40, 0.40, 0.39]}
LOG_R_DEV = {False: [1.7, 1.8, 1.6, 1.7, 1.5, 1.9], True: [1.9, 1.7, 1.8, 1.9, 1.8, 2.0]}


def _cell(folder: Path, groups, runs: list[dict], name: str = "grpo") -> None:
    """A committed cell of ``name`` with ``runs``, run with ``train.minibatch_groups: groups`` (None:
    not set) and 8 minibatches."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"train.minibatches": 8} | ({} if groups is None else {"train.minibatch_groups": groups})
    (folder / f"{name}.json").write_text(json.dumps({"method": {"name": name}, "config": config, "runs": runs}))


def _write(root: Path, source: str, groups, seeds=range(6), name: str = "grpo") -> None:
    runs = [
        {
            "seed": s,
            "eval_before": 0.218,
            "eval_after": AFTER[bool(groups)][s],
            "collapse": {"collapsed": False},
            "machine": {"cpu_model": "Test CPU", "threads": 1},
            "log_r_dev": LOG_R_DEV[bool(groups)][s],
            "mask_frac": 0.2,
            "entropy_end": None if s == 0 else 3.0,  # not recorded for seed 0
        }
        for s in seeds
    ]
    _cell(root / source, groups, runs, name)


def test_whole_groups_are_paired_with_single_samples_by_seed(tmp_path):
    _write(tmp_path, "samples", False)
    _write(tmp_path, "groups", True, seeds=range(1, 6))  # seed 0 not run yet: left out of the pairs
    [row] = mg.comparison_rows(mg.read(tmp_path))
    d = np.subtract(AFTER[True][1:], AFTER[False][1:])
    assert row["seeds"] == [1, 2, 3, 4, 5] and np.allclose(row["d"], d)
    assert np.isclose(row["t_p"], sps.ttest_1samp(d, 0.0).pvalue)
    assert row["flip"] == sign_flip_p(list(d)) and row["p"] == max(row["t_p"], row["flip"]) and row["m"] == 1
    assert np.isclose(row["tost"], tost_paired(list(d), 0.05)["p"])
    table = mg.comparison_table(tmp_path)
    assert "| whole groups − single samples | 5 |" in table and "m = 1 comparisons present (1 when" in table
    outcome = mg.outcome_table(tmp_path)
    assert "| single samples | 6 | 0.218 |" in outcome and "| whole groups | 5 | 0.218 |" in outcome


def test_a_cell_without_the_key_is_the_single_sample_arm(tmp_path):
    """Cells written before train.minibatch_groups existed record no such key: the default split."""
    _write(tmp_path, "old", None)
    assert list(mg.read(tmp_path)) == ["single samples"]


def test_no_cells_yet_gives_placeholder_rows(tmp_path):
    assert "(no cell has finished yet)" in mg.outcome_table(tmp_path)
    assert "(no comparison has both cells yet)" in mg.comparison_table(tmp_path)
    assert "(no comparison has both cells yet)" in mg.drift_table(tmp_path)


def test_the_drift_table_pairs_each_recorded_value_by_seed_without_a_test(tmp_path):
    _write(tmp_path, "samples", False)
    _write(tmp_path, "groups", True, seeds=range(1, 6))  # seed 0 not run yet: left out of the pairs
    lines = mg.drift_table(tmp_path).splitlines()[2:]
    rows = {line.split(" | ")[0].split(":")[0].lstrip("| "): line.split(" | ") for line in lines}
    assert list(rows) == ["log_r_dev", "mask_frac", "entropy"]
    d = np.subtract(LOG_R_DEV[True][1:], LOG_R_DEV[False][1:])
    half = sps.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    row = rows["log_r_dev"]
    assert row[1] == f"{np.mean(LOG_R_DEV[False]):.3f}" and row[2] == f"{np.mean(LOG_R_DEV[True][1:]):.3f}"
    assert row[3] == f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"
    assert row[4] == f"{(d > 0).sum()}/5" and row[5].startswith("1: -0.100, 2: +0.200, 3: +0.200")
    assert rows["mask_frac"][3].startswith("+0.000 [") and rows["mask_frac"][4] == "0/5"
    # seed 0's entropy was not recorded: the mean and the pairs leave it out
    assert rows["entropy"][1] == "3.000" and rows["entropy"][4] == "0/5"


@pytest.mark.parametrize("bad", ["second", "method"])
def test_a_cell_that_is_no_arm_is_an_error(tmp_path, bad):
    _write(tmp_path, "samples", False)
    if bad == "second":
        _write(tmp_path, "again", False)
    else:
        _write(tmp_path, "dppo", True, name="dppo")
    with pytest.raises(SystemExit, match="second cell of single samples" if bad == "second" else "grpo arms"):
        mg.read(tmp_path)


# §4: the dose of prompts per update, g = 1, 2, 4 and 8, every arm on one machine.
DOSE_AFTER = {
    1: [0.43, 0.33, 0.42, 0.43, 0.39, 0.46],
    2: [0.42, 0.32, 0.41, 0.41, 0.39, 0.44],
    4: [0.40, 0.31, 0.38, 0.42, 0.37, 0.42],
    8: [0.39, 0.29, 0.35, 0.41, 0.37, 0.40],
}
DOSE_DEV = {1: 1.7, 2: 1.75, 4: 1.8, 8: 1.9}
VALUE = {1: False, 2: 2, 4: 4, 8: True}  # each g's train.minibatch_groups


def _dose_cell(folder: Path, g, seeds=range(6), cpu: str = "Test CPU") -> None:
    runs = [
        {
            "seed": s,
            "eval_before": 0.218,
            "eval_after": DOSE_AFTER[g][s],
            "log_r_dev": DOSE_DEV[g] + 0.01 * s,
            "collapse": {"collapsed": False},
            "machine": {"cpu_model": cpu, "threads": 1},
        }
        for s in seeds
    ]
    _cell(folder, VALUE[g], runs)


def _dose(root: Path, parts2_seeds=range(6)) -> Path:
    for g in mg.DOSE:
        _dose_cell(root / f"parts{g}", g, parts2_seeds if g == 2 else range(6))
    return root


def test_the_expected_prompts_per_minibatch_match_an_enumeration():
    """4 groups of 2 samples, parts of 1, 2 minibatches of 4 parts: every 4 of the 8 parts is as
    likely; the mean count of distinct prompts over all of them is the formula's."""
    import itertools

    owner = [0, 0, 1, 1, 2, 2, 3, 3]
    picks = list(itertools.combinations(range(8), 4))
    brute = np.mean([len({owner[i] for i in pick}) for pick in picks])
    assert np.isclose(mg.prompts_per_minibatch(1, groups=4, n=2, minibatches=2), brute)
    assert mg.prompts_per_minibatch(2, groups=4, n=2, minibatches=2) == 2.0  # whole groups: 2 a minibatch
    assert [round(mg.prompts_per_minibatch(g), 1) for g in mg.DOSE] == [42.2, 26.6, 15.1, 8.0]  # the lab's


def test_the_trend_is_each_seeds_least_squares_slope_on_log2_g(tmp_path):
    data = mg.read_dose(_dose(tmp_path, parts2_seeds=range(1, 6)))  # g = 2 lacks seed 0: seed 0 left out
    assert sorted(data) == [1, 2, 4, 8]
    [row] = mg.trend_rows(data)
    # the slope on x = 0, 1, 2, 3 by hand: sum((x - 1.5) y) / sum((x - 1.5)^2), the latter 5
    by_hand = [
        (-1.5 * DOSE_AFTER[1][s] - 0.5 * DOSE_AFTER[2][s] + 0.5 * DOSE_AFTER[4][s] + 1.5 * DOSE_AFTER[8][s]) / 5
        for s in range(1, 6)
    ]
    assert row["seeds"] == [1, 2, 3, 4, 5] and np.allclose(row["d"], by_hand)
    assert np.isclose(row["t_p"], sps.ttest_1samp(by_hand, 0.0).pvalue)
    assert row["flip"] == sign_flip_p(list(row["d"])) and row["p"] == max(row["t_p"], row["flip"]) and row["m"] == 1
    assert np.isclose(row["tost"], tost_paired(list(row["d"]), 0.05 / 3)["p"])
    assert "| held-out after on log2 g (g = 1, 2, 4, 8) | 5 |" in mg.trend_table(tmp_path)


def test_the_dose_tables_stay_descriptive(tmp_path):
    _dose(tmp_path)
    dose = mg.dose_table(tmp_path).splitlines()
    assert [line.split(" | ")[0].lstrip("| ") for line in dose[2:]] == [mg.DOSE_LABEL[g] for g in mg.DOSE]
    assert dose[3].startswith("| 2 | 26.6 | 6 | ") and dose[3].split(" | ")[5] == f"{DOSE_DEV[2] + 0.025:.3f}"
    assert dose[3].endswith("| 0/6 | Test CPU x1 |")
    steps = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in mg.steps_table(tmp_path).splitlines()[2:]}
    assert list(steps) == [
        "held-out after, g = 2 − g = 1",
        "held-out after, g = 4 − g = 1",
        "held-out after, g = 8 − g = 1",
        "log_r_dev: slope per doubling of g",
    ]
    d4 = np.subtract(DOSE_AFTER[4], DOSE_AFTER[1])
    half = sps.t.ppf(0.975, 5) * d4.std(ddof=1) / np.sqrt(6)
    assert (
        steps["held-out after, g = 4 − g = 1"][1]
        == f"{d4.mean():+.3f} [{d4.mean() - half:+.3f}, {d4.mean() + half:+.3f}]"
    )
    assert steps["held-out after, g = 4 − g = 1"][2] == f"{(d4 < 0).sum()}/6"
    slope = np.polyfit(np.log2(mg.DOSE), [DOSE_DEV[g] for g in mg.DOSE], 1)[0]  # the same for every seed
    assert steps["log_r_dev: slope per doubling of g"][1].startswith(f"{slope:+.3f} [")


def test_without_every_arm_there_is_no_trend_and_a_cell_of_another_g_is_an_error(tmp_path):
    _dose_cell(tmp_path / "parts1", 1)
    _dose_cell(tmp_path / "parts8", 8)
    assert mg.trend_rows(mg.read_dose(tmp_path)) == []
    assert "(no comparison has both cells yet)" in mg.trend_table(tmp_path)
    _dose_cell(tmp_path / "parts3", 4)
    json_path = tmp_path / "parts3" / "grpo.json"
    cell = json.loads(json_path.read_text())
    json_path.write_text(json.dumps(cell | {"config": cell["config"] | {"train.minibatch_groups": 3}}))
    with pytest.raises(SystemExit, match="not one of §4's grpo arms"):
        mg.read_dose(tmp_path)


def test_runs_of_two_machines_do_not_pair(tmp_path):
    """A seed's warm start depends on the machine: cells of two CPU models (or thread counts) in
    one comparison stop with one line, in §4's folder and in §3's."""
    _dose_cell(tmp_path / "dose" / "parts1", 1)
    _dose_cell(tmp_path / "dose" / "parts2", 2, cpu="Other CPU")
    with pytest.raises(SystemExit, match="runs of 2 machines do not pair by seed: Other CPU x1, Test CPU x1"):
        mg.read_dose(tmp_path / "dose")
    _write(tmp_path / "s3", "samples", False)
    _dose_cell(tmp_path / "s3" / "groups", 8, cpu="Other CPU")
    with pytest.raises(SystemExit, match="do not pair by seed"):
        mg.read(tmp_path / "s3")


def _size_cell(folder: Path, groups: bool, after: dict[int, float], cpu: str = "Test CPU") -> None:
    runs = [
        {"seed": s, "eval_before": 0.2, "eval_after": a, "machine": {"cpu_model": cpu, "threads": 1}}
        for s, a in after.items()
    ]
    _cell(folder, groups, runs)


def test_the_size_table_gives_4s_seeds_5s_and_both_by_seed(tmp_path):
    """§5: whole groups minus single samples over §4's g = 1 and 8 (seeds 0-5), §5's new seeds,
    and the two pooled, each with its paired interval and SD; no test."""
    _dose(tmp_path / mg.CELLS_PARTS.name)
    size = tmp_path / mg.CELLS_SIZE.name
    single, whole = {6: 0.40, 7: 0.35, 8: 0.41}, {6: 0.37, 7: 0.36, 8: 0.38}
    _size_cell(size / "samples", False, single)
    _size_cell(size / "groups", True, whole)
    rows = mg.size_rows(size)
    old = [DOSE_AFTER[8][s] - DOSE_AFTER[1][s] for s in range(6)]
    new = [whole[s] - single[s] for s in (6, 7, 8)]
    assert [(label, seeds) for label, seeds, _ in rows] == [
        ("§4's g = 1 and g = 8", list(range(6))),
        ("§5", [6, 7, 8]),
        ("both", list(range(9))),
    ]
    assert np.allclose(rows[0][2], old) and np.allclose(rows[1][2], new) and np.allclose(rows[2][2], old + new)
    lines = mg.size_table(size).splitlines()[2:]
    both = np.array(old + new)
    half = sps.t.ppf(0.975, 8) * both.std(ddof=1) / 3
    assert lines[2].startswith(
        f"| both: 0–8 | 9 | {both.mean():+.3f} [{both.mean() - half:+.3f}, {both.mean() + half:+.3f}] |"
    )
    assert f"| {(both < 0).sum()}/9 | {both.std(ddof=1):.3f} |" in lines[2]
    assert lines[1].startswith("| §5: 6–8 | 3 |")


def test_the_size_table_refuses_two_machines_and_a_seed_in_both_folders(tmp_path):
    _dose(tmp_path / mg.CELLS_PARTS.name)
    size = tmp_path / mg.CELLS_SIZE.name
    _size_cell(size / "samples", False, {6: 0.40}, cpu="Other CPU")
    _size_cell(size / "groups", True, {6: 0.37}, cpu="Other CPU")
    with pytest.raises(SystemExit, match="runs of 2 machines do not pair by seed: Other CPU x1, Test CPU x1"):
        mg.size_rows(size)
    _size_cell(size / "samples", False, {5: 0.40})
    _size_cell(size / "groups", True, {5: 0.37})
    with pytest.raises(SystemExit, match=r"seeds \[5\] are in both"):
        mg.size_rows(size)


def test_the_size_table_before_any_run_has_a_placeholder(tmp_path):
    assert "(no seed has both arms yet)" in mg.size_table(tmp_path / mg.CELLS_SIZE.name)


def _where(root: Path, after: dict[int, dict[int, float]], cpu: str = "Test CPU") -> Path:
    """§6's folder under ``root`` with its g = 4 cell, beside §5's two arms (``after``: {g: {seed: value}})."""
    size = root / mg.CELLS_SIZE.name
    _size_cell(size / "samples", False, after[1], cpu=cpu)
    _size_cell(size / "groups", True, after[8], cpu=cpu)
    where = root / mg.CELLS_WHERE.name
    runs = [
        {"seed": s, "eval_before": 0.2, "eval_after": a, "log_r_dev": 1.8, "machine": {"cpu_model": cpu, "threads": 1}}
        for s, a in after[4].items()
    ]
    _cell(where / "parts4", 4, runs)
    return where


WHERE_AFTER = {
    1: {6: 0.40, 7: 0.35, 8: 0.42, 9: 0.41},
    4: {6: 0.41, 7: 0.34, 8: 0.41, 9: 0.40},
    8: {6: 0.37, 7: 0.33, 8: 0.36, 9: 0.38},
}


def test_where_compares_whole_groups_with_g4_and_g4_with_single_samples_by_seed(tmp_path):
    """§6: its g = 4 cell read beside §5's arms; C1 = whole groups − g = 4 and C2 = g = 4 − single
    samples, paired by seed, the two Holm-adjusted together (m = 2)."""
    where = _where(tmp_path, WHERE_AFTER)
    data = mg.read_where(where)
    assert sorted(data) == [1, 4, 8]
    (l1, s1, d1), (l2, s2, d2) = mg.where_differences(data)
    assert (l1, l2) == ("whole groups − g = 4", "g = 4 − single samples") and s1 == s2 == [6, 7, 8, 9]
    assert np.allclose(d1, [WHERE_AFTER[8][s] - WHERE_AFTER[4][s] for s in s1])
    assert np.allclose(d2, [WHERE_AFTER[4][s] - WHERE_AFTER[1][s] for s in s2])
    lines = mg.where_table(where).splitlines()
    assert lines[2].startswith(f"| whole groups − g = 4 | 4 | {np.mean(d1):+.3f} [")
    assert lines[3].startswith(f"| g = 4 − single samples | 4 | {np.mean(d2):+.3f} [")
    assert "m = 2" in mg.where_table(where)
    outcomes = mg.where_outcomes(where).splitlines()[2:]
    assert [line.split(" | ")[0] for line in outcomes] == ["| 1 (single samples)", "| 4", "| 8 (whole groups)"]


def test_where_pools_4s_seeds_descriptively_and_refuses_mixed_cells(tmp_path):
    _dose(tmp_path / mg.CELLS_PARTS.name)
    where = _where(tmp_path, WHERE_AFTER)
    lines = mg.where_pooled_table(where).splitlines()[2:]
    assert [line.split(" | ")[:3] for line in lines] == [
        ["| whole groups − g = 4", "§4: 0–5", "6"],
        ["| whole groups − g = 4", "§6: 6–9", "4"],
        ["| whole groups − g = 4", "both: 0–9", "10"],
        ["| g = 4 − single samples", "§4: 0–5", "6"],
        ["| g = 4 − single samples", "§6: 6–9", "4"],
        ["| g = 4 − single samples", "both: 0–9", "10"],
    ]
    both = np.array([DOSE_AFTER[8][s] - DOSE_AFTER[4][s] for s in range(6)] + [0.37 - 0.41, -0.01, -0.05, -0.02])
    assert f"| {both.mean():+.3f} [" in lines[2] and f"| {both.std(ddof=1):.3f} |" in lines[2]
    # another g in §6's own folder, another machine, a seed in both folders: one line each
    _cell(
        where / "parts2",
        2,
        [{"seed": 6, "eval_before": 0.2, "eval_after": 0.4, "machine": {"cpu_model": "Test CPU", "threads": 1}}],
    )
    with pytest.raises(SystemExit, match=r"g = 4 only, not g = \[2\]"):
        mg.read_where(where)
    other = _where(tmp_path / "other", WHERE_AFTER, cpu="Other CPU")
    _dose(tmp_path / "other" / mg.CELLS_PARTS.name)
    with pytest.raises(SystemExit, match="runs of 2 machines do not pair by seed"):
        mg.where_pooled_table(other)
    clash = _where(tmp_path / "clash", {g: {5: 0.4, 6: 0.4} for g in (1, 4, 8)})
    _dose(tmp_path / "clash" / mg.CELLS_PARTS.name)
    with pytest.raises(SystemExit, match=r"seeds \[5\] are in both"):
        mg.where_pooled_table(clash)


def test_where_before_any_run_has_placeholders(tmp_path):
    where = tmp_path / mg.CELLS_WHERE.name
    assert "(no comparison has both cells yet)" in mg.where_pooled_table(where)
    assert mg.where_outcomes(where).count("\n") == 2  # the header alone
