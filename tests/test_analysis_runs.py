"""The analyses on real tiny runs: replay exactness, the disagreement study, SIS, dynamics,
compare, the CLI commands and their JSON + PNG outputs."""

import json
import sys

import matplotlib.image
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from masktrl import cli
from masktrl.analysis import disagreement as dis
from masktrl.analysis.io import load_run
from masktrl.analysis.step_replay import load_replay, replay_step
from masktrl.analysis.sis_report import sis_report
from masktrl.pipeline import sweep

CONFIG = """\
seed: 0
method: {name: grpo}
model: {hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}
task: {name: arithmetic, digits: 1, n_test: 16}
warmstart: {steps: 150, batch_size: 16}
rollout: {prompts_per_step: 8, n: 4, max_new_tokens: 4, logprobs_k: 5}
train: {steps: 3, checkpoint_every: 1, lr: 3.0e-3, minibatches: 2, eval_every: 2}
"""

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """grpo x seeds 0, 1, 2 and sis x seeds 0, 1 (3 steps each, every checkpoint kept)."""
    base = tmp_path_factory.mktemp("analysis")
    config = base / "tiny.yaml"
    config.write_text(CONFIG)
    out = base / "out"
    sweep.run_sweep(sweep.plan(out, ["grpo"], [0, 1, 2], config))
    sweep.run_sweep(sweep.plan(out, ["sis"], [0, 1], config))
    return out


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


def test_disagreement_study_three_seeds_is_well_formed(runs):
    root = runs / "grpo-seed0"
    res = dis.run_study(root, seeds=3, delta=1e-4, minibatches=4)
    assert res["step"] == 3 and res["policy_step"] == 2 and res["seeds"] == 3 and res["minibatches"] == 4
    assert len(res["per_seed"]) == 3 and [s["seed_value"] for s in res["per_seed"]] == [0, 1, 2]
    assert sum(s["n_over_delta"] for s in res["per_seed"]) > 0  # later minibatches leave the trust region
    for s in res["per_seed"]:
        assert s["n_tokens"] == res["n_tokens"]
        assert s["n_disagree"] <= s["n_over_delta"] <= s["n_nonzero_adv"] <= s["n_tokens"]
        for scope in dis.SCOPES:
            kept = {c: s[scope][c]["n_kept"] for c in dis.CRITERIA}
            for c in dis.CRITERIA:
                assert s[scope][c]["n_select"] == s["n_disagree"] and kept[c] <= s["n_disagree"]
                r = s[scope][c]
                if r["n_kept"]:
                    assert 0 <= r["unsafe_keep"] <= 1 and 0 <= r["contract_frac"] <= 1
                    assert r["unsafe_keep"] + r["contract_frac"] <= 1 + 1e-12
            if s["n_disagree"]:  # not unanimous: someone keeps and someone masks every token
                assert max(kept.values()) > 0 and min(kept.values()) < s["n_disagree"]
    for scope in dis.SCOPES:
        for c in dis.CRITERIA:
            b = res[scope][c]
            for key in ("unsafe_keep_mean", "unsafe_keep_se", "contract_frac_mean", "n_disagree_mean"):
                assert key in b
            assert b["n_disagree_mean"] == pytest.approx(res["n_disagree_mean"])
            if b["n_seeds_with_kept"]:
                assert 0 <= b["unsafe_keep_mean"] <= 1
            assert len(res["kept_delta_d"][scope][c]) == sum(s[scope][c]["n_kept"] for s in res["per_seed"])
    paths = dis.save(res, root)
    data = json.loads(paths[0].read_text())  # strict JSON: NaN became null
    assert data["seeds"] == 3 and data["delta"] == 1e-4 and set(dis.SCOPES) <= set(data)
    for p in paths[1:]:
        assert_png(p)


def test_sis_report_recomputes_the_logged_accept_rate(runs):
    info = load_run(runs / "sis-seed0")
    rep = sis_report(info, top=5)
    r = rep["replay"]
    assert rep["step"] == 3 and not rep["hypothetical"]
    assert r["accept_rate"] == pytest.approx(r["accept_rate_logged"], abs=1e-12)
    assert 0 <= r["tested_frac"] <= 1 and r["outside_topk_frac"] == pytest.approx(1 - r["tested_frac"])
    assert len(r["pi_residual"]) == r["n_valid"] and all(0 <= x <= 1 for x in r["pi_residual"])
    assert rep["rollouts"]["step"] == [1, 2, 3] and len(rep["training"]["accept_rate"]) == 3
    n_acc = sum(t["count"] for t in rep["tokens"]["accepted"])
    assert 0 < n_acc <= r["n_valid"] and all(isinstance(t["token"], str) for t in rep["tokens"]["accepted"])
    grpo = sis_report(load_run(runs / "grpo-seed0"), step=2)
    assert grpo["hypothetical"] and grpo["replay"]["accept_rate_logged"] is None


def _cli(*args):
    result = runner.invoke(cli.app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_cli_analyses_write_json_and_png(runs, tmp_path):
    out = _cli("analyze", "dynamics", str(runs), "--out", str(tmp_path / "dyn"))
    assert "grpo" in out and "sis" in out
    dyn = json.loads((tmp_path / "dyn" / "dynamics.json").read_text())
    grpo = next(g for g in dyn["groups"] if g["label"] == "grpo")
    assert grpo["seeds"] == [0, 1, 2]
    acc = grpo["curves"]["eval/heldout/accuracy"]
    assert acc["step"] == [0, 2, 3] and acc["n"] == [3, 3, 3]  # eval_before, the step-2 eval row, eval_after
    assert all(lo <= m <= hi for m, lo, hi in zip(acc["mean"], acc["lo"], acc["hi"]))
    assert_png(tmp_path / "dyn" / "dynamics.png")

    out = _cli("analyze", "compare", str(runs), "--baseline", "grpo")
    assert "warning" in out and "sis: only 2 seeds" in out
    table = json.loads((runs / "analysis" / "compare.json").read_text())
    assert [r["label"] for r in table["methods"]] == ["grpo", "sis"]
    sis_row = table["methods"][1]
    for key in ("final", "best"):
        s = sis_row[key]
        assert s["n"] == 2 and s["ci_low"] <= s["mean"] <= s["ci_high"] and 0 <= s["p"] <= 1
    assert all(b >= f for b, f in zip(sis_row["best"]["values"], sis_row["final"]["values"]))
    assert_png(runs / "analysis" / "compare.png")

    _cli("analyze", "sis", "--run", "sis-seed1", "--out", str(runs), "--top", "3")
    assert json.loads((runs / "sis-seed1" / "analysis" / "sis-step3.json").read_text())["run"] == "sis-seed1"
    assert_png(runs / "sis-seed1" / "analysis" / "sis-step3.png")

    out = _cli("analyze", "disagreement", "--run", str(runs / "grpo-seed1"), "--seeds", "2", "--delta", "0.001",
               "--step", "2", "--policy-step", "3")
    assert "ddot_uniform" in out and "staleness 2" in out
    files = sorted((runs / "grpo-seed1" / "analysis").iterdir(), key=lambda f: f.suffix)
    assert [f.suffix for f in files] == [".json", ".png", ".png"] and "step2-policy3" in files[0].name
    for f in files[1:]:
        assert_png(f)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["analyze", "disagreement", "--run", "nosuch", "--out", "{runs}"], "unknown run nosuch"),
        (["analyze", "sis", "--run", "grpo-seed0", "--out", "{runs}", "--step", "9"], "no rollouts for step 9"),
        (["analyze", "disagreement", "--run", "grpo-seed0", "--out", "{runs}", "--policy-step", "7"], "no checkpoint 7"),
        (["analyze", "compare", "{runs}/grpo-seed0", "--baseline", "pdm"], "baseline method 'pdm'"),
        (["analyze", "dynamics", "{runs}/nosuch"], "unknown run"),
    ],
)
def test_missing_artifacts_are_one_error_line(runs, monkeypatch, capsys, args, needle):
    monkeypatch.setattr(sys, "argv", ["masktrl", *[a.format(runs=runs) for a in args]])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
