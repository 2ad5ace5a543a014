"""scripts/long_controls.py: RESULTS §1's tables of the long lab's controls from synthetic cells.
A cell is told by its resolved method; each control is paired with bypass grpo by seed over the
seeds both have scored; Holm over the comparisons present; the tests are the stats module's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from masktrl.stats import sign_flip_p, tost_paired

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import long_controls as lc

GRPO = {"name": "grpo", "dual_clip": None, "eps_low": 0.2, "eps_high": 0.28}
METHODS = {  # file name -> resolved method, as masktrl's config resolves them
    "grpo": GRPO,
    "grpo_dual_clip=3": GRPO | {"dual_clip": 3},
    "dppo": {"name": "dppo", "divergence": "topk-kl"},
    "icepop": GRPO | {"correction": {"kind": "icepop", "mode": "decoupled", "ref": "old"}},
}
AVG8 = {  # per seed 0..6
    "grpo": [0.05, 0.04, 0.06, 0.03, 0.05, 0.04, 0.02],
    "grpo_dual_clip=3": [0.06, 0.03, 0.07, 0.05, 0.04, 0.05, 0.04],
    "dppo": [0.60, 0.55, 0.62, 0.58, 0.50, 0.61, 0.57],
    "icepop": [0.40, 0.45, 0.38, 0.50, 0.42, 0.47, 0.41],
}


def _cell(name: str, seeds=range(7), scored=range(7)) -> dict:
    runs = [
        {
            "seed": s,
            "eval_before": 0.10,
            "eval_after": 0.05 if name.startswith("grpo") else 0.5,
            "eval": {"task": {"avg_at_k": AVG8[name][s], "k": 8}} if s in scored else {},
            "collapse": {"collapsed": name == "grpo" and s < 2},
            "mask_frac": 0.2,
            "log_r_dev": 9.5,
            "mismatch": {"logp_abs_step1": 0.1234},
            "machine": {"cpu_model": "Test CPU", "threads": 1},
        }
        for s in seeds
    ]
    return {"label": name, "method": METHODS[name], "runs": runs}


def _write(root: Path, names=tuple(METHODS), **kw) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / f"{name}.json").write_text(json.dumps(_cell(name, **kw)))


def test_each_control_is_paired_with_bypass_grpo_by_seed(tmp_path):
    _write(tmp_path)
    rows = lc.family_rows(lc.read(tmp_path))
    assert [r["arm"] for r in rows] == list(lc.ARMS)[1:]
    row = next(r for r in rows if r["arm"] == "dppo (top-K KL)")
    d = np.subtract(AVG8["dppo"], AVG8["grpo"])
    assert np.allclose(row["d"], d) and row["seeds"] == list(range(7))
    assert np.isclose(row["t_p"], sps.ttest_1samp(d, 0.0).pvalue)
    # 7 seeds all positive: the exact two-sided sign-flip p is 2/2^7, below Holm's first step 0.05/3
    assert row["flip"] == sign_flip_p(list(d)) == pytest.approx(2 / 2**7)
    assert row["p"] == max(row["t_p"], row["flip"]) and row["m"] == 3
    half = sps.t.ppf(0.975, 6) * d.std(ddof=1) / np.sqrt(7)
    assert np.allclose(row["ci"], (d.mean() - half, d.mean() + half))
    assert np.isclose(row["tost"], tost_paired(list(d), 0.05)["p"])


def test_the_family_helper_adjusts_by_holm_over_the_comparisons_tested():
    from statsmodels.stats.multitest import multipletests

    from results_cells import paired_family

    fam = paired_family([[0.1, 0.2, 0.3, 0.25], [0.1, -0.1, 0.05, 0.0], [0.0, 0.01, -0.01, 0.02], [0.5]], 0.05)
    tested = fam[:3]
    assert [r["m"] for r in tested] == [3, 3, 3] and "p" not in fam[3]  # one difference: no test
    expected = multipletests([r["p"] for r in tested], method="holm")[1]
    assert np.allclose([r["holm"] for r in tested], expected)


def test_unscored_seeds_are_left_out_of_the_pairing_and_counted(tmp_path):
    _write(tmp_path, names=("grpo",))
    _write(tmp_path, names=("icepop",), seeds=range(4), scored=range(3))
    out = lc.outcome_table(tmp_path)
    assert (
        "| decoupled IcePop | 4 (3 scored) | 0.100 | 0.500 | 0.410 ± 0.036 | 0: 0.400, 1: 0.450, 2: 0.380 | 0/4 |"
        in out
    )
    assert (
        "| grpo (bypass) | 7 | 0.100 | 0.050 | 0.041 ± 0.013 |" in out
        and "| 7/7 | 2/7 | 0.200 | 9.500 | 0.1234 |" in out
    )
    (row,) = lc.family_rows(lc.read(tmp_path))
    assert row["seeds"] == [0, 1, 2] and row["m"] == 1
    fam = lc.family_table(tmp_path)
    assert "| decoupled IcePop − grpo (bypass) | 3 |" in fam and "m = 1 comparisons present" in fam


def test_tables_say_what_is_missing_and_refuse_unknown_cells(tmp_path):
    assert "no cell has finished yet" in lc.outcome_table(tmp_path)
    assert "no comparison has both cells yet" in lc.family_table(tmp_path)
    _write(tmp_path, names=("dppo",))
    assert "no comparison has both cells yet" in lc.family_table(tmp_path)  # no baseline yet
    (tmp_path / "other.json").write_text(json.dumps(_cell("grpo") | {"method": GRPO | {"dual_clip": 2}}))
    with pytest.raises(SystemExit, match="none of §1's four arms"):
        lc.read(tmp_path)
    (tmp_path / "other.json").write_text(json.dumps(_cell("dppo")))
    with pytest.raises(SystemExit, match="a second cell of dppo"):
        lc.read(tmp_path)
    (tmp_path / "other.json").write_text('{"method": ')
    with pytest.raises(SystemExit, match="other.json: not a cell"):
        lc.read(tmp_path)
