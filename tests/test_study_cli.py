"""The study's options through the CLI, tried as a user would: the replayed optimizer and the
first-order parts recorded in the JSON, compare's handles, analyze sis --bias, pdm tail=exact
trained end to end, and every bad request one line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest
import torch

from masktrl.methods import ddot_topk_exact
from tests.conftest import cli, write_tiny_config
from tests.test_train_methods import OFF_POLICY, train_recorded


def _files(*folders):
    return sorted(str(p) for f in folders for p in f.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["analyze", "disagreement", "--run", "{runs}/grpo-seed0", "--replay-optimizer", "nesterov"],
            "--replay-optimizer must be one of run, sgd, adamw",
        ),
        (
            ["analyze", "disagreement", "--run", "{runs}/grpo-seed0", "--replay-lr", "-0.001"],
            "--replay-lr must be a positive number",
        ),
        (
            ["analyze", "estimators", "--run", "{runs}/grpo-seed0", "--replay-optimizer", "sgd", "--replay-lr", "0"],
            "--replay-lr must be a positive number",
        ),
        (
            ["analyze", "estimators", "--run", "{runs}/grpo-seed0", "--replay-optimizer", "sgd", "--reset-moments"],
            "--reset-moments needs an optimizer",
        ),
        (
            ["analyze", "disagreement", "--run", "{runs}/grpo-seed0", "--decompose", "--own-tokens", "-1"],
            "--own-tokens must be >= 0",
        ),
        (
            ["analyze", "sis", "--run", "{runs}/sis-seed0", "--bias", "--k", "5,6"],
            "--k 6 is above the stored list size K = 5",
        ),
        (["analyze", "compare", "{runs}/grpo-seed0", "{runs}/grpo-seed1", "--baseline", "#7"], "is not among the runs"),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(analysis_runs, cli_error, args, needle):
    before = _files(analysis_runs)
    assert needle in cli_error(*[a.format(runs=analysis_runs) for a in args])
    assert _files(analysis_runs) == before


def test_sis_k_above_the_stored_lists_is_refused_before_training(tmp_path, cli_error):
    line = cli_error("train", "--method", "sis", "--set", "method.k=21", "--out", tmp_path / "out", "--run", "r")
    assert "method.k=21 is above rollout.logprobs_k=20" in line
    assert not (tmp_path / "out").exists() or _files(tmp_path / "out") == []


def test_replay_optimizer_and_first_order_recorded(analysis_runs, tmp_path):
    out = cli(
        "analyze",
        "disagreement",
        "--run",
        analysis_runs / "grpo-seed0",
        "--steps",
        "2",
        "--policy-step",
        "3",
        "--minibatches",
        "1",
        "--replay-optimizer",
        "sgd",
        "--replay-lr",
        "0.01",
        "--decompose",
        "--own-tokens",
        "4",
        "--delta",
        "0.001",
        "--output",
        tmp_path,
    ).output
    assert "optimizer sgd lr 0.01" in out and "first-order parts of ΔD" in out
    (path,) = tmp_path.glob("disagreement-step2-policy3-mb1-delta0.001-unmasked-opt-sgd-lr0.01.json")
    res = json.loads(path.read_text())
    assert res["replay_optimizer"] == {"name": "sgd", "lr": 0.01, "lr_used": 0.01, "reset_moments": False}
    fo = res["first_order"]
    assert fo["sign_agree"]["total"] >= 0.9 and fo["parts_present"]["momentum"] is False
    assert (tmp_path / path.name.replace(".json", "-first-order.png")).stat().st_size > 1000
    est = cli(
        "analyze",
        "estimators",
        "--run",
        analysis_runs / "grpo-seed0",
        "--steps",
        "2",
        "--policy-step",
        "3",
        "--k",
        "2,5",
        "--replay-optimizer",
        "adamw",
        "--reset-moments",
        "--output",
        tmp_path,
    ).output
    est = " ".join(est.split())  # rich wraps at the console's width
    assert "optimizer adamw" in est and "moments reset" in est
    (epath,) = tmp_path.glob("estimators-step2-unmasked-opt-adamw-reset.json")
    e = json.loads(epath.read_text())
    assert e["replay_optimizer"]["reset_moments"] and e["subsets"]["moved"]["k"]["5"]["bracket"]["contains_frac"] == 1.0
    assert "vs_topk_kl" in e["subsets"]["moved"]["k"]["5"]


def test_compare_baseline_by_handle_and_run_folder(analysis_runs, tmp_path):
    runs = [analysis_runs / n for n in ("grpo-seed0", "grpo-seed1", "grpo-seed2", "sis-seed0", "sis-seed1")]
    out = cli("analyze", "compare", *runs, "--baseline", "2", "--output", tmp_path).output
    table = json.loads((tmp_path / "compare.json").read_text())
    assert table["baseline"] == "sis" and table["baseline_handle"] == "#2" and "Holm p" in out
    cli("analyze", "compare", *runs, "--baseline", "grpo-seed1", "--output", tmp_path)
    assert json.loads((tmp_path / "compare.json").read_text())["baseline"] == "grpo"


def test_sis_bias_command(analysis_runs):
    out = cli("analyze", "sis", "--run", analysis_runs / "sis-seed1", "--bias", "--k", "2,5").output
    assert "SIS gradient bias at step" in out
    res = json.loads((analysis_runs / "sis-seed1" / "analysis" / "sis-bias-step3.json").read_text())
    assert [r["k"] for r in res["ks"]] == [2, 5] and "vs_on_policy" in res["exact"]


def test_pdm_tail_exact_trains_and_masks_on_the_exact_topk_rate(warm_out):
    config = write_tiny_config(warm_out.parent / "offpolicy-exact.yaml", OFF_POLICY)
    import masktrl.rl.update as update

    seen = []
    real = update.token_diagnostics

    def spy(batch, out, advantages, params=None, **kw):
        assert batch.pi_sq_sum is not None  # the trainer computed sum_V pi^2 for tail=exact
        seen.append((out.ddot.detach(), ddot_topk_exact(batch, batch.pi_sq_sum)))
        return real(batch, out, advantages, params, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update, "token_diagnostics", spy)
        cli(
            "train",
            "--config",
            config,
            "--out",
            warm_out,
            "--run",
            "off-pdm-exact",
            "--method",
            "pdm",
            "--set",
            "method.tail=exact",
        )
    assert len(seen) == 4 and all(torch.equal(a, b.detach()) for a, b in seen)
    rows = [json.loads(x) for x in (warm_out / "off-pdm-exact" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 <= r["mask_frac"] <= 1 for r in rows)
    assert train_recorded  # the recorder helper stays importable for the other method tests


def test_k_sweep_at_the_stored_k_equals_the_main_study(analysis_runs, tmp_path, cli_error):
    cli(
        "analyze",
        "disagreement",
        "--run",
        analysis_runs / "grpo-seed0",
        "--steps",
        "2",
        "--policy-step",
        "3",
        "--delta",
        "0.001",
        "--k",
        "2,5",
        "--output",
        tmp_path,
    )
    (path,) = tmp_path.glob("disagreement-step2-policy3-*.json")
    res = json.loads(path.read_text())
    at5 = res["k_sweep"]["5"]["over_delta"]
    for c in ("ratio", "ddot_agg", "ddot_uniform"):
        assert at5[c]["unsafe_keep_mean"] == pytest.approx(res["over_delta"]["one_step"][c]["unsafe_keep_mean"])
    assert (
        res["k_sweep"]["2"]["n_over_delta_mean"] <= res["k_sweep"]["5"]["n_over_delta_mean"]
    )  # merging atoms: D_2 <= D_5
    before = _files(analysis_runs)
    assert "--k 6 is above the stored list size K = 5" in cli_error(
        "analyze", "disagreement", "--run", analysis_runs / "grpo-seed0", "--k", "5,6"
    )
    assert _files(analysis_runs) == before
