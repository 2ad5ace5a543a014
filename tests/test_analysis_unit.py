"""Analysis math on hand-built inputs: unsafe-keep rates, seed statistics, bands, grouping."""

import math

import numpy as np
import pytest
import torch

from masktrl.analysis import compare as cmp
from masktrl.analysis import disagreement as dis
from masktrl.analysis import dynamics as dyn
from masktrl.analysis.io import RunInfo, group_runs
from masktrl.pipeline.runstore import resolve_run
from masktrl.stats import bootstrap_ci
from masktrl.config import from_dict
from masktrl.errors import ArtifactError, MasktrlError


# --------------------------------------------------------------------------- disagreement


def test_keep_decisions_follow_the_sign_rules():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 2.0])
    log_r = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5, 0.0])
    ddot = torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0, 0.0])
    keeps = dis.keep_decisions(adv, log_r, ddot, ddot)
    # ratio masks A(r-1) > 0: tokens 0 (A>0, r>1) and 3 (A<0, r<1); r = 1 and A = 0 are kept
    assert keeps["ratio"].tolist() == [False, True, True, False, True, True]
    # Ddot masks A*Ddot > 0: token 1 (A>0, Ddot>0) and 2 (A<0, Ddot<0)
    assert keeps["ddot_agg"].tolist() == [True, False, False, True, True, True]


def test_unsafe_keep_on_a_hand_built_case():
    # 8 tokens; D > delta = 0.1 on tokens 0-6 (token 7 is inside the trust region).
    d = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.2, 0.05])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 0.0, 1.0])
    # token 5: all three criteria keep -> unanimous, not a disagreement token
    # token 6: A = 0 -> excluded;  token 7: D <= delta -> excluded
    keeps = {
        "ratio":        torch.tensor([True,  True,  False, False, True,  True, True,  False]),
        "ddot_agg":     torch.tensor([False, False, True,  True,  False, True, False, True]),
        "ddot_uniform": torch.tensor([False, True,  True,  True,  False, True, False, True]),
    }
    sel = dis.disagreement_mask(d, 0.1, adv, keeps)
    assert sel.tolist() == [True, True, True, True, True, False, False, False]
    delta_d = torch.tensor([0.3, -0.1, -0.2, 0.4, 0.1, 9.0, 9.0, 9.0])
    rates = dis.keep_rates(delta_d, keeps, sel)
    # ratio keeps 0, 1, 4 -> dD = +0.3, -0.1, +0.1: 2 of 3 grew, 1 of 3 contracted
    assert rates["ratio"]["n_kept"] == 3 and rates["ratio"]["n_select"] == 5
    assert rates["ratio"]["unsafe_keep"] == pytest.approx(2 / 3)
    assert rates["ratio"]["contract_frac"] == pytest.approx(1 / 3)
    # ddot_agg keeps 2, 3 -> -0.2, +0.4
    assert rates["ddot_agg"]["unsafe_keep"] == pytest.approx(0.5)
    # ddot_uniform keeps 1, 2, 3 -> -0.1, -0.2, +0.4
    assert rates["ddot_uniform"]["unsafe_keep"] == pytest.approx(1 / 3)
    assert rates["ddot_uniform"]["contract_frac"] == pytest.approx(2 / 3)


def test_keep_rates_with_nothing_kept_is_nan_and_zero_change_is_neither():
    keeps = {c: torch.tensor([True, False]) for c in dis.CRITERIA}
    keeps["ratio"] = torch.tensor([False, False])
    rates = dis.keep_rates(torch.tensor([0.0, 1.0]), keeps, torch.tensor([True, True]))
    assert math.isnan(rates["ratio"]["unsafe_keep"]) and rates["ratio"]["n_kept"] == 0
    assert rates["ddot_agg"]["unsafe_keep"] == 0.0 and rates["ddot_agg"]["contract_frac"] == 0.0  # dD = 0 exactly


def test_summarize_is_mean_and_standard_error_over_seeds():
    def seed(unsafe, kept):
        block = {c: {"unsafe_keep": unsafe, "contract_frac": 1 - unsafe, "n_kept": kept, "n_select": 4} for c in dis.CRITERIA}
        res = {"n_disagree": 4}
        for scope in dis.SCOPES:
            res[scope] = block
            res[scope + "_over_delta"] = block
            res[scope + "_kept_delta_d"] = {c: [1.0] * kept for c in dis.CRITERIA}
        return res

    out = dis.summarize([seed(0.25, 4), seed(0.75, 4), seed(float("nan"), 0)])
    r = out["one_step"]["ratio"]
    assert r["unsafe_keep_mean"] == pytest.approx(0.5)
    assert r["unsafe_keep_se"] == pytest.approx(np.std([0.25, 0.75], ddof=1) / math.sqrt(2))
    assert r["n_seeds_with_kept"] == 2 and r["n_kept_mean"] == pytest.approx(8 / 3)
    assert r["n_disagree_mean"] == 4


def test_study_minibatches_default():
    assert dis.study_minibatches(1, None) == dis.STUDY_MINIBATCHES
    assert dis.study_minibatches(3, None) == 3
    assert dis.study_minibatches(1, 2) == 2


# --------------------------------------------------------------------------- compare


def _run(method, seed, eval_after, evals=(), **method_params):
    cfg = from_dict({"seed": seed, "method": {"name": method, **method_params}})
    metrics = [{"step": i + 1, "eval/heldout/accuracy": v} for i, v in enumerate(evals)]
    from pathlib import Path

    return RunInfo(Path(f"/nowhere/{method}-seed{seed}"), cfg, metrics, {"eval_after": eval_after}, "complete")


def test_compare_statistics_match_hand_computation():
    runs = [_run("grpo", s, v) for s, v in enumerate([4.0, 5.0, 6.0])]
    runs += [_run("dppo", s, v, evals=[v + 0.5, v - 1]) for s, v in enumerate([1.0, 2.0, 3.0])]
    table = cmp.compare(runs, baseline="grpo", n_boot=2000)
    assert table["baseline"] == "grpo" and table["warnings"] == []
    rows = {r["label"]: r for r in table["methods"]}
    d = rows["dppo"]["final"]
    assert d["mean"] == pytest.approx(2.0) and d["std"] == pytest.approx(1.0) and d["n"] == 3
    assert (d["ci_low"], d["ci_high"]) == pytest.approx(bootstrap_ci([1.0, 2.0, 3.0], n_boot=2000, seed=0))
    assert d["ci_low"] <= 2.0 <= d["ci_high"]
    # Welch: t = (2 - 5) / sqrt(1/3 + 1/3) = -3.674, df = 4, two-sided p = 0.021312 (scipy's ttest_ind)
    assert d["t_welch"] == pytest.approx(-3 / math.sqrt(2 / 3))
    assert d["p_welch"] == pytest.approx(0.0213116, abs=1e-6)
    # exact permutation test: 2 of the C(6,3) = 20 relabelings are as extreme
    assert d["p_permutation"] == pytest.approx(0.1)
    assert d["p"] == d["p_welch"] and d["diff_vs_baseline"] == pytest.approx(-3.0)
    # best = max over eval rows and the final value: 1.5, 2.5, 3.5
    assert rows["dppo"]["best"]["values"] == [1.5, 2.5, 3.5]
    assert rows["grpo"]["best"]["values"] == [4.0, 5.0, 6.0] and rows["grpo"]["is_baseline"]


def test_compare_warns_below_three_seeds_and_labels_variants():
    runs = [_run("grpo", s, 0.5) for s in range(3)]
    runs += [_run("dppo", 0, 0.4, divergence="topk-tv"), _run("dppo", 1, 0.6, divergence="topk-tv")]
    runs += [_run("dppo", 0, 0.3, divergence="binary-kl")]
    table = cmp.compare(runs, baseline="grpo", test="permutation", n_boot=200)
    labels = [r["label"] for r in table["methods"]]
    assert labels == ["grpo", "dppo[divergence=topk-tv]", "dppo[divergence=binary-kl]"]
    assert len(table["warnings"]) == 2 and "only 2 seeds" in table["warnings"][0]
    single = table["methods"][2]["final"]
    assert math.isnan(single["std"]) and math.isnan(single["p_welch"])  # one seed: no spread, no t-test
    with pytest.raises(MasktrlError, match="ambiguous"):
        cmp.compare(runs, baseline="dppo")
    with pytest.raises(MasktrlError, match="not among the runs"):
        cmp.compare(runs, baseline="sis")


# --------------------------------------------------------------------------- dynamics


def test_t_critical_and_band():
    assert dyn.t_critical(1) == pytest.approx(12.706204736, abs=1e-6)
    assert dyn.t_critical(2) == pytest.approx(4.302652730, abs=1e-6)
    assert dyn.t_critical(1e6) == pytest.approx(1.959964, abs=1e-4)
    mean, lo, hi = dyn.band([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302652730 * 1.0 / math.sqrt(3), abs=1e-6)
    assert math.isnan(dyn.band([1.0])[1])


def test_group_curve_averages_seeds_on_shared_steps():
    a = _run("grpo", 0, 0.5)
    b = _run("grpo", 1, 0.7)
    a.metrics = [{"step": 1, "reward_mean": 0.0}, {"step": 2, "reward_mean": 1.0}]
    b.metrics = [{"step": 1, "reward_mean": 1.0}]
    [(label, members)] = group_runs([a, b])
    assert label == "grpo" and len(members) == 2
    c = dyn.group_curve(members, "reward_mean")
    assert c["step"] == [1, 2] and c["mean"] == [0.5, 1.0] and c["n"] == [2, 1]
    assert dyn.smooth({1: 0.0, 2: 1.0, 3: 2.0}, 2) == {1: 0.0, 2: 0.5, 3: 1.5}


def test_unknown_run_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="unknown run"):
        resolve_run("nosuch", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="not a masktrl run folder"):
        resolve_run(tmp_path / "empty")
