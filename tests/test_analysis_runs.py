"""The analyses on real tiny runs: replay exactness, the disagreement study, SIS, dynamics,
compare, the CLI commands and their JSON + PNG outputs."""

import json

import matplotlib.image
import pytest
import torch
from safetensors.torch import load_file

from masktrl.analysis import disagreement as dis
from masktrl.analysis.io import load_run
from masktrl.analysis.sis_report import sis_report
from masktrl.analysis.step_replay import load_replay, replay_step
from tests.conftest import cli


@pytest.fixture(scope="module")
def runs(analysis_runs):
    return analysis_runs


def assert_png(path):
    assert path.is_file() and path.stat().st_size > 1000, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_replay_of_the_run_seed_reproduces_the_stored_checkpoint(runs):
    root = runs / "sis-seed1"
    for step in (1, 3):  # from the warm start (checkpoint 0) and from a saved optimizer state
        replay = load_replay(root, step)
        replay_step(replay, replay.cfg.seed, replay.cfg.train.minibatches)
        stored = load_file(root / "checkpoints" / f"{step:06d}" / "model.safetensors")
        now = replay.model.state_dict()
        assert all(torch.equal(now[k], stored[k]) for k in stored)


def test_disagreement_study_with_partitions_as_replicates_is_well_formed(runs, tmp_path):
    root = runs / "grpo-seed0"
    res, table = dis.run_study([root], [3], delta=1e-4, partitions=3, unit="partition", minibatches=4)
    assert res["steps"] == [3] and res["partitions"] == 3 and res["minibatches"] == [4] and res["n_replicates"] == 3
    assert res["batches"][0]["policy_step"] == 2 and res["update"]["name"] == "unmasked" and not res["update"]["masks"]
    assert res["n_over_delta_total"] > 0  # later minibatches leave the trust region
    for rep in res["replicates"]:
        assert rep["n_over_delta"] <= rep["n_nonzero_adv"] <= rep["n_tokens"]
        for block in rep["pairs"].values():
            assert block["n_disagree"] <= rep["n_over_delta"]
            for scope in dis.SCOPES:
                kept = [block[scope][c]["n_kept"] for c in block[scope]]
                assert sum(kept) == block["n_disagree"]  # the pair's rules split the set between them
                for r in block[scope].values():
                    if r["n_kept"]:
                        assert 0 <= r["unsafe_keep"] <= 1 and r["unsafe_keep"] + r["contract_frac"] <= 1 + 1e-12
    for name, block in res["pairs"].items():
        assert block["n_disagree_total"] == sum(r["pairs"][name]["n_disagree"] for r in res["replicates"])
        for scope in dis.SCOPES:
            assert set(block[scope]) == {*block["criteria"], "paired"}
    paths = dis.save(res, table, tmp_path)
    data = json.loads(paths[0].read_text())  # strict JSON: NaN became null
    assert data["delta"] == 1e-4 and data["tokens_file"] == paths[1].name
    for p in paths[2:]:
        assert_png(p)


def test_sis_report_recomputes_the_logged_accept_rate(runs):
    info = load_run(runs / "sis-seed0")
    rep = sis_report(info, top=5)
    r = rep["replay"]
    assert rep["step"] == 3 and not rep["hypothetical"]
    assert r["accept_rate"] == pytest.approx(r["accept_rate_logged"], abs=1e-12)
    # the log-importance deviation D and D_SIS (docs/METHODS.md §6.1): recomputed = logged, D_SIS <= D
    assert r["log_r_dev"] == pytest.approx(r["log_r_dev_logged"], rel=1e-9)
    assert r["log_w_dev"] == pytest.approx(r["log_w_dev_logged"], rel=1e-9)
    assert 0 <= r["log_w_dev"] <= r["log_r_dev"] and r["log_dev_ratio"] == pytest.approx(
        r["log_w_dev"] / r["log_r_dev"]
    )
    tr = rep["training"]
    assert len(tr["log_r_dev"]) == len(tr["log_w_dev"]) == len(tr["log_dev_ratio"]) == 3
    assert all(w <= d for d, w in zip(tr["log_r_dev"], tr["log_w_dev"]))
    assert 0 <= r["tested_frac"] <= 1 and r["outside_topk_frac"] == pytest.approx(1 - r["tested_frac"])
    assert len(r["pi_residual"]) == r["n_valid"] and all(0 <= x <= 1 for x in r["pi_residual"])
    assert rep["rollouts"]["step"] == [1, 2, 3] and len(rep["training"]["accept_rate"]) == 3
    n_acc = sum(t["count"] for t in rep["tokens"]["accepted"])
    assert 0 < n_acc <= r["n_valid"] and all(isinstance(t["token"], str) for t in rep["tokens"]["accepted"])
    grpo = sis_report(load_run(runs / "grpo-seed0"), step=2)
    assert grpo["hypothetical"] and grpo["replay"]["accept_rate_logged"] is None
    assert (
        grpo["training"]["log_r_dev"] and grpo["training"]["log_w_dev"] == []
    )  # D is logged by every method, D_SIS by SIS


def test_cli_analyses_write_json_and_png(runs, tmp_path):
    out = cli("analyze", "dynamics", str(runs), "--output", str(tmp_path / "dyn")).output
    assert "grpo" in out and "sis" in out
    dyn = json.loads((tmp_path / "dyn" / "dynamics.json").read_text())
    grpo = next(g for g in dyn["groups"] if g["label"] == "grpo")
    assert grpo["seeds"] == [0, 1, 2]
    assert {"reward_mean", "ppo_kl", "mask_frac", "D_p95", "sis_accept_rate"} <= set(dyn["metrics"])
    assert len(grpo["curves"]["D_p95"]["step"]) == 3 and all(v >= 0 for v in grpo["curves"]["D_p95"]["mean"])
    acc = grpo["curves"]["eval/heldout/accuracy"]
    assert acc["step"] == [0, 2, 3] and acc["n"] == [3, 3, 3]  # eval_before, the step-2 eval row, eval_after
    assert all(lo <= m <= hi for m, lo, hi in zip(acc["mean"], acc["lo"], acc["hi"]))
    assert_png(tmp_path / "dyn" / "dynamics.png")

    names = ["grpo-seed0", "grpo-seed1", "grpo-seed2", "sis-seed0", "sis-seed1"]
    out = cli("analyze", "compare", *names, "--out", str(runs), "--baseline", "grpo").output  # run names under --out
    assert "warning" in out and "sis: only 2 seeds" in out
    table = json.loads((runs / "analysis" / "compare.json").read_text())
    assert [r["label"] for r in table["methods"]] == ["grpo", "sis"]
    sis_row = table["methods"][1]
    for key in ("final", "best"):
        s = sis_row[key]
        assert s["n"] == 2 and s["ci_low"] <= s["mean"] <= s["ci_high"]
    assert (
        0 <= sis_row["final"]["p"] <= 1 and sis_row["best"]["p"] is None and sis_row["best"]["biased"]
    )  # best: not tested
    assert all(b >= f for b, f in zip(sis_row["best"]["values"], sis_row["final"]["values"]))
    assert_png(runs / "analysis" / "compare.png")

    cli("analyze", "sis", "--run", "sis-seed1", "--out", str(runs), "--top", "3")
    assert json.loads((runs / "sis-seed1" / "analysis" / "sis-step3.json").read_text())["run"] == "sis-seed1"
    assert_png(runs / "sis-seed1" / "analysis" / "sis-step3.png")

    out = cli(
        "analyze",
        "disagreement",
        "--run",
        str(runs / "grpo-seed1"),
        "--partitions",
        "2",
        "--delta",
        "0.001",
        "--step",
        "2",
        "--policy-step",
        "3",
        "--no-exact",
    ).output
    assert "ddot_uniform" in out and "staleness 2" in out and "ratio_vs_ddot_agg" in out
    files = sorted(
        f for f in (runs / "grpo-seed1" / "analysis").iterdir() if f.name.startswith("disagreement-step2-policy3")
    )
    assert sorted(f.suffix for f in files) == [".json", ".parquet", ".png", ".png", ".png"]
    for f in files:
        if f.suffix == ".png":
            assert_png(f)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["analyze", "disagreement", "--run", "nosuch", "--out", "{runs}"], "unknown run nosuch"),
        (
            ["analyze", "sis", "--run", "grpo-seed0", "--out", "{runs}", "--step", "9"],
            "no rollouts recorded for step 9",
        ),
        (["analyze", "disagreement", "--run", "grpo-seed0", "--out", "{runs}", "--policy-step", "7"], "checkpoint 7"),
        (["analyze", "compare", "{runs}/grpo-seed0", "--baseline", "pdm"], "baseline 'pdm' is not among the runs"),
        (["analyze", "dynamics", "{runs}/nosuch"], "unknown run"),
    ],
)
def test_missing_artifacts_are_one_error_line(runs, cli_error, args, needle):
    assert needle in cli_error(*[a.format(runs=runs) for a in args])
