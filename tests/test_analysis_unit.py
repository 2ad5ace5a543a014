"""Analysis math on hand-built inputs: unsafe-keep rates, seed statistics, bands, grouping."""

import math

import numpy as np
import pytest
import torch

from masktrl.analysis import compare as cmp
from masktrl.analysis import disagreement as dis
from masktrl.analysis import dynamics as dyn
from masktrl.analysis.io import RunInfo, group_runs
from masktrl.analysis.replicates import STUDY_MINIBATCHES, parse_steps, study_minibatches
from masktrl.analysis.token_replay import keep_decisions
from masktrl.config import from_dict
from masktrl.errors import ArtifactError, MasktrlError
from masktrl.runs.store import resolve_run
from masktrl.stats import bootstrap_ci

# --------------------------------------------------------------------------- disagreement


def test_keep_decisions_follow_the_sign_rules():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 2.0])
    log_r = torch.tensor([0.5, -0.5, 0.5, -0.5, 0.5, 0.0])
    ddot = torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0, 0.0])
    lo = torch.tensor([-2.0, 0.5, -2.0, -1.0, 0.5, -1.0])
    hi = torch.tensor([-0.5, 2.0, 1.0, 2.0, 2.0, 1.0])
    keeps = keep_decisions(adv, log_r, ddot, ddot, lo, hi, ddot)
    # ratio masks A(r-1) > 0: tokens 0 (A>0, r>1) and 3 (A<0, r<1); r = 1 and A = 0 are kept
    assert keeps["ratio"].tolist() == [False, True, True, False, True, True]
    # Ddot masks A*Ddot > 0: token 1 (A>0, Ddot>0) and 2 (A<0, Ddot<0)
    assert keeps["ddot_agg"].tolist() == [True, False, False, True, True, True] == keeps["ddot_exact"].tolist()
    # bracket, uncertain=keep: masks where it certifies A*Ddot > 0: token 1 (A>0, lo>0) only
    assert keeps["bracket_keep"].tolist() == [True, False, True, True, True, True]
    # uncertain=mask: keeps where it certifies A*Ddot <= 0: token 0 (A>0, hi<0), A=0; A=2 with 0 in the bracket is
    # masked
    assert keeps["bracket_mask"].tolist() == [True, False, False, False, True, False]


def _table(**cols):
    n = len(next(iter(cols.values())))
    base = {
        "run": np.array(["r"] * n, dtype=object),
        "step": np.full(n, 1),
        "partition": np.zeros(n, dtype=int),
        "replicate": np.zeros(n, dtype=int),
        "valid": np.ones(n, dtype=bool),
    }
    return {**base, **{k: np.asarray(v) for k, v in cols.items()}}


def test_pairwise_sets_and_unsafe_keep_on_a_hand_built_case():
    # 8 tokens; D > delta = 0.1 on tokens 0-6 (token 7 is inside the trust region).
    t = _table(
        d=[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.2, 0.05],
        adv=[1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 0.0, 1.0],
        keep_ratio=[True, True, False, False, True, True, True, False],
        keep_ddot_agg=[False, False, True, True, False, True, False, True],
        keep_ddot_uniform=[False, True, True, True, False, True, False, True],
        d_one=np.array([0.3, -0.1, -0.2, 0.4, 0.1, 9.0, 9.0, 9.0]) + 0.5,
    )
    t["d_all"] = t["d_one"].copy()
    # token 5: every rule keeps; token 6: A = 0; token 7: D <= delta -> in no set
    assert dis.pair_set(t, "ratio", "ddot_agg", 0.1).tolist() == [True, True, True, True, True, False, False, False]
    # ratio vs uniform differ on 0, 2, 3, 4 (both keep token 1)
    assert dis.pair_set(t, "ratio", "ddot_uniform", 0.1).tolist() == [
        True,
        False,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    # agg vs uniform differ on token 1 only
    assert dis.pair_set(t, "ddot_agg", "ddot_uniform", 0.1).tolist() == [False, True] + [False] * 6
    (rep,) = dis.replicate_counts(t, 0.1)
    ra = rep["pairs"]["ratio_vs_ddot_agg"]["one_step"]
    # ratio keeps 0, 1, 4 -> dD = +0.3, -0.1, +0.1: 2 of 3 grew, 1 contracted; agg keeps 2, 3 -> -0.2, +0.4
    assert ra["ratio"] == {
        "n_kept": 3,
        "n_grew": 2,
        "n_contracted": 1,
        "unsafe_keep": pytest.approx(2 / 3),
        "contract_frac": pytest.approx(1 / 3),
    }
    assert ra["ddot_agg"]["unsafe_keep"] == pytest.approx(0.5) and ra["ddot_agg"]["n_kept"] == 2
    au = rep["pairs"]["ddot_agg_vs_ddot_uniform"]["one_step"]
    assert au["ddot_agg"]["n_kept"] == 0 and math.isnan(au["ddot_agg"]["unsafe_keep"])
    assert au["ddot_uniform"] == {"n_kept": 1, "n_grew": 0, "n_contracted": 1, "unsafe_keep": 0.0, "contract_frac": 1.0}
    assert rep["n_over_delta"] == 6 and rep["over_delta"]["one_step"]["ratio"]["n_kept"] == 4  # tokens 0, 1, 4, 5


def test_zero_change_is_neither_grew_nor_contracted():
    t = _table(
        d=[0.5, 0.5],
        adv=[1.0, 1.0],
        keep_ratio=[True, False],
        keep_ddot_agg=[False, True],
        keep_ddot_uniform=[False, True],
        d_one=[0.5, 0.7],
        d_all=[0.5, 0.7],
    )
    (rep,) = dis.replicate_counts(t, 0.1)
    r = rep["pairs"]["ratio_vs_ddot_agg"]["one_step"]["ratio"]
    assert r["n_kept"] == 1 and r["unsafe_keep"] == 0.0 and r["contract_frac"] == 0.0


def test_summary_is_over_replicates_with_pooled_rates_and_a_paired_test():
    # 4 replicates; ratio keeps one token per replicate, agg keeps one (the pair disagrees on both)
    rows = []
    grew_ratio = [True, True, True, False]
    grew_agg = [False, False, True, False]
    for r in range(4):
        rows.append(
            dict(
                d=[0.5, 0.5],
                adv=[1.0, -1.0],
                keep_ratio=[True, False],
                keep_ddot_agg=[False, True],
                keep_ddot_uniform=[False, True],
                d_one=[0.6 if grew_ratio[r] else 0.4, 0.6 if grew_agg[r] else 0.4],
            )
        )
    cols = {k: np.concatenate([np.asarray(x[k]) for x in rows]) for k in rows[0]}
    t = _table(**cols)
    t["replicate"] = np.repeat(np.arange(4), 2)
    t["d_all"] = t["d_one"]
    reps = dis.replicate_counts(t, 0.1)
    out = dis.summarize(t, reps, 0.1)["ratio_vs_ddot_agg"]
    assert out["n_disagree_total"] == 8 and out["n_disagree_mean"] == 2
    one = out["one_step"]
    assert one["ratio"]["unsafe_keep_mean"] == pytest.approx(0.75)
    assert one["ratio"]["unsafe_keep_se"] == pytest.approx(np.std([1, 1, 1, 0], ddof=1) / 2)
    assert one["ddot_agg"]["unsafe_keep_pooled"] == pytest.approx(0.25) and one["ddot_agg"][
        "contract_frac_pooled"
    ] == pytest.approx(0.75)
    paired = one["paired"]["unsafe_keep"]
    assert paired["n"] == 4 and paired["diff_mean"] == pytest.approx(0.5)
    from scipy import stats as sps

    assert paired["p_ttest"] == pytest.approx(sps.ttest_rel([1, 1, 1, 0], [0, 0, 1, 0]).pvalue)
    assert one["paired"]["p"] == paired["p_wilcoxon"]


def test_study_minibatches_default():
    assert study_minibatches(1, None) == STUDY_MINIBATCHES
    assert study_minibatches(3, None) == 3
    assert study_minibatches(1, 2) == 2
    assert study_minibatches(1, None, lag=4) == 1  # stale rollouts: off-policy from the first update


def test_step_lists_and_ranges():
    assert parse_steps("600,650,700") == [600, 650, 700]
    assert parse_steps("600:700:50") == [600, 650, 700]  # inclusive
    assert parse_steps("3:5, 9") == [3, 4, 5, 9]
    assert parse_steps(None) is None
    for bad in ("600-700", "7:5", "1:5:0", "x"):
        with pytest.raises(MasktrlError, match="--steps"):
            parse_steps(bad)


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


def test_compare_pairs_seeds_with_the_baseline():
    """The paired t-test matches runs by seed (a seed's runs share its warm start) and uses only
    the seeds both groups have; scipy's ttest_rel on those pairs."""
    from scipy import stats as sps

    runs = [_run("grpo", s, v) for s, v in zip([0, 1, 2, 3], [0.40, 0.34, 0.40, 0.41])]
    runs += [_run("dapo", s, v) for s, v in zip([3, 1, 2, 9], [0.48, 0.39, 0.39, 0.10])]  # seed 9: no pair
    runs += [_run("sis", s, v) for s, v in zip([0, 1, 2], [0.43, 0.30, 0.32])]
    table = cmp.compare(runs, baseline="grpo", test="paired", n_boot=200)
    rows = {r["label"]: r for r in table["methods"]}
    d = rows["dapo"]["final"]
    assert d["n_paired"] == 3 and d["p"] == d["p_paired"]
    assert d["p_paired_t"] == pytest.approx(sps.ttest_rel([0.39, 0.39, 0.48], [0.34, 0.40, 0.41]).pvalue)
    assert d["t_paired"] == pytest.approx(sps.ttest_rel([0.39, 0.39, 0.48], [0.34, 0.40, 0.41]).statistic)
    assert d["p_paired"] == max(d["p_paired_t"], d["p_sign_flip"])  # the larger of the t and the sign-flip p decides
    assert rows["sis"]["final"]["p_paired_t"] == pytest.approx(
        sps.ttest_rel([0.43, 0.30, 0.32], [0.40, 0.34, 0.40]).pvalue
    )
    assert rows["grpo"]["final"]["n_paired"] == 0 and math.isnan(rows["grpo"]["final"]["p_paired"])
    lone = cmp.compare(
        [_run("grpo", 0, 0.4), _run("grpo", 1, 0.5), _run("sis", 5, 0.3), _run("sis", 6, 0.2)], n_boot=200
    )
    assert lone["methods"][1]["final"]["n_paired"] == 0 and math.isnan(lone["methods"][1]["final"]["p_paired"])


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


def test_groups_compare_resolved_method_parameters():
    """A parameter given at its default value is the same config: one group. Groups of one
    method are labelled by the resolved parameters in which they differ."""
    runs = [
        _run("dppo", 0, 0.5),
        _run("dppo", 1, 0.6, divergence="topk-kl"),
        _run("dppo", 0, 0.1, divergence="binary-tv"),
    ]
    groups = group_runs(runs)
    assert [(label, [r.cfg.seed for r in members]) for label, members in groups] == [
        ("dppo[divergence=topk-kl]", [0, 1]),
        ("dppo[divergence=binary-tv]", [0]),
    ]


def test_unknown_run_is_an_artifact_error(tmp_path):
    with pytest.raises(ArtifactError, match="unknown run"):
        resolve_run("nosuch", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="not a masktrl run folder"):
        resolve_run(tmp_path / "empty")


def test_compare_table_prints_bracketed_group_labels(monkeypatch):
    """Group labels such as ``dppo[divergence=binary-tv]`` are text, not rich markup."""
    from masktrl.commands.analyze import print_compare
    from masktrl.commands.ui import console

    runs = [_run("dppo", s, v, divergence="binary-tv") for s, v in enumerate([0.1, 0.2, 0.3])]
    runs += [_run("dppo", s, v) for s, v in enumerate([0.4, 0.5, 0.6])]
    table = cmp.compare(runs, baseline="dppo[divergence=topk-kl]", n_boot=200)
    monkeypatch.setattr(console, "_width", 200)  # restored to auto width afterwards (the width property would pin it)
    with console.capture() as captured:
        print_compare(table)
    text = captured.get()
    assert "dppo[divergence=binary-tv]" in text and "vs dppo[divergence=topk-kl]" in text


def test_error_lines_print_brackets_as_text(cli_error, tmp_path):
    """The CLI's error line is text, not rich markup: a label such as dppo[divergence=x] stays whole."""
    line = cli_error("analyze", "compare", tmp_path / "nosuch[divergence=x]")
    assert "nosuch[divergence=x]" in line
