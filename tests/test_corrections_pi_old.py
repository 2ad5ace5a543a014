"""The corrections' ratio against the training engine's pi_old (docs/METHODS.md §14.3, issue #40.1):
with pi_old = mu the corrected icepop and token-tis are plain GRPO bit for bit (float32, one
minibatch), their weight is verl's / OpenRLHF's formula on pi_old / mu while pi moves away from
pi_old, ``ref: current`` keeps masktrl's own bypass variant, and ``denominator: kept`` is verl's
``modified_response_mask``."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from masktrl.methods import aggregate, corrected_token_losses, get_method, make_correction, make_params
from masktrl.methods.corrections import kept_batch
from tests.test_methods_corrections import SEQ_LEN, V, logits_case
from tests.test_methods_reference import batch_from_logits


def _f32_batch(seed: int):
    """A float32 batch whose pi differs from mu, with the logits z [N, V] that carry the gradient."""
    rows, adv, seq = logits_case(seed)
    z = torch.stack([r.z for r in rows]).float().clone().requires_grad_(True)
    b = batch_from_logits(rows, z.double(), V, seq)
    f = lambda t: t.detach().float()  # noqa: E731
    lp = torch.log_softmax(z, -1)
    logp = lp.gather(1, b.sampled_ids[:, None]).squeeze(1)
    batch = replace(
        b,
        logp=logp,
        behavior_logp=f(b.behavior_logp),
        topk_logp=f(b.topk_logp),
        topk_behavior_logp=f(b.topk_behavior_logp),
    )
    return batch, adv.float(), z


def _run(batch, adv, z, correction=None, old=None):
    """(token losses, correction, aggregate, its gradient at z), the policy forward rebuilt from z."""
    logp = torch.log_softmax(z, -1).gather(1, batch.sampled_ids[:, None]).squeeze(1).to(batch.logp.dtype)
    batch = replace(batch, logp=logp)
    m, p = get_method("grpo"), make_params("grpo")
    if correction is None:
        out, corr = m.token_losses(batch, adv, p), None
    else:
        old_lp, old_top = old
        out, corr, _ = corrected_token_losses(
            m, batch, adv, p, make_correction(correction), old_logp=old_lp, old_topk_logp=old_top
        )
    loss = m.aggregate(p, out.loss, batch, horizon=SEQ_LEN)
    (g,) = torch.autograd.grad(loss, z)
    return out, corr, loss, g


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
@pytest.mark.parametrize(
    "kind,kw", [("icepop", {}), ("icepop", {"lo": 0.8, "hi": 1.25}), ("token-tis", {}), ("token-tis", {"cap": 1.1})]
)
def test_pi_old_equal_to_mu_is_plain_grpo_bit_for_bit(kind, kw, mode):
    """float32, one minibatch, pi_old = mu (the engine samples from the trainer's own copy): rho = 1
    on every token, so the correction is the identity, whatever pi is (pi != mu here)."""
    batch, adv, z = _f32_batch(21)
    assert not torch.equal(batch.logp.detach(), batch.behavior_logp)
    plain, _, lp, gp = _run(batch, adv, z)
    old = (batch.behavior_logp.clone(), batch.topk_behavior_logp.clone())  # pi_old = mu
    out, corr, lc, gc = _run(batch, adv, z, {"kind": kind, "mode": mode, **kw}, old)
    assert corr.factor.dtype == torch.float32 and bool((corr.factor == 1).all())
    assert torch.equal(out.loss, plain.loss) and torch.equal(out.mask, plain.mask)
    assert torch.equal(lc, lp) and torch.equal(gc, gp)


def test_ref_current_is_the_old_bypass_variant_and_does_not_reduce():
    """``ref: current`` (masktrl's own): rho = sg(pi)/mu even when pi_old = mu, so token-tis caps
    the bypass ratio pi/mu at 2 (a soft dual clip for A < 0) and is not plain GRPO."""
    batch, adv, z = _f32_batch(22)
    _, _, lp, gp = _run(batch, adv, z)
    old = (batch.behavior_logp.clone(), batch.topk_behavior_logp.clone())
    _, corr, lc, gc = _run(batch, adv, z, {"kind": "token-tis", "cap": 1.05, "ref": "current"}, old)
    rho = (batch.logp.detach() - batch.behavior_logp).exp()
    want = torch.where(rho > 1.05, 1.05 / rho, torch.ones_like(rho))
    assert torch.allclose(corr.factor, want, rtol=1e-6)
    assert not torch.equal(gc, gp)


def _pi_old_far(batch, seed: int):
    gen = torch.Generator().manual_seed(seed)
    old = (batch.behavior_logp + 0.5 * torch.randn(batch.n, generator=gen).to(batch.behavior_logp.dtype)).clamp_max(0.0)
    return torch.where(batch.valid, old, batch.behavior_logp), batch.topk_behavior_logp.clone()


@pytest.mark.parametrize("mode", ["bypass", "decoupled"])
def test_weight_is_verl_and_openrlhf_formula_on_pi_old_over_mu(mode):
    """pi_old != mu and pi != pi_old. verl (b178a3cd) trainer/ppo/rollout_corr_helper.py
    compute_rollout_correction_weights, lines 531-534 and 562: w = exp(clamp(old - rollout, -20, 20)).clamp(max=C);
    OpenRLHF (3c3be623) openrlhf/models/loss.py PolicyLoss.forward, lines 199-217: rollout_log_ratio =
    old_log_probs - rollout_log_probs; icepop: exp(.) * (lo <= exp(.) <= hi); tis: exp(.).clamp(lo, hi).
    The token's weight relative to mu is that formula in both modes; the factor on the method's loss
    is the formula itself in decoupled mode and formula / rho_old in bypass mode (its ratio is pi/mu)."""
    batch, adv, z = _f32_batch(23)
    old_lp, old_top = _pi_old_far(batch, 5)
    valid = batch.valid
    lr = torch.where(valid, old_lp - batch.behavior_logp, torch.zeros_like(old_lp))
    r = lr.exp()
    for cap in (2.0, 1.3):
        verl = torch.exp(lr.clamp(-20, 20)).clamp(max=cap)
        _, corr, _, _ = _run(batch, adv, z, {"kind": "token-tis", "cap": cap, "mode": mode}, (old_lp, old_top))
        assert torch.allclose(corr.weight[valid], verl[valid], rtol=1e-6)
        want = verl if mode == "decoupled" else torch.where(r > cap, verl / r, torch.ones_like(r))
        assert torch.allclose(corr.factor[valid], want[valid], rtol=1e-6)
    lo, hi = 0.5, 5.0  # OpenRLHF's default thresholds
    icepop = r * ((r >= lo) & (r <= hi))
    _, corr, _, _ = _run(batch, adv, z, {"kind": "icepop", "mode": mode}, (old_lp, old_top))
    assert 0 < int((~corr.keep[valid]).sum()) < int(valid.sum())
    assert torch.allclose(corr.weight[valid], icepop[valid], rtol=1e-6)
    want = icepop if mode == "decoupled" else ((r >= lo) & (r <= hi)).float()
    assert torch.equal(corr.factor[valid] != 0, want[valid] != 0)
    if mode == "bypass":
        assert torch.equal(corr.factor[valid], want[valid])
    tis = r.clamp(min=lo, max=hi)
    _, corr, _, _ = _run(batch, adv, z, {"kind": "token-tis", "floor": lo, "cap": hi, "mode": mode}, (old_lp, old_top))
    assert torch.allclose(corr.weight[valid], tis[valid], rtol=1e-6)


def test_bypass_on_pi_old_carries_the_decoupled_weight():
    """Bypass, ref old: ratio pi/mu times f(rho_old)/rho_old is f(rho_old) * pi/pi_old, the decoupled
    weight, for any pi (only the clip's anchor differs): on unclipped tokens the gradients agree."""
    rows, adv, seq = logits_case(24)
    z = torch.stack([r.z for r in rows]).clone().requires_grad_(True)
    batch = batch_from_logits(rows, z, V, seq)
    gen = torch.Generator().manual_seed(6)
    old_lp = torch.where(
        batch.valid,
        batch.logp.detach() + 1e-3 * torch.randn(batch.n, generator=gen, dtype=torch.float64),
        batch.behavior_logp,
    ).clamp_max(0.0)
    m, p = get_method("grpo"), make_params("grpo", eps_low=1.0, eps_high=math.inf)  # no clip: only the weights count
    grads = {}
    for mode in ("bypass", "decoupled"):
        out, _, _ = corrected_token_losses(
            m,
            batch,
            adv,
            p,
            make_correction({"kind": "token-tis", "cap": 1.1, "mode": mode}),
            old_logp=old_lp,
            old_topk_logp=batch.topk_logp.detach(),
        )
        (grads[mode],) = torch.autograd.grad(out.loss.sum(), z, retain_graph=True)
    assert torch.allclose(grads["bypass"], grads["decoupled"], rtol=1e-10, atol=1e-14)


def test_rs_in_bypass_mode_follows_verl_on_the_current_policy():
    """verl (b178a3cd) trainer/ppo/core_algos.py compute_policy_loss_bypass_mode, lines 2147-2159:
    the rejection mask is computed with old_log_prob=log_prob (the current policy) against the rollout;
    decoupled mode uses the recomputed old_log_probs (rollout_corr_helper.py ~979)."""
    assert make_correction({"kind": "rs"}).ratio_ref == "current"
    assert make_correction({"kind": "rs", "mode": "decoupled"}).ratio_ref == "old"
    for kind in ("token-tis", "seq-tis", "token-mis", "seq-mis", "icepop"):
        assert make_correction({"kind": kind}).ratio_ref == "old" and make_correction({"kind": kind}).needs_old
        assert not make_correction({"kind": kind, "ref": "current"}).needs_old
    assert make_correction({"kind": "opsm"}).ratio_ref is None and not make_correction({"kind": "opsm"}).needs_old
    assert make_correction({"kind": "none", "mode": "decoupled"}).needs_old


@pytest.mark.parametrize(
    "block,needle",
    [
        ({"kind": "icepop", "ref": "engine"}, "ref must be one of"),
        ({"kind": "icepop", "ref": "current", "mode": "decoupled"}, "bypass only"),
        ({"kind": "opsm", "ref": "old"}, "does not apply to kind=opsm"),
        ({"kind": "token-tis", "denominator": "kept"}, "reject tokens"),
        ({"kind": "icepop", "denominator": "valid"}, "denominator must be one of"),
    ],
)
def test_bad_ref_and_denominator_name_the_key(block, needle):
    with pytest.raises(ValueError, match=needle):
        make_correction(block)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_kept_denominator_is_verl_modified_response_mask(agg):
    """verl rollout_corr_helper.py line 371: modified_response_mask = response_mask * final_mask, the
    mask agg_loss divides by (token-mean: sum(loss * mask) / sum(mask)); seq-mean-token-mean: the
    mean over sequences with a kept token of their kept-token means."""
    batch, adv, z = _f32_batch(25)
    batch = replace(
        batch,
        logp=batch.logp.double(),
        behavior_logp=batch.behavior_logp.double(),
        topk_logp=batch.topk_logp.double(),
        topk_behavior_logp=batch.topk_behavior_logp.double(),
    )
    old = _pi_old_far(batch, 7)
    m, p = get_method("grpo"), make_params("grpo", loss_agg=agg)
    out, corr, _ = corrected_token_losses(
        m,
        batch,
        adv.double(),
        p,
        make_correction({"kind": "icepop", "lo": 0.8, "hi": 1.25}),
        old_logp=old[0],
        old_topk_logp=old[1],
    )
    got = aggregate(out.loss, kept_batch(batch, corr), agg)
    mask = (batch.valid & corr.keep).double()
    loss = torch.where(mask > 0, out.loss, torch.zeros_like(out.loss))
    if agg == "token-mean":
        want = loss.sum() / mask.sum()
    else:
        seqs = [s for s in torch.unique(batch.seq_ids).tolist() if mask[batch.seq_ids == s].sum() > 0]
        want = sum(loss[batch.seq_ids == s].sum() / mask[batch.seq_ids == s].sum() for s in seqs) / len(seqs)
    assert 0 < int(mask.sum()) < int(batch.valid.sum())
    assert torch.allclose(got, want, rtol=1e-12)
