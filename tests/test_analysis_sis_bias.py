"""The SIS gradient-bias measurement (masktrl/analysis/sis_bias.py) on a tiny SIS run: its
pairs are consistent, a list size above the stored K is refused."""

from __future__ import annotations

import math

import pytest

from masktrl.analysis import sis_bias as sb
from masktrl.errors import MasktrlError


def test_bias_rows_per_k(analysis_runs, tmp_path):
    res = sb.sis_bias(analysis_runs / "sis-seed0", 2, (1, 3, 5))
    assert [r["k"] for r in res["ks"]] == [1, 3, 5] and not res["hypothetical"] and res["stored_k"] == 5
    xi = [r["xi_mean"] for r in res["ks"]]
    assert xi[0] >= xi[1] >= xi[2] >= 0  # a longer list leaves less training mass out
    for r in res["ks"] + [res["exact"]]:
        for ref in ("vs_on_policy", "vs_base"):
            assert -1 - 1e-9 <= r[ref]["cos"] <= 1 + 1e-9 and r[ref]["rel_norm"] >= 0
        assert 0 <= r["accept_rate"] <= 1
    paths = sb.save(res, tmp_path)
    assert all(p.stat().st_size > 100 for p in paths)
    assert sb.summary_rows(res)[-1][0] == "exact" and math.isfinite(sb.summary_rows(res)[0][3])


def test_k_above_the_stored_lists_is_refused(analysis_runs):
    with pytest.raises(MasktrlError, match="--k 6 is above the stored list size K = 5"):
        sb.sis_bias(analysis_runs / "sis-seed0", 2, (5, 6))
