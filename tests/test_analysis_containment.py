"""The certified bracket in a replay, in float64: from the recomputed mu at the list's ids it
contains the exact full-KL Ḋ on every token (1e-12); from the stored list (the engine's float32
numbers) within the per-token tolerance 2 sum_S |mu stored - mu recomputed|, which bounds how far
the stored list moves lo and hi; and the exact top-K Ḋ of the replay equals autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from masktrl.analysis import estimators as est
from masktrl.analysis.step_replay import load_behaviour, load_replay
from masktrl.analysis.token_replay import record_tokens
from masktrl.models.loading import load_model_and_tokenizer
from masktrl.runs.store import RunStore

KS = (1, 2, 3, 5, 20)


@pytest.fixture(scope="module")
def tokens(analysis_runs):
    replay = load_replay(analysis_runs / "grpo-seed0", 2, policy_step=3, update_name="unmasked")
    return replay, record_tokens(replay, replay.cfg.seed, 2, behaviour=load_behaviour(replay), ks=KS)


def test_same_mu_bracket_contains_the_exact_value_on_every_token(tokens):
    _, t = tokens
    v = t["valid"]
    exact = t["ddot_exact"][v]
    for k in KS:
        lo, hi = t[f"bracket_lo_same_mu_k{k}"][v], t[f"bracket_hi_same_mu_k{k}"][v]
        assert np.all(lo - est.SAME_MU_TOL <= exact) and np.all(exact <= hi + est.SAME_MU_TOL), k


def test_stored_list_bracket_contains_within_the_derived_tolerance(tokens):
    _, t = tokens
    v = t["valid"]
    exact = t["ddot_exact"][v]
    for k in KS:
        lo, hi, tol = t[f"bracket_lo_k{k}"][v], t[f"bracket_hi_k{k}"][v], t[f"contain_tol_k{k}"][v]
        lo_s, hi_s = t[f"bracket_lo_same_mu_k{k}"][v], t[f"bracket_hi_same_mu_k{k}"][v]
        mass = (tol - 1e-12) / 2
        # the bound the tolerance rests on: |d lo| <= sum |d mu|, |d hi| <= 2 sum |d mu|
        assert np.all(np.abs(lo - lo_s) <= mass + 1e-12) and np.all(np.abs(hi - hi_s) <= 2 * mass + 1e-12), k
        assert np.all(lo - tol <= exact) and np.all(exact <= hi + tol), k
    assert t["contain_tol_k20"][v].max() == pytest.approx(1e-12)  # K = 20 >= |V| uses the recomputed list
    assert t["contain_tol_k5"][v].max() > 1e-9  # the stored lists are the engine's float32 numbers


def test_summary_reports_full_containment_at_every_k(tokens):
    _, t = tokens
    table = {**t, "replicate": np.zeros(len(t["d"]), dtype=np.int64)}
    res = est.summarize(table, KS, 0.0, 5)
    for name in est.SUBSETS:
        for k in KS:
            b = res[name]["k"][str(k)]["bracket"]
            assert b["contains_frac"] == 1.0 and b["contains_frac_same_mu"] == 1.0, (name, k)
            assert b["certified_correct"] in (1.0,) or np.isnan(b["certified_correct"])


def test_replay_topk_exact_equals_autograd_of_the_topk_kl(analysis_runs, tokens):
    replay, t = tokens
    root = analysis_runs / "grpo-seed0"
    pi_model, _ = load_model_and_tokenizer(RunStore(root).policy_path(3), "float32")
    temp = replay.cfg.rollout.temperature
    first = np.flatnonzero((t["minibatch"] == 0) & t["valid"])  # trained from checkpoint 3 itself
    checked = 0
    for i in first[:: max(1, len(first) // 6)]:
        s, pos = replay.samples[t["sample"][i]], t["position"][i]
        ids = torch.tensor([s.prompt_ids + s.gen.response_ids])
        at = len(s.prompt_ids) - 1 + pos
        k = s.gen.response_ids[pos]
        z = (pi_model(ids).logits[0, at].double() / temp).detach()
        listed = [j for j in s.gen.topk_ids[pos] if j >= 0]
        mu_list = {j: float(np.exp(x)) for j, x in zip(s.gen.topk_ids[pos], s.gen.topk_logp[pos]) if j >= 0}
        mu_list[k] = float(np.exp(s.gen.logp[pos]))  # the sampled token's entry is the engine's log mu_k
        support = list(dict.fromkeys(listed + [k]))
        mu = torch.tensor([mu_list[j] for j in support], dtype=torch.float64)
        mu_t = max(0.0, 1.0 - float(mu.sum()))
        v = -torch.softmax(z, -1)
        v[k] += 1.0
        tt = torch.zeros((), dtype=torch.float64, requires_grad=True)
        pi = torch.softmax(z + tt * v, -1)
        p_s = pi[torch.tensor(support)]
        d = (mu * (mu.log() - p_s.log())).sum() + mu_t * (np.log(mu_t) - torch.log(1 - p_s.sum()))
        (g,) = torch.autograd.grad(d, tt)
        assert t["ddot_topk_exact"][i] == pytest.approx(float(g), rel=1e-5, abs=1e-7)
        checked += 1
    assert checked >= 5


def test_missing_behaviour_checkpoint_names_the_steps_that_work(analysis_runs, tmp_path):
    import shutil

    from masktrl.analysis.replicates import prepare
    from masktrl.errors import ArtifactError

    root = tmp_path / "no-checkpoint"
    shutil.copytree(analysis_runs / "grpo-seed0", root)
    shutil.copytree(analysis_runs / ".cache", tmp_path / ".cache")  # step 0 is read from the run's own outputs folder
    shutil.rmtree(root / "checkpoints" / "000001")
    kw = dict(delta=0.15, update="unmasked", partitions=1, policy_step=3, minibatches=None, exact=True)
    with pytest.raises(ArtifactError) as est_err:
        prepare([root], [2], no_exact=False, **kw)  # estimators: it has no --no-exact
    msg = str(est_err.value)
    assert (
        "behaviour policy, checkpoint 1" in msg
        and "steps with both checkpoints: 1, 3" in msg
        and "--no-exact" not in msg
    )
    with pytest.raises(ArtifactError, match=r"steps with both checkpoints: 1, 3 \(or --no-exact\)"):
        prepare([root], [2], **kw)  # disagreement
