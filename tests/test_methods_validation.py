"""Bad input raises ValueError naming the field: TokenBatch, params, registry, functions."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from masktrl.methods import (
    TokenBatch,
    aggregate,
    divergence,
    divergence_rate,
    get_method,
    make_params,
    method_names,
    sis_accept,
    token_losses,
)
from masktrl.methods.diagnostics import token_diagnostics

F64 = torch.float64


def fields(n=4, k=3, **over):
    f = dict(
        logp=torch.full((n,), -1.0, dtype=F64),
        behavior_logp=torch.full((n,), -1.2, dtype=F64),
        sampled_ids=torch.arange(n) % 5,
        topk_ids=torch.arange(k).repeat(n, 1),
        topk_behavior_logp=torch.full((n, k), -1.5, dtype=F64),
        topk_logp=torch.full((n, k), -1.5, dtype=F64),
        seq_ids=torch.zeros(n, dtype=torch.long),
        vocab_size=10,
    )
    f.update(over)
    return f


def good():
    return TokenBatch(**fields())


@pytest.mark.parametrize(
    "field,value",
    [
        ("logp", torch.zeros(3, dtype=F64)),
        ("behavior_logp", torch.zeros(5, dtype=F64)),
        ("sampled_ids", torch.zeros(4, 1, dtype=torch.long)),
        ("seq_ids", torch.zeros(2, dtype=torch.long)),
        ("topk_ids", torch.zeros(3, 3, dtype=torch.long)),
        ("topk_behavior_logp", torch.zeros(4, 2, dtype=F64)),
        ("topk_logp", torch.zeros(4, 4, dtype=F64)),
    ],
)
def test_mismatched_shapes_name_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "logp" else "TokenBatch.(logp|behavior_logp|sampled_ids)"):
        TokenBatch(**fields(**{field: value}))


def test_k_zero_is_rejected():
    with pytest.raises(ValueError, match="topk_ids.*K = 0"):
        TokenBatch(**fields(k=0))


@pytest.mark.parametrize("field", ["logp", "behavior_logp", "topk_behavior_logp", "topk_logp"])
def test_nan_logprobs_name_the_field(field):
    f = fields()
    t = f[field].clone()
    t.view(-1)[1] = math.nan
    f[field] = t
    with pytest.raises(ValueError, match=f"TokenBatch.{field} contains NaN"):
        TokenBatch(**f)


def test_nan_at_padding_is_ignored_and_other_field_checks():
    f = fields()
    f["topk_ids"] = f["topk_ids"].clone()
    f["topk_ids"][0, 2] = -1
    f["topk_behavior_logp"] = f["topk_behavior_logp"].clone()
    f["topk_behavior_logp"][0, 2] = math.nan
    TokenBatch(**f)  # padding values are ignored whatever they are
    with pytest.raises(ValueError, match="topk_ids.*integer"):
        TokenBatch(**fields(topk_ids=torch.zeros(4, 3, dtype=F64)))
    with pytest.raises(ValueError, match="logp must be a floating"):
        TokenBatch(**fields(logp=torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="vocab_size"):
        TokenBatch(**fields(vocab_size=0))
    with pytest.raises(ValueError, match="topk_ids has ids >= vocab_size"):
        TokenBatch(**fields(vocab_size=2, sampled_ids=torch.zeros(4, dtype=torch.long)))
    with pytest.raises(ValueError, match="sampled_ids has ids >= vocab_size"):
        TokenBatch(**fields(vocab_size=3))
    with pytest.raises(ValueError, match="sampled_ids must be >= 0"):
        TokenBatch(**fields(sampled_ids=torch.tensor([0, -1, 0, 0])))
    with pytest.raises(ValueError, match="logp must be a torch.Tensor"):
        TokenBatch(**fields(logp=[0.0] * 4))


def test_functions_name_bad_arguments():
    b = good()
    adv = torch.ones(4, dtype=F64)
    with pytest.raises(ValueError, match="kind"):
        divergence(b, "js")
    with pytest.raises(ValueError, match="rule"):
        divergence(b, "topk-kl", rule="last")
    with pytest.raises(ValueError, match="tail"):
        divergence_rate(b, "kl", "bucket")
    nov = TokenBatch(**fields(vocab_size=None))
    with pytest.raises(ValueError, match="vocab_size"):
        divergence_rate(nov, "kl", "uniform")
    with pytest.raises(ValueError, match="vocab_size"):
        token_losses("pdm", nov, adv, tail="uniform")
    with pytest.raises(ValueError, match="mode"):
        aggregate(torch.zeros(4, dtype=F64), b, "mean")
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(torch.zeros(4, dtype=F64), b, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss must have shape"):
        aggregate(torch.zeros(3, dtype=F64), b, "token-mean")
    with pytest.raises(ValueError, match="advantages"):
        token_losses("grpo", b, torch.ones(3, dtype=F64))
    with pytest.raises(ValueError, match="advantages"):
        token_losses("grpo", b, torch.tensor([1.0, math.nan, 0.0, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="u is required"):
        token_losses("sis", b, adv)
    with pytest.raises(ValueError, match="u must have shape"):
        sis_accept(b, torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="u contains NaN"):
        token_losses("sis", b, adv, u=torch.full((4,), math.nan, dtype=F64))
    with pytest.raises(ValueError, match="advantages"):
        token_diagnostics(b, token_losses("grpo", b, adv), torch.ones(2, dtype=F64))


def test_unknown_method_lists_valid_names():
    with pytest.raises(ValueError) as exc:
        get_method("ppo2")
    for name in ("grpo", "dapo", "gspo", "dppo", "pdm", "sis", "cispo"):
        assert name in str(exc.value)
    assert set(method_names()) == {
        "grpo",
        "dapo",
        "gspo",
        "dppo",
        "pdm",
        "sis",
        "cispo",  # and the baselines of §16
        "sapo",
        "gmpo",
        "clip-cov",
        "kl-cov",
        "topr",
        "m2po",
        "prime-dppo",
        "prime-ipo",
        "two-sided",
        "trm",
        "gpg",
    }
    with pytest.raises(ValueError, match="unknown method"):
        token_losses("ppo2", good(), torch.ones(4, dtype=F64))


def test_unknown_parameter_names_key_and_lists_valid_keys():
    with pytest.raises(ValueError) as exc:
        make_params("grpo", eps=0.1)
    assert "method.eps" in str(exc.value) and "eps_low" in str(exc.value) and "eps_high" in str(exc.value)
    with pytest.raises(ValueError, match="method.tail"):
        token_losses("dppo", good(), torch.ones(4, dtype=F64), tail="agg")


@pytest.mark.parametrize(
    "name,kw,field",
    [
        ("grpo", {"eps_low": -1}, "method.eps_low must be >= 0, got -1"),
        ("grpo", {"eps_high": math.nan}, "method.eps_high"),
        ("grpo", {"eps_low": "0.2"}, "method.eps_low must be a number"),
        ("grpo", {"loss_agg": "sum"}, "method.loss_agg"),
        ("dapo", {"dynamic_sampling": "yes"}, "method.dynamic_sampling"),
        ("dapo", {"overlong_buffer": -3}, "method.overlong_buffer"),
        ("dapo", {"overlong_penalty": -1.0}, "method.overlong_penalty"),
        ("gspo", {"eps_high": -4e-4}, "method.eps_high"),
        ("dppo", {"divergence": "kl"}, "method.divergence"),
        ("dppo", {"delta_pos": -0.1}, "method.delta_pos"),
        ("dppo", {"delta_neg": math.nan}, "method.delta_neg"),
        ("dppo", {"ratio_cap": 0}, "method.ratio_cap"),
        ("dppo", {"rule": "replace"}, "method.rule"),
        ("pdm", {"divergence": "topk-kl"}, "method.divergence"),
        ("pdm", {"tail": "none"}, "method.tail"),
        ("sis", {"base": "dppo"}, "method.base"),
        ("sis", {"eps_low": -0.5}, "method.eps_low"),
        ("sis", {"base": "grpo", "overlong_buffer": 8}, "method.overlong_buffer"),
        ("grpo", {"dual_clip": 1.0}, "method.dual_clip must be > 1"),
        ("dapo", {"dual_clip": 0.5}, "method.dual_clip must be > 1"),
        ("grpo", {"dual_clip": math.nan}, "method.dual_clip must be finite"),
        ("grpo", {"dual_clip": "3"}, "method.dual_clip must be a number"),
        ("sis", {"base": "grpo", "dual_clip": 1.0}, "method.dual_clip must be > 1"),
        ("sis", {"base": "gspo", "dual_clip": 3.0}, "method.dual_clip applies only with method.base=grpo or dapo"),
    ],
)
def test_bad_param_values_name_the_field(name, kw, field):
    with pytest.raises(ValueError, match=field):
        make_params(name, **kw)


def test_params_are_frozen_and_infinite_deltas_allowed():
    p = make_params("dppo", delta_pos=math.inf, delta_neg=math.inf)
    assert p.deltas == (math.inf, math.inf)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.delta_pos = 0.1  # frozen dataclass
    m = get_method("grpo")
    with pytest.raises(ValueError, match="GRPOParams"):
        m.aggregation(make_params("dapo"))
