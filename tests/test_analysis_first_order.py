"""The replayed update under control and the first-order decomposition of ΔD
(masktrl/analysis/first_order.py): the optimizer's step split into parts that sum to the measured
weight change; with one minibatch, plain SGD and a small learning rate the first-order prediction
has the sign of the measured ΔD; the parts' directional derivatives sum to the total; bad
choices are one-line errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from masktrl.analysis import first_order as fo
from masktrl.analysis.step_replay import load_replay
from masktrl.analysis.token_replay import record_tokens
from masktrl.errors import MasktrlError


def test_adamw_step_parts_sum_to_the_weight_change():
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.05, weight_decay=0.1)
    x = torch.randn(7, 5)
    for it in range(3):
        snap = fo.snapshot(opt)
        opt.zero_grad()
        lin(x).square().sum().backward()
        opt.step()
        parts = fo.step_parts(opt, snap)
        for i, total in enumerate(parts["total"]):
            s = parts["decay"][i] + parts["momentum"][i] + parts["gradient"][i]
            assert torch.allclose(s, total, atol=1e-6), it
        assert (it == 0) == all(float(m.abs().max()) == 0 for m in parts["momentum"])  # no momentum at the first step
        assert all(float(d.abs().max()) > 0 for d in parts["decay"])


def test_sgd_step_parts_are_the_gradient_step():
    lin = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    snap = fo.snapshot(opt)
    lin(torch.ones(3, 4)).sum().backward()
    opt.step()
    parts = fo.step_parts(opt, snap)
    for g, total, p in zip(parts["gradient"], parts["total"], lin.parameters()):
        assert torch.allclose(g, total, atol=1e-7) and torch.allclose(g, -0.1 * p.grad)


def test_directional_derivatives_equal_finite_differences():
    torch.manual_seed(1)
    lin = torch.nn.Linear(4, 6).double()
    x = torch.randn(9, 4, dtype=torch.float64)
    params = list(lin.parameters())
    u = [torch.randn_like(p) for p in params]
    vals = torch.log_softmax(lin(x), -1)[:, 0]
    got = fo.directional(vals, params, {"u": u})["u"]
    eps = 1e-6
    with torch.no_grad():
        for p, d in zip(params, u):
            p.add_(eps * d)
        up = torch.log_softmax(lin(x), -1)[:, 0]
        for p, d in zip(params, u):
            p.sub_(2 * eps * d)
        down = torch.log_softmax(lin(x), -1)[:, 0]
    assert torch.allclose(got, (up - down) / (2 * eps), atol=1e-8)


@pytest.mark.parametrize(
    "args, needle",
    [
        (("nesterov", None, False), "--replay-optimizer must be one of run, sgd, adamw"),
        (("sgd", -1e-3, False), "--replay-lr must be a positive number"),
        (("adamw", 0.0, False), "--replay-lr must be a positive number"),
        (("adamw", math.inf, False), "--replay-lr must be a positive number"),
        (("sgd", 1e-3, True), "--reset-moments needs an optimizer with moments"),
    ],
)
def test_bad_choices_are_one_line_errors(args, needle):
    with pytest.raises(MasktrlError, match=needle.replace("(", r"\(")):
        fo.check_replay_optimizer(*args)


def _stale(analysis_runs, optimizer):
    return load_replay(analysis_runs / "grpo-seed0", 2, policy_step=3, update_name="unmasked", optimizer=optimizer)


def test_one_minibatch_sgd_small_lr_first_order_has_the_measured_sign(analysis_runs):
    """Property on the toy policy: a single minibatch, plain SGD at lr 1e-2, from a checkpoint two
    steps after the behaviour policy (pi != mu): sign(first-order prediction) = sign(measured ΔD)
    on >= 95% of the tokens whose ΔD is above float32 rounding of D."""
    replay = _stale(analysis_runs, fo.check_replay_optimizer("sgd", 1e-2))
    t = record_tokens(replay, replay.cfg.seed, 1, decompose_delta=0.0, own_tokens=8)
    dd = t["d_one"] - t["d"]
    sel = t["valid"] & (np.abs(dd) > 1e-6)  # every token moves: the other tokens' gradients reach it
    assert sel.sum() > 60
    agree = np.mean(np.sign(t["fo_total"][sel]) == np.sign(dd[sel]))
    assert agree >= 0.95, agree
    assert np.all(t["fo_momentum"] == 0) and np.all(t["fo_decay"] == 0)  # SGD: the gradient is the whole step
    np.testing.assert_allclose(t["fo_total"], t["fo_gradient"], atol=1e-5 * np.abs(t["fo_total"]).max())
    assert t["fo_grad_rel_mismatch"].max() < 1e-4  # the reconstructed gradient is the one the step used
    assert replay.lr_used == 1e-2


def test_adamw_parts_sum_to_the_total_and_own_plus_rest_to_the_gradient(analysis_runs):
    replay = _stale(analysis_runs, fo.ReplayOptimizer())  # the run's AdamW with its stored moments
    t = record_tokens(replay, replay.cfg.seed, 2, decompose_delta=0.0, own_tokens=6)
    v = t["valid"].astype(bool)
    parts = t["fo_decay"] + t["fo_momentum"] + t["fo_own"] + t["fo_rest"]
    own = np.isfinite(t["fo_own"])
    assert own.sum() == 12  # 6 per minibatch
    scale = np.abs(t["fo_total"][v]).max()
    np.testing.assert_allclose(parts[own], t["fo_total"][own], atol=2e-3 * scale)
    np.testing.assert_allclose(
        (t["fo_decay"] + t["fo_momentum"] + t["fo_gradient"])[v], t["fo_total"][v], atol=2e-3 * scale
    )
    assert np.abs(t["fo_momentum"][v]).max() > 0  # moments from checkpoint 3
    summary = fo.summarize_parts(t, 0.0, ("ratio", "ddot_agg"))
    assert summary["n_own"] <= 12 and 0 <= summary["momentum_outweighs_gradient_frac"] <= 1
    assert set(summary["unsafe_keep"]["ratio"]) >= {"measured", "total", "own", "rest", "momentum"}


def test_reset_moments_gives_every_update_a_fresh_adam_state(analysis_runs):
    replay = _stale(analysis_runs, fo.check_replay_optimizer("run", None, True))
    t = record_tokens(replay, replay.cfg.seed, 2, decompose_delta=0.0, own_tokens=0)
    assert np.all(t["fo_momentum"] == 0)
    assert np.all(np.isnan(t["fo_own"]))
