"""The mismatch statistics of a rollout batch (rollout/mismatch.py) on hand-computed values."""

import math

import pytest
import torch

from masktrl.rollout.mismatch import KEYS, mismatch_stats


def test_hand_computed_values():
    pi = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    mu = pi + torch.tensor([0.0, 0.1, -0.2, 0.7], dtype=torch.float64)  # d = log mu - log pi_old
    st = mismatch_stats(mu, pi)
    assert set(st) == set(KEYS)
    assert st["mismatch/logp_abs_mean"] == pytest.approx(0.25, abs=1e-12)
    # |d| sorted [0, 0.1, 0.2, 0.7]; the 0.99 quantile sits at position 0.99 * 3 = 2.97: 0.2 + 0.97 * 0.5
    assert st["mismatch/logp_abs_p99"] == pytest.approx(0.685, abs=1e-12)
    k3 = [math.exp(-d) - 1 + d for d in (0.0, 0.1, -0.2, 0.7)]  # (r - 1) - log r with r = exp(-d)
    assert k3 == pytest.approx([0.0, 0.0048374180359595, 0.0214027581601699, 0.1965853037914095], abs=1e-15)
    assert st["mismatch/kl_k3"] == pytest.approx(sum(k3) / 4, abs=1e-12)
    assert st["mismatch/frac_gt_0.5"] == 0.25 and st["mismatch/tokens"] == 4


def test_identical_and_invalid_tokens():
    pi = torch.tensor([-1.0, -2.0, float("-inf"), -0.3])
    mu = torch.tensor([-1.0, -2.0, -1.0, float("-inf")])  # an invalid token (mu = 0) and a pi = 0 one: both left out
    st = mismatch_stats(mu, pi)
    assert st["mismatch/tokens"] == 2
    assert st["mismatch/logp_abs_mean"] == st["mismatch/kl_k3"] == st["mismatch/frac_gt_0.5"] == 0.0
    empty = mismatch_stats(torch.tensor([float("-inf")]), torch.tensor([-1.0]))
    assert empty["mismatch/tokens"] == 0 and math.isnan(empty["mismatch/kl_k3"])
    with pytest.raises(ValueError):
        mismatch_stats(torch.zeros(3), torch.zeros(2))


def test_k3_estimates_the_kl_and_is_never_negative():
    g = torch.Generator().manual_seed(0)
    logits_mu = torch.randn(20, generator=g, dtype=torch.float64)
    logits_pi = logits_mu + 0.3 * torch.randn(20, generator=g, dtype=torch.float64)
    lmu, lpi = torch.log_softmax(logits_mu, 0), torch.log_softmax(logits_pi, 0)
    kl = (lmu.exp() * (lmu - lpi)).sum().item()
    k = torch.multinomial(lmu.exp(), 200_000, replacement=True, generator=g)  # k ~ mu
    st = mismatch_stats(lmu[k], lpi[k])
    assert st["mismatch/kl_k3"] == pytest.approx(kl, rel=0.03)
    d = torch.linspace(-5, 5, 101, dtype=torch.float64)
    assert (torch.expm1(-d) + d >= 0).all()


def test_dynamics_plots_the_mismatch_when_logged():
    from types import SimpleNamespace

    from masktrl.analysis.dynamics import METRICS, metric_list

    plain = SimpleNamespace(metrics=[{"step": 1, "reward_mean": 0.5}])
    measured = SimpleNamespace(metrics=[{"step": 1, "mismatch/logp_abs_mean": 0.1, "mismatch/kl_k3": 0.01}])
    assert metric_list([plain]) == METRICS
    keys = [k for k, _ in metric_list([plain, measured])]
    assert keys[: len(METRICS)] == [k for k, _ in METRICS]
    assert keys[len(METRICS) :] == ["mismatch/logp_abs_mean", "mismatch/kl_k3"]


def test_sweep_method_specs_take_dotted_block_keys():
    from masktrl.config import split_method
    from masktrl.errors import ConfigError

    assert split_method("grpo:correction.kind=token-tis:correction.mode=decoupled") == (
        "grpo",
        ["method.correction.kind=token-tis", "method.correction.mode=decoupled"],
    )
    for bad in ("grpo:correction..kind=x", "grpo:.kind=x", "grpo:kind.=x", "grpo:a/b=1"):
        with pytest.raises(ConfigError, match="NAME:KEY=VALUE"):
            split_method(bad)


def test_the_progress_bar_shows_the_gap_only_when_the_engine_samples_from_another_copy():
    from masktrl.config import from_dict
    from masktrl.recipes.train import progress_info

    row = {"reward_mean": 0.25, "tokens_per_s": 5511.0, "mismatch/logp_abs_mean": 0.0159}
    plain = "reward 0.250  5511 tok/s"
    assert progress_info(row, from_dict({})) == plain  # the model itself: its gap is float rounding
    assert progress_info(row, from_dict({"rollout": {"dtype": "float32"}})) == plain
    assert progress_info(row, from_dict({"rollout": {"quantization": "fp8"}})) == plain + "  |Δlogp| 0.016"
    assert progress_info(row, from_dict({"rollout": {"dtype": "bfloat16"}})) == plain + "  |Δlogp| 0.016"
    assert (
        progress_info({**row, "mismatch/logp_abs_mean": float("nan")}, from_dict({"rollout": {"dtype": "bfloat16"}}))
        == plain
    )
    assert (
        progress_info(
            {k: v for k, v in row.items() if not k.startswith("mismatch/")},
            from_dict({"rollout": {"quantization": "fp8"}}),
        )
        == plain
    )  # rollout.mismatch off: nothing measured
