"""analyze compare as a referee reads it: the difference's CI, Holm / BH across the table, the
smallest detectable difference at 80% power, the biased best-of-evaluations labelled, short
labels with handles that --baseline accepts, and runs of different tasks refused."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from masktrl.analysis import compare as cmp
from masktrl.analysis.io import RunInfo
from masktrl.config import from_dict
from masktrl.errors import MasktrlError


def _run(method, seed, final, evals=(), name=None, correction=None, **over):
    cfg = from_dict(
        {"seed": seed, "method": {"name": method, **({"correction": correction} if correction else {})}, **over}
    )
    metrics = [{"step": i + 1, "eval/heldout/accuracy": v} for i, v in enumerate(evals)]
    return RunInfo(
        Path(f"/nowhere/{name or method + '-seed' + str(seed)}"), cfg, metrics, {"eval_after": final}, "complete"
    )


def test_difference_ci_matches_welch_by_hand():
    a, b = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]
    lo, hi = cmp.welch_diff_ci(a, b)
    va, vb = 1 / 3, np.var(b, ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    h = sps.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert (lo, hi) == pytest.approx((-3.5 - h, -3.5 + h))
    plo, phi = cmp.paired_diff_ci([1.0, 2.0, 4.0], [0.0, 0.5, 1.0])
    d = np.array([1.0, 1.5, 3.0])
    assert (plo + phi) / 2 == pytest.approx(d.mean()) and phi - plo == pytest.approx(
        2 * sps.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    )


def test_the_paired_interval_is_shown_beside_its_own_centre_when_seed_sets_differ(capsys, monkeypatch):
    """A method run on seeds 0-1 against a grpo run on seeds 0-2: the difference of means uses
    grpo's seed 2, the paired interval does not; each is printed with its own centre."""
    from rich.console import Console

    from masktrl.commands.analyze.compare import print_compare

    # a wide table, nothing cut
    monkeypatch.setattr("masktrl.commands.analyze.compare_table.console", Console(width=250))
    runs = [_run("grpo", s, v) for s, v in enumerate([0.40, 0.42, 0.20])]
    runs += [_run("sis", s, v) for s, v in enumerate([0.45, 0.48])]
    t = cmp.compare(runs, baseline="grpo", test="paired", n_boot=200)
    d = t["methods"][1]["final"]
    assert d["diff_vs_baseline"] == pytest.approx(0.465 - 0.34)  # outside the paired interval
    assert d["diff_paired"] == pytest.approx(0.055) and d["n_paired"] == 2
    assert d["diff_ci_paired_low"] < d["diff_paired"] < d["diff_ci_paired_high"] < d["diff_vs_baseline"]
    assert d["diff_ci_low"] < d["diff_vs_baseline"] < d["diff_ci_high"]  # Welch's interval is centred on the means
    print_compare(t)
    assert "0.055 [" in capsys.readouterr().out
    print_compare(cmp.compare(runs, baseline="grpo", test="welch", n_boot=200))
    assert "0.125 [" in capsys.readouterr().out
    same = [_run("grpo", s, v) for s, v in enumerate([0.40, 0.42, 0.20])] + [
        _run("sis", s, v) for s, v in enumerate([0.45, 0.48, 0.30])
    ]
    e = cmp.compare(same, baseline="grpo", test="paired", n_boot=200)["methods"][1]["final"]
    assert e["diff_paired"] == pytest.approx(e["diff_vs_baseline"])  # the same seeds: one centre
    assert math.isnan(cmp.compare(runs[:3] + [_run("sis", 5, 0.5)], n_boot=200)["methods"][1]["final"]["diff_paired"])


def test_holm_and_bh_by_hand():
    assert cmp.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert cmp.benjamini_hochberg([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.04, 0.04])
    h = cmp.holm([0.2, float("nan"), 0.01])
    assert h[0] == pytest.approx(0.2) and math.isnan(h[1]) and h[2] == pytest.approx(0.02)


def test_min_detectable_difference_has_80_percent_power():
    a, b = [0.0, 1.0, 2.0, 0.5, 1.5], [1.0, 0.0, 2.0, 1.5, 0.5]
    mdd = cmp.min_detectable_difference(a, b)
    s = math.sqrt((np.var(a, ddof=1) + np.var(b, ddof=1)) / 2)
    assert mdd == pytest.approx((sps.t.ppf(0.975, 8) + sps.t.ppf(0.8, 8)) * s * math.sqrt(2 / 5))
    rng = np.random.default_rng(0)  # simulated power of Welch's test at that shift, same n and sigma
    hits = 0
    for _ in range(3000):
        x, y = rng.normal(mdd, s, 5), rng.normal(0.0, s, 5)
        hits += sps.ttest_ind(x, y, equal_var=True).pvalue < 0.05
    assert 0.75 <= hits / 3000 <= 0.85


def test_table_has_ci_adjusted_p_mdd_and_labels_best_as_biased():
    runs = [_run("grpo", s, v) for s, v in enumerate([0.40, 0.42, 0.41])]
    runs += [_run("dppo", s, v, evals=[v + 0.05]) for s, v in enumerate([0.50, 0.47, 0.52])]
    runs += [_run("sis", s, v) for s, v in enumerate([0.41, 0.40, 0.44])]
    t = cmp.compare(runs, baseline="grpo", n_boot=200)
    rows = {r["label"]: r for r in t["methods"]}
    d = rows["dppo"]["final"]
    assert d["diff_ci_low"] < d["diff_vs_baseline"] < d["diff_ci_high"] and d["diff_ci_low"] > 0
    sis = rows["sis"]["final"]
    assert [d["p_holm"], sis["p_holm"]] == pytest.approx(cmp.holm([d["p"], sis["p"]]))
    assert [d["q_bh"], sis["q_bh"]] == pytest.approx(cmp.benjamini_hochberg([d["p"], sis["p"]]))
    assert math.isnan(rows["grpo"]["final"]["p_holm"])
    assert d["p_holm"] >= d["p"] and d["q_bh"] >= d["p"] and d["mdd_80"] > 0 and d["p_unit"] == "run (one seed)"
    assert (
        rows["dppo"]["best"]["biased"]
        and math.isnan(rows["dppo"]["best"]["p"])
        and rows["dppo"]["best"]["n_evals"] == [2, 2, 2]
    )
    assert t["p_unit"] == "run (one seed)" and "one greedy answer" in t["metric_kind"]
    assert [r["handle"] for r in t["methods"]] == ["#1", "#2", "#3"]


def test_labels_name_only_what_separates_the_groups_and_handles_pick_the_baseline():
    # two grpo groups that differ in three keys at once; one of them is enough to tell them apart
    a = [
        _run("grpo", s, 0.4 + 0.01 * s, name=f"a{s}", eval={"greedy": True}, train={"lr": 1e-3, "steps": 10})
        for s in range(3)
    ]
    b = [
        _run("grpo", s, 0.5 + 0.01 * s, name=f"b{s}", eval={"greedy": False}, train={"lr": 2e-3, "steps": 20})
        for s in range(3)
    ]
    t = cmp.compare(a + b, baseline="#2", n_boot=200)
    labels = [r["label"] for r in t["methods"]]
    assert labels == ["grpo[eval.greedy=True]", "grpo[eval.greedy=False]"]
    assert t["baseline"] == "grpo[eval.greedy=False]" and t["baseline_handle"] == "#2"
    assert cmp.compare(a + b, baseline="1", n_boot=200)["baseline"] == labels[0]
    assert cmp.compare(a + b, baseline="b1", n_boot=200)["baseline"] == labels[1]  # a member run's folder name
    with pytest.raises(
        MasktrlError, match=r"ambiguous: pass a handle or a run folder \(#1 grpo\[eval.greedy=True\], #2"
    ):
        cmp.compare(a + b, baseline="grpo", n_boot=200)
    with pytest.raises(MasktrlError, match="not among the runs"):
        cmp.compare(a + b, baseline="#3", n_boot=200)


def test_plain_method_beside_its_corrected_variants_is_labelled_by_name_and_is_the_baseline():
    # a sweep of grpo, grpo + token TIS and grpo + IcePop: plain grpo sets no correction key
    plain = [_run("grpo", s, 0.40 + 0.01 * s) for s in range(3)]
    tis = [_run("grpo", s, 0.45, name=f"tis{s}", correction={"kind": "token-tis"}) for s in range(3)]
    ice = [_run("grpo", s, 0.42, name=f"ice{s}", correction={"kind": "icepop"}) for s in range(3)]
    t = cmp.compare(plain + tis + ice, baseline="grpo", test="paired", n_boot=200)
    labels = [r["label"] for r in t["methods"]]
    assert labels == ["grpo", "grpo[correction.kind=token-tis]", "grpo[correction.kind=icepop]"]
    assert t["baseline"] == "grpo" and t["methods"][0]["is_baseline"]
    assert t["methods"][1]["final"]["diff_vs_baseline"] == pytest.approx(0.45 - 0.41)
    # grpo with the decoupled mode and no correction (kind resolves to "none"): the set key is shown
    naive = [_run("grpo", s, 0.43, name=f"naive{s}", correction={"mode": "decoupled"}) for s in range(3)]
    labels = [r["label"] for r in cmp.compare(plain + naive, n_boot=200)["methods"]]
    assert labels == ["grpo", "grpo[correction.mode=decoupled]"]


def test_runs_of_different_tasks_are_refused():
    runs = [_run("grpo", s, 0.4) for s in range(2)] + [_run("dppo", 0, 0.5, task={"name": "arithmetic", "digits": 4})]
    with pytest.raises(
        MasktrlError,
        match="runs of different tasks cannot be compared: grpo-seed0 has task.digits=3, dppo-seed0 has task.digits=4",
    ):
        cmp.compare(runs, n_boot=200)


def test_paired_table_prints_sign_flip_mdd_tost_and_the_rule(capsys, monkeypatch):
    """--test paired: the t p and the exact sign-flip p side by side, the larger decides (Holm);
    the paired MDD at alpha/m from the paired SD (statsmodels' TTestPower when installed); TOST at
    --margin on the rows without a difference; an interaction of two effects with its TOST."""
    from rich.console import Console

    from masktrl.commands.analyze.compare import print_compare
    from masktrl.stats import paired_mdd, sign_flip_p, tost_paired

    monkeypatch.setattr("masktrl.commands.analyze.compare_table.console", Console(width=300))
    base = [0.40, 0.42, 0.38, 0.41, 0.39]
    far = [0.50, 0.53, 0.47, 0.52, 0.50]  # +0.1 on every seed: t p tiny, sign-flip p at its floor 0.0625
    near = [0.405, 0.418, 0.384, 0.409, 0.392]
    runs = [_run("grpo", s, v) for s, v in enumerate(base)] + [_run("dppo", s, v) for s, v in enumerate(far)]
    runs += [_run("sis", s, v) for s, v in enumerate(near)]
    t = cmp.compare(runs, baseline="grpo", test="paired", n_boot=200, margin=0.02, interaction="#2-#1,#3-#1")
    rows = {r["label"]: r["final"] for r in t["methods"]}
    d, s = rows["dppo"], rows["sis"]
    assert d["p_sign_flip"] == 0.0625 and d["p_paired_t"] < 0.001 and d["p"] == 0.0625  # the sign-flip floor decides
    assert d["verdict"] == "not detected" and s["verdict"] == "equivalent"
    diffs = np.subtract(near, base)
    assert s["p_sign_flip"] == sign_flip_p(diffs) and s["tost_p"] == tost_paired(diffs, 0.02)["p"] < 0.05
    assert s["mdd_paired"] == paired_mdd(diffs, alpha=0.05 / 2) and s["alpha_adjusted"] == 0.025
    sm = pytest.importorskip("statsmodels.stats.power", reason="statsmodels (the dev extra) is the reference")
    es = sm.TTestPower().solve_power(nobs=5, alpha=0.025, power=0.8)
    assert s["mdd_paired"] == pytest.approx(es * diffs.std(ddof=1), rel=1e-6)
    i = t["interaction"]
    assert i["paired"] and i["interaction"] == pytest.approx(np.mean(np.subtract(far, base)) - np.mean(diffs))
    assert i["p"] == pytest.approx(sps.ttest_rel(np.subtract(far, base), diffs).pvalue)
    print_compare(t)
    out = capsys.readouterr().out
    assert "sign-flip p" in out and "0.062" in out and "equivalent" in out and "the larger" in out and "post hoc" in out
    assert "interaction #2-#1 vs #3-#1" in out and "TOST p at ±0.020" in out
    with pytest.raises(MasktrlError, match="--interaction"):
        cmp.compare(runs, test="paired", n_boot=200, interaction="#2-#9,#3-#1")
    with pytest.raises(MasktrlError, match="--margin"):
        cmp.compare(runs, test="paired", n_boot=200, margin=0.0)
