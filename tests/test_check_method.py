"""``masktrl check-method``: every registered rule conforms; deliberately broken rules fail with
the property they break named (docs/METHODS.md §17)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from typer.testing import CliRunner

from masktrl.analysis.conformance import check_method, passed
from masktrl.methods import TokenLosses, method_names, register_method, registry
from masktrl.methods.batch import log_ratio, log_ratio_live, seq_index, unit_ratio_log
from masktrl.methods.params import _common, _Protocol


@pytest.mark.parametrize("name", method_names())
def test_every_registered_method_conforms(name):
    rows = check_method(name)
    assert passed(rows), [r for r in rows if r.ok is False]
    assert [r.name for r in rows] == [
        "gradient = value",
        "lists stop-gradient",
        "invalid tokens",
        "finite",
        "on-policy limit",
        "sequence order",
        "packed = padded",
        "params round-trip",
    ]


@pytest.mark.parametrize(
    "name,params",
    [
        ("pdm", {"tail": "exact"}),
        ("pdm", {"tail": "uniform", "divergence": "tv"}),
        ("pdm", {"tail": "bracket"}),
        ("sis", {"base": "gspo"}),
        ("dppo", {"divergence": "binary-kl", "ratio_cap": 2.0}),
        ("grpo", {"dual_clip": 3.0}),
        ("trm", {"divergence": "topk-kl", "delta": 0.05}),
        ("clip-cov", {"clip_cov_ratio": 0.3, "clip_cov_lb": -1e9}),
        ("kl-cov", {"kl_cov_ratio": 0.3}),
        ("sapo", {"tau_pos": 0.01, "tau_neg": 50.0}),
        ("two-sided", {"delta": 1.5}),
    ],
)
def test_variants_conform(name, params):
    from masktrl.methods import make_params

    rows = check_method(name, make_params(name, **params))
    assert passed(rows), [r for r in rows if r.ok is False]


# --------------------------------------------------------------------------- broken rules


@dataclass(frozen=True)
class BrokenParams(_Protocol):
    loss_agg: str = "token-mean"
    dynamic_sampling: bool = False
    adv_norm: str = "group-std"

    def __post_init__(self) -> None:
        _common(self)


def _detached_gradient(batch, adv, p, u):
    """Value -A r, but r from a detached log pi: the gradient is 0, not -A r."""
    r = log_ratio(batch).clamp_max(50).exp()
    return TokenLosses(-adv * r, ~batch.valid, None, None, None, log_ratio(batch))


def _nan_at_large_ratio(batch, adv, p, u):
    """-A r, but NaN where r > 1e20."""
    lr = log_ratio_live(batch)
    loss = -adv * lr.exp()
    loss = torch.where(lr.detach() > 46, torch.full_like(loss, float("nan")), loss)
    return TokenLosses(loss, ~batch.valid, None, None, None, log_ratio(batch))


def _invalid_tokens_count(batch, adv, p, u):
    """A nonzero loss on invalid tokens (junk), and a sequence mean that counts them, so the
    valid tokens' loss depends on the invalid tokens' content."""
    junk = batch.logp.detach() - batch.behavior_logp.clamp_min(-30.0)  # [N] finite junk on invalid tokens
    inv, g = seq_index(batch)
    mean = torch.zeros(g, dtype=junk.dtype).index_add_(0, inv, junk) / torch.bincount(inv, minlength=g).to(junk.dtype)
    coef = -adv * mean[inv].exp()
    return TokenLosses(
        coef * unit_ratio_log(batch).exp() + (~batch.valid).to(coef.dtype),
        ~batch.valid,
        None,
        None,
        None,
        log_ratio(batch),
    )


def _list_gradient(batch, adv, p, u):
    """-A r plus a term in the listed log pi: the logits get a gradient through the lists."""
    lists = torch.where(batch.topk_ids >= 0, batch.topk_logp, torch.zeros_like(batch.topk_logp)).sum(1)
    return TokenLosses(
        -adv * log_ratio_live(batch).exp() + 1e-3 * lists, ~batch.valid, None, None, None, log_ratio(batch)
    )


def _position_weight(batch, adv, p, u):
    """-A r weighted by the token's position in the flattened batch: depends on the sequence order."""
    w = torch.arange(batch.n, dtype=adv.dtype) / max(batch.n, 1)
    return TokenLosses(-adv * w * log_ratio_live(batch).exp(), ~batch.valid, None, None, None, log_ratio(batch))


def _per_batch_length(batch, adv, p, u):
    """-A r divided by N, the number of tokens including invalid ones: padding changes it."""
    return TokenLosses(-adv * log_ratio_live(batch).exp() / batch.n, ~batch.valid, None, None, None, log_ratio(batch))


@dataclass(frozen=True)
class ShadowingParams(_Protocol):
    kl_coef: float = 0.1  # the rule's own coefficient under the name of the shared reference-KL key
    loss_agg: str = "token-mean"
    dynamic_sampling: bool = False
    adv_norm: str = "group-std"

    def __post_init__(self) -> None:
        _common(self)


BROKEN = {
    "broken-lists": (_list_gradient, "lists stop-gradient"),
    "broken-order": (_position_weight, "sequence order"),
    "broken-padding": (_per_batch_length, "packed = padded"),
    "broken-grad": (_detached_gradient, "gradient = value"),
    "broken-nan": (_nan_at_large_ratio, "finite"),
    "broken-invalid": (_invalid_tokens_count, "invalid tokens"),
    "broken-shadow": (_per_batch_length, "params round-trip"),
}


@pytest.fixture
def broken():
    for name, (kernel, _) in BROKEN.items():
        register_method(name, ShadowingParams if name == "broken-shadow" else BrokenParams)(kernel)
    yield
    for name in BROKEN:
        registry._METHODS.pop(name, None)


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_rule_fails_with_the_property_named(broken, name):
    rows = check_method(name)
    failed = {r.name for r in rows if r.ok is False}
    assert BROKEN[name][1] in failed, rows
    assert not passed(rows)


def test_command_exit_codes(broken):
    from masktrl.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["check-method", "grpo"])
    assert ok.exit_code == 0, ok.output
    assert "gradient = value" in ok.output and "conforms" in ok.output
    bad = runner.invoke(app, ["check-method", "broken-nan"])
    assert bad.exit_code == 1 and "finite" in bad.output
    with_set = runner.invoke(app, ["check-method", "sapo", "--set", "method.tau_pos=2"])
    assert with_set.exit_code == 0, with_set.output


@pytest.mark.parametrize(
    "args,message",
    [
        (["check-method", "nope"], "unknown method 'nope'"),
        (["check-method", "sapo", "--set", "method.tau_pos=-1"], "method.tau_pos must be > 0"),
        (["check-method", "grpo", "--set", "train.lr=1"], "takes method.KEY=VALUE"),
        (["check-method", "grpo", "--set", "method.correction.kind=token-tis"], "checks the rule itself"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    from tests.conftest import masktrl

    res = masktrl(*args, cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_rule_from_a_file_conforms_and_a_broken_file_fails(tmp_path):
    """`masktrl check-method path/to/rules.py:name` checks a user's rule (examples/tanh_clip.py),
    its --set parameters included; a file whose gradient does not match its value fails by name."""
    from pathlib import Path

    from tests.conftest import masktrl

    example = Path(__file__).resolve().parent.parent / "examples" / "tanh_clip.py"
    res = masktrl("check-method", f"{example}:tanh_clip", "--set", "method.eps_high=0.5", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "conforms" in res.stdout and "params round-trip" in res.stdout
    src = example.read_text()
    broken = tmp_path / "broken_rule.py"
    # the gradient coefficient doubled (log 4 -> log 8 in r sech^2), the value unchanged: they disagree
    assert "math.log(4.0)" in src
    broken.write_text(src.replace("math.log(4.0)", "math.log(8.0)", 1))
    bad = masktrl("check-method", f"{broken}:tanh_clip", cwd=tmp_path)
    assert bad.returncode == 1 and "gradient = value" in bad.stdout, bad.stdout + bad.stderr
    missing = masktrl("check-method", f"{tmp_path}/nope.py:tanh_clip", cwd=tmp_path)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
