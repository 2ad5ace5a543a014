"""The token study and the estimator study on real tiny runs: the pairwise sets rebuilt from the
token parquet, the exact Ḋ against autograd, the bracket, the unmasked update's gradients, and
bad requests (one line, exit 2, nothing written)."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from masktrl import cli
from masktrl.analysis import estimators as est
from masktrl.analysis.io import read_table
from masktrl.analysis.step_replay import load_behaviour, load_replay, replay_step, token_index
from masktrl.analysis.token_replay import CRITERIA, keep_decisions, record_tokens
from masktrl.methods import ddot_kl_bracket, divergence_rate
from masktrl.methods.batch import log_ratio
from masktrl.models.loading import load_model_and_tokenizer
from masktrl.runs.store import RunStore

runner = CliRunner()


def _cli(*args):
    result = runner.invoke(cli.app, list(args), env={"COLUMNS": "220"})
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


@pytest.fixture(scope="module")
def stale_tokens(analysis_runs):
    """Step 2's batch (sampled by checkpoint 1) trained from checkpoint 3: pi != mu from the first
    minibatch on. The token table with the exact columns and the estimators at K = 2, 5, 20."""
    replay = load_replay(analysis_runs / "grpo-seed0", 2, policy_step=3, update_name="unmasked")
    behaviour = load_behaviour(replay)
    assert behaviour.step == 1
    return replay, record_tokens(replay, replay.cfg.seed, 2, behaviour=behaviour, ks=(2, 5, 20))


def test_recording_every_token_leaves_the_update_as_training_did_it(analysis_runs):
    root = analysis_runs / "grpo-seed1"
    replay = load_replay(root, 3, update_name="run")
    t = record_tokens(replay, replay.cfg.seed, replay.cfg.train.minibatches, behaviour=load_behaviour(replay), ks=(3,))
    stored = load_file(root / "checkpoints" / "000003" / "model.safetensors")
    now = replay.model.state_dict()
    assert all(torch.equal(now[k], stored[k]) for k in stored)
    assert np.isfinite(t["ddot_exact"][t["valid"]]).all() and sorted(set(t["minibatch"])) == [0, 1]


def test_pairwise_sets_rebuilt_from_the_token_parquet_equal_the_json(analysis_runs):
    out = _cli(
        "analyze",
        "disagreement",
        "--run",
        str(analysis_runs / "grpo-seed0"),
        "--run",
        str(analysis_runs / "grpo-seed1"),
        "--steps",
        "2:3",
        "--delta",
        "0.001",
        "--minibatches",
        "4",
        "--test",
        "ttest",
    )
    assert "4 replicates (batch)" in out and "update unmasked" in out
    folder = analysis_runs / "analysis"
    (path,) = folder.glob("disagreement-steps2-3n2-runs2-mb4-delta0.001-unmasked.json")
    res = json.loads(path.read_text())
    t = read_table(folder / res["tokens_file"])
    assert res["n_replicates"] == 4 and res["n_tokens_total"] == len(t["d"])
    assert sorted(set(t["run"])) == ["grpo-seed0", "grpo-seed1"] and sorted(set(t["step"])) == [2, 3]
    delta = res["delta"]
    total = 0
    for a, b in res["pairs_tested"]:
        name = f"{a}_vs_{b}"
        block = res["pairs"][name]
        over = t["valid"] & np.isfinite(t["d"]) & (t["d"] > delta) & (t["adv"] != 0)
        dis_set = over & (t[f"keep_{a}"] != t[f"keep_{b}"])
        assert block["n_disagree_total"] == int(dis_set.sum())
        total += int(dis_set.sum())
        for rep in res["replicates"]:
            sel = dis_set & (t["replicate"] == rep["replicate"])
            assert rep["pairs"][name]["n_disagree"] == int(sel.sum())
            for scope, col in (("one_step", "d_one"), ("all_minibatches", "d_all")):
                dd = t[col] - t["d"]
                for c in (a, b):
                    kept = sel & t[f"keep_{c}"]
                    r = rep["pairs"][name][scope][c]
                    assert (r["n_kept"], r["n_grew"], r["n_contracted"]) == (
                        int(kept.sum()),
                        int((dd[kept] > 0).sum()),
                        int((dd[kept] < 0).sum()),
                    )
        for scope, col in (("one_step", "d_one"), ("all_minibatches", "d_all")):
            for c in (a, b):
                kept = dis_set & t[f"keep_{c}"]
                assert block[scope][c]["n_kept_total"] == int(kept.sum())
                if kept.any():
                    assert block[scope][c]["unsafe_keep_pooled"] == pytest.approx(
                        float(((t[col] - t["d"])[kept] > 0).mean())
                    )
            # two runs pooled: the run is the unit (run-blocked sign flip), not the batch
            assert (
                block[scope]["paired"]["p_unit"] == "run"
                and block[scope]["paired"]["p"] == block[scope]["paired"]["unsafe_keep"]["p"]
            )
            assert "p_ttest" not in block[scope]["paired"]["unsafe_keep"]
    assert total > 0  # the check above was not vacuous
    for suffix in ("bars", "ecdf", "contracted"):
        assert (folder / path.name.replace(".json", f"-{suffix}.png")).stat().st_size > 1000


def test_exact_ddot_equals_autograd_on_full_logits(analysis_runs, stale_tokens):
    replay, t = stale_tokens
    root = analysis_runs / "grpo-seed0"
    pi_model, _ = load_model_and_tokenizer(RunStore(root).policy_path(3), "float32")
    mu_model, _ = load_model_and_tokenizer(RunStore(root).policy_path(1), "float32")
    temp = replay.cfg.rollout.temperature
    first = np.flatnonzero((t["minibatch"] == 0) & t["valid"])  # trained from checkpoint 3 itself
    checked = 0
    for i in first[:: max(1, len(first) // 6)]:
        s, pos = replay.samples[t["sample"][i]], t["position"][i]
        ids = torch.tensor([s.prompt_ids + s.gen.response_ids])
        at = len(s.prompt_ids) - 1 + pos
        with torch.no_grad():
            z_mu = mu_model(ids).logits[0, at].double() / temp
        z = (pi_model(ids).logits[0, at].double() / temp).detach().requires_grad_(True)
        log_mu = torch.log_softmax(z_mu, -1)
        kl = (log_mu.exp() * (log_mu - torch.log_softmax(z, -1))).sum()
        (grad,) = torch.autograd.grad(kl, z)
        v = -torch.softmax(z, -1).detach()
        v[s.gen.response_ids[pos]] += 1.0  # v = e_k - pi: the policy-gradient direction in logit space
        assert t["ddot_exact"][i] == pytest.approx(float(grad @ v), rel=1e-4, abs=1e-6)
        assert t["d_full"][i] == pytest.approx(float(kl.detach()), rel=1e-4, abs=1e-6)
        checked += 1
    assert checked >= 5 and np.abs(t["ddot_exact"][first]).max() > 1e-3  # pi has moved: the values are not rounding


def test_bracket_contains_the_exact_ddot_on_every_token(stale_tokens):
    _, t = stale_tokens
    v = t["valid"]
    exact = t["ddot_exact"][v]
    assert v.sum() > 50 and np.isfinite(exact).all()
    # the bracket the method sees (float32, the stored K = 5 lists)
    assert np.all(t["bracket_lo"][v] - 1e-5 <= exact) and np.all(exact <= t["bracket_hi"][v] + 1e-5)
    for k in (2, 5, 20):  # float64 from the full log-probabilities, re-cut (2, 5) or recomputed (20 >= |V| = 17)
        assert np.all(t[f"bracket_lo_k{k}"][v] - est.CONTAIN_TOL <= exact) and np.all(
            exact <= t[f"bracket_hi_k{k}"][v] + est.CONTAIN_TOL
        )
    assert (
        np.mean(t["bracket_hi_k2"][v] - t["bracket_lo_k2"][v])
        > np.mean(t["bracket_hi_k5"][v] - t["bracket_lo_k5"][v])
        > 0
    )
    # K >= |V|: no tail, both estimators are the exact value; K = stored: the float64 re-computation of what the method
    # saw
    for e in ("agg", "uniform"):
        np.testing.assert_allclose(t[f"ddot_{e}_k20"][v], exact, atol=1e-12)
        np.testing.assert_allclose(t[f"ddot_{e}_k5"][v], t[f"ddot_{e}"][v], atol=1e-5)


def test_unmasked_update_gives_every_criterion_s_kept_tokens_a_gradient(analysis_runs):
    replay = load_replay(analysis_runs / "grpo-seed0", 2, policy_step=3, update_name="unmasked")
    assert replay.update.method == "dppo" and replay.method.params.deltas == (float("inf"), float("inf"))
    n = replay.n_tokens
    grads, keeps, adv, valid = torch.zeros(n, dtype=torch.float64), {}, torch.zeros(n), torch.zeros(n, dtype=torch.bool)

    def before(mb, idx, out, losses, u):
        b = out.batch
        tok = token_index(replay, idx)
        adv[tok], valid[tok] = out.advantages.detach().float(), b.valid
        lo, hi = ddot_kl_bracket(b)
        for c, k in keep_decisions(
            out.advantages, log_ratio(b), divergence_rate(b, "kl", "agg"), divergence_rate(b, "kl", "uniform"), lo, hi
        ).items():
            keeps.setdefault(c, torch.zeros(n, dtype=torch.bool))[tok] = k

        def hook(g, tok=tok):  # d loss / d log pi_k of each token
            grads[tok] = g.detach().double()

        b.logp.register_hook(hook)

    replay_step(replay, replay.cfg.seed, 2, before)
    live = valid & (adv != 0)
    assert live.sum() > 20
    for c in (*CRITERIA, "bracket_keep", "bracket_mask"):
        kept = keeps[c] & live
        assert kept.any() and (grads[kept] != 0).all(), c
    assert (grads[live] != 0).all() and (grads[~live] == 0).all()


def test_estimators_command_reports_every_k(analysis_runs, tmp_path):
    folder = tmp_path / "results"
    out = _cli(
        "analyze",
        "estimators",
        "--run",
        "grpo-seed2",
        "--out",
        str(analysis_runs),
        "--steps",
        "2",
        "--policy-step",
        "3",
        "--k",
        "2,5,20",
        "--output",
        str(folder),
    )
    assert "stored" in out and "recomputed" in out and "bracket certifies" in out
    res = json.loads((folder / "estimators-step2-unmasked.json").read_text())
    assert res["ks"] == [2, 5, 20] and res["stored_k"] == 5 and res["vocab_size"] == 17
    assert res["mu_recompute_max_abs_logp_diff"] < 1e-4
    for name in est.SUBSETS:
        block = res["subsets"][name]
        assert [block["k"][k]["source"] for k in ("2", "5", "20")] == ["stored", "stored", "recomputed"]
        if block["n_tokens"]:
            for k in ("2", "5", "20"):
                assert block["k"][k]["bracket"]["contains_frac"] == 1.0
                cc = block["k"][k]["bracket"]["certified_correct"]
                assert cc is None or cc == 1.0  # a certified sign is never wrong
            assert block["k"]["20"]["agg"]["sign_agree"] == 1.0 and block["k"]["20"]["bracket"]["certified_frac"] > 0.99
    assert res["subsets"]["moved"]["n_tokens"] > 50
    t = read_table(folder / res["tokens_file"])
    assert {"ddot_exact", "ddot_agg_k2", "bracket_hi_k20", "pi_tail_k5"} <= set(t)
    assert (folder / "estimators-step2-unmasked.png").stat().st_size > 1000


# --------------------------------------------------------------------------- bad requests


def _copy_run(src, dest, edit=None):
    shutil.copytree(src, dest)
    if edit:
        edit(dest)
    return dest


def _other_task(root):
    from masktrl.config import from_dict
    from masktrl.runs.store import RunStore

    cfg = yaml.safe_load((root / "run.yaml").read_text())
    cfg["task"]["digits"] = 2
    RunStore(root).record_config(from_dict(cfg))  # recorded with its hash, as a run of that task would have it


def _files(*folders):
    return sorted(str(p) for f in folders for p in f.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["disagreement", "--run", "{runs}/grpo-seed0", "--run", "{tmp}/other-task"],
            "runs of different tasks cannot be pooled: grpo-seed0 has task.digits=1, other-task has task.digits=2",
        ),
        (
            ["disagreement", "--run", "{tmp}/no-rollout", "--steps", "2"],
            "rollouts.parquet: missing (stage step/000002/rollout)",
        ),
        (
            ["disagreement", "--run", "{tmp}/no-checkpoint", "--steps", "2"],
            "starts from checkpoint 1, which is not stored",
        ),
        (
            ["estimators", "--run", "{tmp}/no-checkpoint", "--steps", "2", "--policy-step", "3"],
            "behaviour policy, checkpoint 1",
        ),
        (["disagreement", "--run", "{runs}/grpo-seed0", "--steps", "2:9"], "step 4 is out of range"),
        (["disagreement", "--run", "{runs}/grpo-seed0", "--steps", "2..3"], "--steps"),
        (
            ["disagreement", "--run", "{runs}/grpo-seed0", "--update-method", "nosuch"],
            "unknown --update-method 'nosuch'",
        ),
        (["estimators", "--run", "{runs}/grpo-seed0", "--k", "5,x"], "--k"),
        (["disagreement", "--run", "{runs}/grpo-seed0", "--pairs", "ratio:nosuch"], "--pairs"),
    ],
)
def test_bad_requests_are_one_error_line_and_write_nothing(analysis_runs, tmp_path, cli_error, args, needle):
    seed0 = analysis_runs / "grpo-seed0"
    _copy_run(seed0, tmp_path / "other-task", _other_task)
    _copy_run(seed0, tmp_path / "no-rollout", lambda r: (r / "steps" / "000002" / "rollouts.parquet").unlink())
    _copy_run(seed0, tmp_path / "no-checkpoint", lambda r: shutil.rmtree(r / "checkpoints" / "000001"))
    before = _files(analysis_runs, tmp_path)
    assert needle in cli_error("analyze", *[a.format(runs=analysis_runs, tmp=tmp_path) for a in args])
    assert _files(analysis_runs, tmp_path) == before
