"""scripts/agentic_grid.py: RESULTS §2's tables from synthetic cells. The family pairs each SIS
cell with its own base (sis:base=dapo with dapo), pdm with grpo; Holm over the comparisons
present; the paired interval, sign-flip p, MDD and TOST are the stats module's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy import stats as sps

from masktrl.stats import sign_flip_p, tost_paired

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import agentic_grid as ag

AFTER = {  # method -> eval_after per seed 0..2
    "grpo": [0.50, 0.30, 0.40],
    "dapo": [0.55, 0.35, 0.45],
    "sis": [0.52, 0.33, 0.41],
    "sis:base=dapo": [0.40, 0.22, 0.31],
    "pdm": [0.50, 0.31, 0.40],
}


def _cell(regime: str, name: str) -> dict:
    base = name.split("=")[1] if "=" in name else ("grpo" if name == "sis" else None)
    method = {"name": name.split(":")[0], **({"base": base} if base else {})}
    runs = [
        {
            "seed": s,
            "eval_before": 0.1,
            "eval_after": v,
            "collapse": {"collapsed": s == 1 and name == "pdm"},
            "sis_accept_rate": 0.9 if name.startswith("sis") else None,
            "turns_end": 2.5,
            "mismatch": {"logp_abs_step1": 0.0123},
            "log_r_dev": 0.5 + 0.1 * s,
            "machine": {"cpu_model": "Test CPU", "threads": 1},
        }
        for s, v in enumerate(AFTER[name])
    ]
    return {"source": regime, "label": name, "method": method, "runs": runs}


def _write(root: Path, regimes=("stale2", "fp8"), names=tuple(AFTER)) -> None:
    for regime in regimes:
        for name in names:
            path = root / regime / f"{name.replace(':', '_')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_cell(regime, name)))


def test_the_family_pairs_each_sis_cell_with_its_own_base(tmp_path):
    _write(tmp_path)
    rows = ag.family_rows(ag.read(tmp_path))
    pairs = [(r["regime"], r["a"], r["b"]) for r in rows]
    # gspo has no cell: its comparison is left out, the other three of each regime are present
    assert pairs == [(g, a, b) for g in ("stale2", "fp8") for a, b in ag.FAMILY if b != "gspo"]
    row = next(r for r in rows if r["a"] == "sis:base=dapo")
    d = np.subtract(AFTER["sis:base=dapo"], AFTER["dapo"])
    assert np.allclose(row["d"], d)
    assert np.isclose(row["t_p"], sps.ttest_1samp(d, 0.0).pvalue)
    assert row["flip"] == sign_flip_p(list(d)) and row["flip"] >= 0.25  # 3 seeds: never below 2^(1-3)
    half = sps.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
    assert np.allclose(row["ci"], (d.mean() - half, d.mean() + half))
    assert row["m"] == 6 and row["holm"] <= 1.0
    assert np.isclose(row["tost"], tost_paired(list(d), 0.05)["p"])


def test_tables_render_every_cell_and_say_what_is_missing(tmp_path):
    assert "no cell has finished yet" in ag.outcome_table(tmp_path)
    assert "no comparison has both cells yet" in ag.family_table(tmp_path)
    _write(tmp_path, regimes=("stale2",), names=("grpo", "sis"))
    out = ag.outcome_table(tmp_path)
    assert (
        "| staleness 2 | sis | 3 | 0.100 | 0.420 ± 0.095 | 0: 0.520, 1: 0.330, 2: 0.410 | 0/3 "
        "| 0.0123 | 0.600 | 0.900 | 2.500 |" in out
    )
    fam = ag.family_table(tmp_path)
    assert "| staleness 2 | sis − grpo | 3 | +0.020 [" in fam and "m = 1 comparisons" in fam


def test_a_second_cell_of_one_method_is_refused(tmp_path):
    """results_cells names a cell by what tells it apart from the others: a sweep's early ``sis``
    becomes ``sis base=grpo`` once ``sis:base=dapo`` exists, leaving the old file behind."""
    import pytest

    _write(tmp_path, regimes=("stale2",), names=("grpo", "sis"))
    (tmp_path / "stale2" / "sis_base=grpo.json").write_text(json.dumps(_cell("stale2", "sis")))
    with pytest.raises(SystemExit, match="a second cell of sis in stale2"):
        ag.read(tmp_path)
